"""EngineProcessClient: the engine core in a process of its own, as the front ends' EngineClient.

It satisfies appliance.serve.state.EngineClient structurally (the engine layer does not import the serve layer):
prepare, start, submit -> a handle with abort(), drain, shutdown, stats, and report / limits / failure / on_failure /
tokenizer, with the same meanings and the same exceptions as the in-process Engine. What runs where:

    front-end process (this object)          core process (core_process.py)
    the tokenizer: validate_request and      the Engine: preflight (files, backend, runner), start (weights,
    tokenizing, before anything is sent;     profile, plan, allocate), scheduler, KV manager, device steps,
    request_ids; the output processor:       sampling, the core's stop rules (EOS, stop token ids, lengths,
    detokenizing, stop strings, hold-back    grammars), its ranks; it sends CoreOutputs, not text
    (requests.py)
    the latest stats snapshot (stats() is    pushes each new snapshot, and every CoreOutput, on one ordered stream
    read on the event loop: it never waits)

Threads here: the callers (executor threads: submit blocks until the core admitted or refused the request, so
RequestError, QueueFullError and EngineUnavailableError are raised here as before), and one receive thread
(child.py) that runs the output processor over the core's CoreOutputs and calls each request's on_output (the
in-process engine calls it on its loop thread; the front ends only hand it to their event loop), tells the core of
each stop string found (Stop), resolves the replies, keeps the stats, and watches the core: a core that dies
while serving becomes `failure` and on_failure (health NOT_SERVING, the server exits 1), and every request in flight
ends ABORTED with that error; so does a core that sends nothing, not even its idle beat, for
parallel.step_timeout_s (stopped or stuck: it is killed). Startup faults in the core come back as their StartupError
text, raised here: the CLI prints the same message and exits 2, as with the engine in one process.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

from appliance.core.config import RuntimeConfig
from appliance.core.request import (
    EngineUnavailableError,
    RequestLimits,
    RequestOutput,
    SamplingParams,
    validate_request,
)
from appliance.core.startup_report import StartupReport
from appliance.core.tokenizer import Tokenizer, load_tokenizer_for
from appliance.engine.process import messages as m
from appliance.engine.process.child import CoreChild, exit_reason, state_words
from appliance.engine.process.core_process import pin_threads
from appliance.engine.process.faults import fault_error
from appliance.engine.process.requests import CoreRequest, RequestTable
from appliance.engine.stats import EngineStats

log = logging.getLogger("appliance.engine.process.client")

DRAIN_TAIL_S = 10.0       # beyond the grace: how long a drain may wait for the core's reply
SHUTDOWN_WAIT_S = 30.0    # how long the core may take to shut its engine down and exit before it is killed
ABANDON_WAIT_S = 5.0      # after a startup fault: how long the core may take to exit before it is killed


class EngineProcessClient:
    """The engine core in a child process; see the module docstring. `pin_cpus`: on a host CPU, this process moves
    to the CPUs the core's threads leave free (a server does; a test running servers in its own process does not)."""

    def __init__(self, rc: RuntimeConfig, pin_cpus: bool = True):
        self.rc = rc
        self.report: StartupReport | None = None
        self.limits: RequestLimits | None = None
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self.prepared: m.Prepared | None = None
        self.pin_cpus = pin_cpus
        self._tokenizer: Tokenizer | None = None
        self._child = CoreChild(rc, self._event, self._core_gone, self._hung)
        self._table: RequestTable | None = None       # with the tokenizer (prepare)
        self._stats = EngineStats()
        self._draining = False
        self._stopping = False                  # shutdown or a startup fault: the core's exit is expected
        self._failure_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The core process's pid (None before prepare)."""
        return self._child.pid

    @property
    def returncode(self) -> int | None:
        """The core process's exit status (None while it runs, or before prepare)."""
        return self._child.proc.returncode if self._child.proc is not None else None

    @property
    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer, loaded here: the front end tokenizes and detokenizes."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer_for(self.rc.model)
        return self._tokenizer

    def prepare(self) -> "EngineProcessClient":
        """Start the core process and run the preflight there (checkpoint files, backend, runner, tokenizer), once;
        a fault is the core's StartupError, raised here. On a host CPU the core pinned its threads, and this
        process moves to the CPUs it left (pin_cpus)."""
        if self.prepared is not None:
            return self
        if self._table is None:
            self._table = RequestTable(self.tokenizer)
        if self._child.proc is None:
            self._child.launch()
        reply = self._child.call(lambda call: m.Prepare(call))
        if reply.error is not None:
            self._abandon()
            raise fault_error(reply.error)
        self.prepared = reply.prepared
        if self.pin_cpus and self.prepared is not None and self.prepared.front_cpus:
            pin_threads(set(self.prepared.front_cpus))
        return self

    def start(self) -> StartupReport:
        """The core's Engine.start (weights, profile, plan, allocate, loop): its report, or its fault raised here."""
        self.prepare()
        self.limits = RequestLimits(self.rc.model.layout.vocab_size, self.rc.max_model_len,
                                    self.tokenizer.max_token_bytes)
        reply = self._child.call(lambda call: m.Start(call))
        if reply.error is not None:
            self._abandon()
            raise fault_error(reply.error)
        if reply.report is None:
            raise RuntimeError("the engine core answered Start without a report")
        self.report = reply.report
        self._child.watching = not self._stopping
        return reply.report

    def drain(self, grace_s: float) -> None:
        """Stop admitting; the core lets in-flight requests finish for up to grace_s, aborts the rest and streams
        their last outputs, which have all been delivered when this returns."""
        self._draining = True
        if self.failure is not None or not self._child.alive():
            return
        try:
            self._child.call(lambda call: m.Drain(call, grace_s), timeout=grace_s + DRAIN_TAIL_S)
        except (FutureTimeout, EngineUnavailableError) as exc:
            log.warning("the engine core did not finish draining: %s", exc or "timed out")

    def shutdown(self) -> None:
        """Shut the core's engine down, wait for the process to exit (kill it past SHUTDOWN_WAIT_S), close."""
        self._end(SHUTDOWN_WAIT_S)

    def _abandon(self) -> None:
        """After a startup fault: the core is of no further use; end it (its ranks end with it) and close."""
        self._end(ABANDON_WAIT_S)

    def _end(self, wait_s: float) -> None:
        self._draining = self._stopping = True
        self._child.watching = False
        if self._child.alive():
            try:
                self._child.call(lambda call: m.Shutdown(call), timeout=wait_s)
            except (FutureTimeout, EngineUnavailableError) as exc:
                log.warning("the engine core did not shut down in time (%s); killing it", exc or "timed out")
        self._child.reap(wait_s)
        self._child.close()

    # -- requests ------------------------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None] | None = None) -> CoreRequest:
        """Validate and tokenize here, then have the core admit it; raises what Engine.submit raises."""
        self._check_open()
        if self.limits is None or self._table is None:
            raise EngineUnavailableError("the engine is starting")
        table = self._table
        prompt_ids = validate_request(request_id, prompt, params, self.limits, self.tokenizer.encode)
        with table.lock:
            self._check_open()                  # under the lock that a dying core's requests are failed under
            call = next(self._child.ids)
            request = CoreRequest(self.abort_request, call, request_id, prompt_ids, params, on_output)
            table.add(request)
            future = self._child.expect(call)
            try:
                self._child.send(m.Submit(call, prompt_ids, params))
            except BaseException:
                self._child.forget(call)
                table.discard(request)
                raise
        reply = future.result()
        if reply.error is not None:
            table.discard(request)
            raise fault_error(reply.error)
        return request

    def abort_request(self, request: CoreRequest) -> None:
        """Its request_id is free at once; the core ends it and its last output (ABORTED) comes back."""
        if self._table is not None and self._table.mark_aborted(request):
            try:
                self._child.send(m.Abort(request.call))
            except EngineUnavailableError:
                pass                            # closed: the core is gone, and so are its requests

    def _check_open(self) -> None:
        if self.failure is not None:
            raise EngineUnavailableError(f"the engine has stopped: {self.failure}")
        if self.report is None or self._draining:
            raise EngineUnavailableError("the engine is starting" if self.report is None else "the engine is draining")

    # -- introspection ---------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The core's latest snapshot (it sends each new one): never waits."""
        return self._stats

    def num_in_flight(self) -> int:
        return self._table.num_in_flight() if self._table is not None else 0

    # -- the receive thread --------------------------------------------------------------------------------------
    def _event(self, event: m.Event) -> None:
        if isinstance(event, m.Outputs):
            assert self._table is not None
            processed, stopped = self._table.process(event.items)
            for call, kept in stopped.items():  # the core frees them (and counts them STOP, and `kept` tokens)
                try:
                    self._child.send(m.Stop(call, kept))
                except EngineUnavailableError:
                    pass
            processed.deliver()
        elif isinstance(event, m.Stats):
            self._stats = event.stats
        elif isinstance(event, m.Failed):
            self._fail(event.message)

    def _fail(self, message: str) -> bool:
        """The engine stopped for good: record it and tell on_failure once (before any request hears of it)."""
        with self._failure_lock:
            if self.failure is not None:
                return False
            self.failure = message
        log.error("the engine stops: %s", message)
        if self.on_failure is not None:
            self.on_failure(message)
        return True

    def _hung(self, silent_s: float) -> None:
        """Serving, and nothing came from the core for parallel.step_timeout_s (it beats while idle): stopped
        (SIGSTOP, a debugger) or stuck where even its sender cannot run. The engine has failed; the core is killed
        (a stopped process too), and its exit then ends every request with this reason."""
        pid = self._child.pid or 0
        state = state_words(pid)
        self._fail(f"the engine core process (pid {pid}) sent nothing for {silent_s:.1f} s "
                   f"(parallel.step_timeout_s={self.rc.parallel.step_timeout_s:g}){state}: it is hung; killed")
        self._child.kill()

    def _core_gone(self, status: int) -> None:
        """The core process exited. Expected after Shutdown or a startup fault; while starting, the pending call
        (Prepare, Start) fails as a startup fault; while serving, the engine has failed: every request ends."""
        message = f"the engine core process (pid {self._child.pid or 0}) {exit_reason(status)}"
        if self._stopping:
            fault = m.Fault("unavailable", message)
        elif self.report is None:
            fault = m.Fault("startup", f"{message} while starting (its output above says why)")
        else:
            fault = m.Fault("unavailable", f"the engine has stopped: {message}")
            self._fail(message)
        if self._table is None:
            self._child.fail_calls(fault)
            return
        with self._table.lock:                  # a submit past its checks has registered its call by now
            self._child.fail_calls(fault)
        if self._stopping and self.report is None:
            return
        # (after a shutdown: none but those it aborted, as Engine.shutdown)
        self._table.fail_all(self.failure).deliver()
