"""What the two front ends (gRPC and HTTP) share: the server's state and the engine interface they drive.

Both read one ServerState, so health, admission and shutdown agree; both drive the engine through EngineClient,
which the Engine (appliance/engine/engine.py) and the server tests' stand-in both provide.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Callable, Protocol

from appliance.core.request import RequestLimits, RequestOutput, SamplingParams
from appliance.core.startup_report import StartupReport

if TYPE_CHECKING:
    from appliance.core.tokenizer import Tokenizer
    from appliance.engine.stats import EngineStats


class ServerState(StrEnum):
    """starting -> serving -> draining -> stopped; failed when the engine stops while serving (a rank died)."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


class RequestHandle(Protocol):
    """A submitted request, as a front end holds it: it can abort it."""

    def abort(self) -> None: ...


class EngineClient(Protocol):
    """The engine as the front ends use it: lifecycle (prepare, start, drain, shutdown), requests and live figures.

    Thread model: every method but stats() may block and runs off the event loop; on_output is called on the
    engine's thread."""

    report: StartupReport | None
    limits: RequestLimits | None          # set by start()
    failure: str | None                   # why the engine stopped for good (a rank died); None while it runs
    on_failure: Callable[[str], None] | None

    @property
    def tokenizer(self) -> Tokenizer: ...

    def prepare(self) -> object: ...

    def start(self) -> StartupReport: ...

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None] | None = None) -> RequestHandle: ...

    def drain(self, grace_s: float) -> None: ...

    def shutdown(self) -> None: ...

    def stats(self) -> EngineStats: ...
