"""An exception in the core process as a Fault message, and back as the same exception in the front end.

The front end re-raises what the core raised, so the CLI, the front ends and the sweeps see the types and messages
they see with the engine in one process (a startup fault: its text and exit status 2; a full queue: 429...). A
StartupError subclass the front end cannot import (npu's: they load torch) is re-raised as a StartupError subclass of
the same name and module, and the core's traceback is its cause (what HYDRA_FULL_ERROR=1 prints).
"""

from __future__ import annotations

import threading
import traceback

from appliance.core.errors import CheckpointError, ConfigError, StartupError, TokenizerError
from appliance.core.planner import InsufficientMemoryError
from appliance.core.request import EngineUnavailableError, QueueFullError, RequestError
from appliance.engine.process import messages as m

# StartupError subclasses a core's fault keeps (a sweep tells "does not fit" from other startup faults by class).
STARTUP_ERRORS: dict[str, type[StartupError]] = {
    "InsufficientMemoryError": InsufficientMemoryError, "CheckpointError": CheckpointError,
    "TokenizerError": TokenizerError}
_stand_ins: dict[tuple[str, str], type[StartupError]] = {}      # the others, made once per (module, name)
_stand_ins_lock = threading.Lock()


class CoreTraceback(Exception):
    """The core's traceback, as the cause of the exception re-raised here (concurrent.futures does the same)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"in the engine core process:\n\"\"\"\n{self.text}\"\"\""


def fault(exc: BaseException) -> m.Fault:
    """An exception as the front end re-raises it (fault_error)."""
    name = type(exc).__name__
    if isinstance(exc, StartupError):
        return m.Fault("startup", str(exc), name, type_module=type(exc).__module__,
                       traceback="".join(traceback.format_exception(exc)))
    if isinstance(exc, RequestError):
        prefix = f"{exc.field}: "
        text = str(exc)
        return m.Fault("request", text[len(prefix):] if text.startswith(prefix) else text, name, exc.field)
    if isinstance(exc, QueueFullError):
        return m.Fault("queue_full", str(exc), name)
    if isinstance(exc, EngineUnavailableError):
        return m.Fault("unavailable", str(exc), name)
    return m.Fault("error", f"{name}: {exc}", name)


def fault_error(fault: m.Fault) -> BaseException:
    """The exception a core's Fault stands for, with the core's message."""
    if fault.kind == "startup":
        exc: StartupError
        if fault.type_name == "ConfigError":          # its constructor takes the issues; the text is what counts
            exc = ConfigError.__new__(ConfigError)
            Exception.__init__(exc, fault.message)
            exc.issues = []
        else:
            exc = startup_error_type(fault)(fault.message)
        if fault.traceback:
            exc.__cause__ = CoreTraceback(fault.traceback)
        return exc
    if fault.kind == "request":
        return RequestError(fault.field or "request", fault.message)
    if fault.kind == "queue_full":
        return QueueFullError(fault.message)
    if fault.kind == "unavailable":
        return EngineUnavailableError(fault.message)
    return RuntimeError(fault.message)


def startup_error_type(fault: m.Fault) -> type[StartupError]:
    """The StartupError subclass a startup fault names: one the front end knows, else a stand-in of the core's
    class name and module (a traceback names it as the core did: npu.backends.BackendUnavailableError)."""
    known = STARTUP_ERRORS.get(fault.type_name)
    if known is not None:
        return known
    if not fault.type_name or fault.type_name == "StartupError":
        return StartupError
    key = (fault.type_module, fault.type_name)
    with _stand_ins_lock:
        if key not in _stand_ins:
            _stand_ins[key] = type(fault.type_name, (StartupError,), {"__module__": fault.type_module or __name__})
        return _stand_ins[key]
