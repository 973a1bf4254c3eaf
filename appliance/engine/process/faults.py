"""An exception in the core process as a Fault message, and back as the same exception in the front end.

The front end re-raises what the core raised, so the CLI, the front ends and the sweeps see the types and messages
they see with the engine in one process (a startup fault: its text and exit status 2; a full queue: 429...).
"""

from __future__ import annotations

from appliance.core.errors import CheckpointError, ConfigError, StartupError, TokenizerError
from appliance.core.planner import InsufficientMemoryError
from appliance.core.request import EngineUnavailableError, QueueFullError, RequestError
from appliance.engine.process import messages as m

# StartupError subclasses a core's fault keeps (a sweep tells "does not fit" from other startup faults by class).
STARTUP_ERRORS: dict[str, type[StartupError]] = {
    "InsufficientMemoryError": InsufficientMemoryError, "CheckpointError": CheckpointError,
    "TokenizerError": TokenizerError}


def fault(exc: BaseException) -> m.Fault:
    """An exception as the front end re-raises it (fault_error)."""
    name = type(exc).__name__
    if isinstance(exc, StartupError):
        return m.Fault("startup", str(exc), name)
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
        if fault.type_name == "ConfigError":          # its constructor takes the issues; the text is what counts
            exc = ConfigError.__new__(ConfigError)
            Exception.__init__(exc, fault.message)
            exc.issues = []
            return exc
        return STARTUP_ERRORS.get(fault.type_name, StartupError)(fault.message)
    if fault.kind == "request":
        return RequestError(fault.field or "request", fault.message)
    if fault.kind == "queue_full":
        return QueueFullError(fault.message)
    if fault.kind == "unavailable":
        return EngineUnavailableError(fault.message)
    return RuntimeError(fault.message)
