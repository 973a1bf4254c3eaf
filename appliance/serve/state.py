"""What the two front ends (gRPC and HTTP) read: the server's state and the engine interface they drive.

Both read one ServerState, so health, admission and shutdown agree; both drive the engine through EngineClient,
which the Engine (appliance/engine/engine.py), the server tests' stand-in and an out-of-process client all provide.
Everything a front end reads is declared here, so that a front end never probes for an attribute.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from appliance.core.config import RuntimeConfig
from appliance.core.request import RequestLimits, RequestOutput, SamplingParams
from appliance.core.startup_report import StartupReport

if TYPE_CHECKING:
    from appliance.core.tokenizer import Tokenizer
    from appliance.engine.stats import EngineStats
    from appliance.serve.api import appliance_pb2 as pb


class ServerState(StrEnum):
    """starting -> serving -> draining -> stopped; failed when the engine stops while serving (a rank died)."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


class PromptSequence(Protocol):
    """The engine's sequence of a request, as far as a front end reads it: its prompt's tokens."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...


class RequestHandle(Protocol):
    """A submitted request, as a front end holds it: it can abort it, and its sequence (None until the engine
    made one) tells the prompt's length before the engine's usage does."""

    @property
    def seq(self) -> PromptSequence | None: ...

    def abort(self) -> None: ...


class OpenStream(Protocol):
    """A request stream a front end has open (appliance.serve.streams.RequestStream), as the server's shutdown
    sees it: it can end it, ABORTED with `error` (why the engine stopped, if it did)."""

    def end_aborted(self, error: str | None = None) -> None: ...


class EngineClient(Protocol):
    """The engine as the front ends use it: lifecycle (prepare, start, drain, shutdown), requests and live figures.

    Thread model: every method but stats() may block and runs off the event loop; on_output is called on the
    engine's thread, and so is on_failure."""

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


class FrontEndState(Protocol):
    """What both front ends read from the server they run in (appliance.serve.server.ApplianceServer)."""

    rc: RuntimeConfig
    engine: EngineClient
    executor: Executor                    # runs engine.submit, tokenizing and rendering off the event loop
    state: ServerState
    failure: str | None                   # why the engine stopped while serving, once the server knows it
    open_streams: set[OpenStream]         # streams of both front ends not yet finished (a shutdown ends them)


class StartupState(FrontEndState, Protocol):
    """What gRPC's Startup reads besides: the engine start's outcome, once `ready` is set."""

    ready: asyncio.Event
    start_error: BaseException | None
    startup_message: pb.StartupResponse | None
