"""EngineProcessClient: the engine core in a process of its own, as the front ends' EngineClient.

It satisfies appliance.serve.state.EngineClient structurally (the engine layer does not import the serve layer):
prepare, start, submit -> a handle with abort(), drain, shutdown, stats, and report / limits / failure / on_failure /
tokenizer, with the same meanings and the same exceptions as the in-process Engine. What runs where:

    front-end process (this object)          core process (core_process.py)
    the tokenizer: validate_request and      the Engine: preflight (files, backend, runner), start (weights,
    tokenizing, before anything is sent      profile, plan, allocate), scheduler, KV manager, device steps,
                                             sampling, detokenizing and stop strings, its ranks
    the latest stats snapshot (stats() is    pushes each new snapshot, and every delta, on one ordered stream
    read on the event loop: it never waits)

Threads here: the callers (executor threads: submit blocks until the core admitted or refused the request, so
RequestError, QueueFullError and EngineUnavailableError are raised here as before), and one receive thread that
calls each request's on_output with its deltas (the in-process engine calls it on its loop thread; the front ends
only hand it to their event loop), resolves the replies, keeps the stats, and watches the core: a core that dies
while serving becomes `failure` and on_failure (health NOT_SERVING, the server exits 1), and every request in flight
ends ABORTED with that error; so does a core that sends nothing, not even its idle beat, for
parallel.step_timeout_s (stopped or stuck: it is killed). Startup faults in the core come back as their StartupError text, raised here: the CLI
prints the same message and exits 2, as with the engine in one process.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Callable, Iterator

import zmq

from appliance.core.config import RuntimeConfig
from appliance.core.errors import CheckpointError, ConfigError, StartupError, TokenizerError
from appliance.core.planner import InsufficientMemoryError
from appliance.core.request import (
    EngineUnavailableError,
    FinishReason,
    QueueFullError,
    RequestError,
    RequestLimits,
    RequestOutput,
    SamplingParams,
    Usage,
    validate_request,
)
from appliance.core.startup_report import StartupReport
from appliance.core.tokenizer import Tokenizer, load_tokenizer_for
from appliance.engine.process import messages as m
from appliance.engine.process.core_process import pin_threads
from appliance.engine.stats import EngineStats
from npu.liveness import STATE_WORDS, state_letter  # (stdlib only: no torch here)

log = logging.getLogger("appliance.engine.process.client")

CORE_MODULE = "appliance.engine.process.core_process"
POLL_MS = 50              # the receive thread looks at the core's process this often while no event arrives
DRAIN_TAIL_S = 10.0       # beyond the grace: how long a drain may wait for the core's reply
SHUTDOWN_WAIT_S = 30.0    # how long the core may take to shut its engine down and exit before it is killed
ABANDON_WAIT_S = 5.0      # after a startup fault: how long the core may take to exit before it is killed
# StartupError subclasses a core's fault keeps (a sweep tells "does not fit" from other startup faults by class).
STARTUP_ERRORS: dict[str, type[StartupError]] = {
    "InsufficientMemoryError": InsufficientMemoryError, "CheckpointError": CheckpointError,
    "TokenizerError": TokenizerError}

_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Popen (stdin a pipe) from one thread that lives as long as this process: the core asks the kernel to kill it
    when that thread ends (npu.liveness.exit_with_parent), so no exit of the front end leaves the core behind.
    (npu.device_group.spawn does the same for ranks; that module loads torch, which this process never needs.)"""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="core-spawner")
    return _spawner.submit(subprocess.Popen, argv, stdin=subprocess.PIPE, env=env).result()


def exit_reason(status: int) -> str:
    """A Popen returncode in words: 'killed by SIGKILL', 'exited with status 1'."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exited with status {status}"


def state_words(pid: int) -> str:
    """' (its process is stopped: SIGSTOP or a debugger)' and the like for a local process; '' when nothing to say."""
    words = STATE_WORDS.get(state_letter(pid), "")
    return f" ({words})" if words else ""


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


class CoreRequest:
    """A request submitted to the core, as the front end holds it: abort() it, or iterate its deltas when it was
    submitted without on_output (as Engine's RequestHandle)."""

    def __init__(self, client: "EngineProcessClient", call: int, request_id: str, prompt_token_ids: list[int],
                 on_output: Callable[[RequestOutput], None] | None):
        self.client = client
        self.call = call
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.completion_tokens = 0
        self.aborted = False
        self.outputs: queue.Queue[RequestOutput] = queue.Queue()
        self.on_output = on_output or self.outputs.put

    @property
    def seq(self) -> "CoreRequest":
        """What the front ends read a prompt's length from (handle.seq.prompt_token_ids, as on Engine's handle)."""
        return self

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self.outputs.get()
            yield out
            if out.finished:
                return

    def abort(self) -> None:
        """Abort this request (never a later one that reuses its id); its last delta (ABORTED) still comes."""
        self.client.abort_request(self)

    def deliver(self, out: RequestOutput) -> None:
        self.completion_tokens += len(out.new_token_ids)
        try:
            self.on_output(out)
        except Exception:  # noqa: BLE001 - one front end's callback must not stop every other request's deltas
            log.exception("on_output of request %s failed", self.request_id)


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
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None
        self._ctx: zmq.Context | None = None
        self._commands: zmq.Socket | None = None
        self._events: zmq.Socket | None = None
        self._receiver: threading.Thread | None = None
        self._encoder = m.encoder()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()           # _requests, _calls, failure
        self._send_lock = threading.Lock()      # the commands socket (always taken last)
        self._requests: dict[int, CoreRequest] = {}
        self._calls: dict[int, Future[m.Reply]] = {}
        self._stats = EngineStats()
        self._draining = False
        self._stopping = False                  # shutdown or a startup fault: the core's exit is expected
        self._closing = threading.Event()

    # -- lifecycle -------------------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The core process's pid (None before prepare)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer, loaded here too: the front end tokenizes (and the core detokenizes)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer_for(self.rc.model)
        return self._tokenizer

    def prepare(self) -> "EngineProcessClient":
        """Start the core process and run the preflight there (checkpoint files, backend, runner, tokenizer), once;
        a fault is the core's StartupError, raised here. On a host CPU the core pinned its threads, and this
        process moves to the CPUs it left (pin_cpus)."""
        if self.prepared is not None:
            return self
        if self._proc is None:
            self._launch()
        _ = self.tokenizer
        reply = self._call(lambda call: m.Prepare(call))
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
        reply = self._call(lambda call: m.Start(call))
        if reply.error is not None:
            self._abandon()
            raise fault_error(reply.error)
        if reply.report is None:
            raise RuntimeError("the engine core answered Start without a report")
        self.report = reply.report
        return reply.report

    def drain(self, grace_s: float) -> None:
        """Stop admitting; the core lets in-flight requests finish for up to grace_s, aborts the rest and streams
        their last deltas, which have all been delivered when this returns."""
        self._draining = True
        if self.failure is not None or not self._alive():
            return
        try:
            self._call(lambda call: m.Drain(call, grace_s), timeout=grace_s + DRAIN_TAIL_S)
        except (FutureTimeout, EngineUnavailableError) as exc:
            log.warning("the engine core did not finish draining: %s", exc or "timed out")

    def shutdown(self) -> None:
        """Shut the core's engine down, wait for the process to exit (kill it past SHUTDOWN_WAIT_S), close."""
        self._draining = self._stopping = True
        if self._alive():
            try:
                self._call(lambda call: m.Shutdown(call), timeout=SHUTDOWN_WAIT_S)
            except (FutureTimeout, EngineUnavailableError) as exc:
                log.warning("the engine core did not shut down in time (%s); killing it", exc or "timed out")
        self._reap(SHUTDOWN_WAIT_S)
        self._close()

    def _abandon(self) -> None:
        """After a startup fault: the core is of no further use; end it (its ranks end with it) and close."""
        self._stopping = True
        if self._alive():
            try:
                self._call(lambda call: m.Shutdown(call), timeout=ABANDON_WAIT_S)
            except (FutureTimeout, EngineUnavailableError):
                pass
        self._reap(ABANDON_WAIT_S)
        self._close()

    # -- requests ------------------------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None] | None = None) -> CoreRequest:
        """Validate and tokenize here, then have the core admit it; raises what Engine.submit raises."""
        self._check_open()
        if self.limits is None:
            raise EngineUnavailableError("the engine is starting")
        prompt_ids = validate_request(request_id, prompt, params, self.limits, self.tokenizer.encode)
        future: Future[m.Reply] = Future()
        with self._lock:
            self._check_open()                  # under the lock that a dying core's requests are failed under
            call = next(self._ids)
            request = CoreRequest(self, call, request_id, prompt_ids, on_output)
            self._requests[call] = request
            self._calls[call] = future
            try:
                self._send(m.Submit(call, request_id, prompt_ids, params))
            except BaseException:
                del self._requests[call], self._calls[call]
                raise
        reply = future.result()
        if reply.error is not None:
            with self._lock:
                self._requests.pop(call, None)
            raise fault_error(reply.error)
        return request

    def abort_request(self, request: CoreRequest) -> None:
        with self._lock:
            if request.aborted or self._requests.get(request.call) is not request:
                return                          # finished, or aborted already
            request.aborted = True
            self._send(m.Abort(request.call))

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
        with self._lock:
            return sum(1 for r in self._requests.values() if not r.aborted)

    # -- the process and its sockets -------------------------------------------------------------------------------
    def _launch(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="appliance-core-")
        commands, events = f"ipc://{self._dir}/commands", f"ipc://{self._dir}/events"
        self._ctx = zmq.Context(1)
        self._commands = self._ctx.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.bind(commands)
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.RCVHWM, 0)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.bind(events)
        env = dict(os.environ)
        source = str(Path(__file__).resolve().parents[3])        # the code this process runs, for the core too
        env["PYTHONPATH"] = os.pathsep.join([source] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self._proc = spawn([sys.executable, "-m", CORE_MODULE, commands, events, str(os.getpid())], env)
        assert self._proc.stdin is not None
        self._proc.stdin.write(pickle.dumps(self.rc))
        self._proc.stdin.close()
        log.info("engine core process started: pid %d", self._proc.pid)
        self._receiver = threading.Thread(target=self._receive, name="core-receiver", daemon=True)
        self._receiver.start()

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and not self._closing.is_set()

    def _send(self, command: m.Command) -> None:
        payload = self._encoder.encode(command)
        with self._send_lock:
            if self._commands is None or self._closing.is_set():
                raise EngineUnavailableError("the engine core is closed")
            self._commands.send(payload, copy=False)

    def _call(self, command: Callable[[int], m.Command], timeout: float | None = None) -> m.Reply:
        """Send a command and wait for its Reply (a core that dies meanwhile answers with a Fault)."""
        future: Future[m.Reply] = Future()
        with self._lock:
            call = next(self._ids)
            self._calls[call] = future
        if not self._alive():
            with self._lock:
                self._calls.pop(call, None)
            raise EngineUnavailableError("the engine core process is not running")
        self._send(command(call))
        try:
            return future.result(timeout)
        finally:
            with self._lock:
                self._calls.pop(call, None)

    def _reap(self, wait_s: float) -> None:
        if self._proc is None:
            return
        try:
            self._proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            log.warning("the engine core process %d did not exit; killing it", self._proc.pid)
            self._proc.kill()
            self._proc.wait()

    def _close(self) -> None:
        self._closing.set()
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(5)
        with self._send_lock:
            for sock in (self._commands, self._events):
                if sock is not None:
                    sock.close(linger=0)
            self._commands = self._events = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -- the receive thread --------------------------------------------------------------------------------------
    def _receive(self) -> None:
        decoder = m.event_decoder()
        events, proc = self._events, self._proc
        assert events is not None and proc is not None
        last_event = time.monotonic()
        while not self._closing.is_set():
            if events.poll(POLL_MS):
                self._dispatch(decoder.decode(events.recv(copy=False).buffer))
                last_event = time.monotonic()
                continue
            silent = time.monotonic() - last_event
            if silent > self.rc.parallel.step_timeout_s and self.report is not None and not self._stopping:
                self._hung(silent)
            status = proc.poll()
            if status is not None:
                while events.poll(0):               # what it sent before it went
                    self._dispatch(decoder.decode(events.recv(copy=False).buffer))
                self._core_gone(status)
                return

    def _dispatch(self, event: m.Event) -> None:
        if isinstance(event, m.Outputs):
            for call, out in event.items:
                request = self._requests.get(call)
                if request is None:
                    continue
                if out.finished:
                    with self._lock:
                        self._requests.pop(call, None)
                request.deliver(out)
        elif isinstance(event, m.Reply):
            with self._lock:
                future = self._calls.pop(event.call, None)
            if future is not None:
                future.set_result(event)
        elif isinstance(event, m.Stats):
            self._stats = event.stats
        elif isinstance(event, m.Failed):
            self._fail(event.message)
        # (a Beat only says the core is alive: the receive loop notes the time of every event)

    def _fail(self, message: str) -> bool:
        """The engine stopped for good: record it and tell on_failure once (before any request hears of it)."""
        with self._lock:
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
        pid = self._proc.pid if self._proc is not None else 0
        state = state_words(pid)
        self._fail(f"the engine core process (pid {pid}) sent nothing for {silent_s:.1f} s "
                   f"(parallel.step_timeout_s={self.rc.parallel.step_timeout_s:g}){state}: it is hung; killed")
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

    def _core_gone(self, status: int) -> None:
        """The core process exited. Expected after Shutdown or a startup fault; while starting, the pending call
        (Prepare, Start) fails as a startup fault; while serving, the engine has failed: every request ends."""
        pid = self._proc.pid if self._proc is not None else 0
        message = f"the engine core process (pid {pid}) {exit_reason(status)}"
        if self._stopping:
            fault = m.Fault("unavailable", message)
        elif self.report is None:
            fault = m.Fault("startup", f"{message} while starting (its output above says why)")
        else:
            fault = m.Fault("unavailable", f"the engine has stopped: {message}")
            self._fail(message)
        with self._lock:
            calls, self._calls = self._calls, {}
            requests, self._requests = self._requests, {}
        for call, future in calls.items():
            future.set_result(m.Reply(call, error=fault))
        if self._stopping and self.report is None:
            return
        for request in requests.values():      # (after a shutdown: none but those it aborted, as Engine.shutdown)
            request.deliver(RequestOutput(
                request.request_id, (), "", FinishReason.ABORTED,
                Usage(len(request.prompt_token_ids), request.completion_tokens, 0), error=self.failure))
