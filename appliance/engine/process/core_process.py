"""The engine core process: the in-process Engine, driven over ZMQ by the front-end process (client.py).

`python -m appliance.engine.process.core_process COMMANDS EVENTS PARENT_PID`, the pickled RuntimeConfig on stdin
(as npu.worker's ranks get theirs). Threads:

    main      receives commands and acts on them: Submit, Abort and Stop at once (Engine.submit, abort and stop are
              thread-safe and quick), a Submit with an output constraint on a small pool (its grammar compiles there, as the
              in-process engine compiles it on the caller's thread), Prepare / Start / Drain / Shutdown each on a
              thread of its own (they block), so aborts still get through meanwhile
    sender    the only user of the events socket: every CoreOutput the engine loop emits (this object is the core's
              output sink: on the loop thread it only appends to the outbox), every Reply and the stats snapshot
              when it changed go out in the order they happened; the CoreOutputs of one wake-up (one engine step,
              or several) go as one Outputs message;
              a Beat when nothing else went out for npu.liveness.beat_interval(parallel.step_timeout_s)
    engine    the Engine's own loop thread (and its ranks, when it spawns them: this process is their owner)

The Engine admits each request under its Submit's call id (str): the front end owns request_ids, runs the output
processor (text, stop strings, hold-back) and sends Stop when a stop string ended a request.

It ignores SIGINT and SIGTERM (a terminal or a service manager signals the whole process group: the front end drains
through Drain, then sends Shutdown) and ends with its parent (npu.liveness.exit_with_parent: the kernel kills it
when the front end is gone, however it went). A startup fault goes back as the StartupError's text, which the front
end raises as its own: the user sees the same message and exit status 2 as with the engine in one process.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import pickle
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

import zmq

from appliance.core.config import RuntimeConfig
from appliance.core.errors import StartupError
from appliance.core.logs import configure_logging
from appliance.core.parallel import world_size
from appliance.core.request import EngineUnavailableError, SamplingParams
from appliance.core.tokenizer import Tokenizer
from appliance.engine.output import CoreOutput, OnOutput
from appliance.engine.process import messages as m
from appliance.engine.process.faults import fault
from appliance.engine.stats import EngineStats

log = logging.getLogger("appliance.engine.process.core")

STATS_EVERY_S = 0.05      # an idle sender wakes this often to send the stats snapshot if it changed
CONSTRAINT_WORKERS = 4    # Submits whose grammars compile off the command thread
SEND_LINGER_MS = 2000     # at exit: how long the last events (Shutdown's Reply) may take to leave
STATS_NOW = m.Stats(EngineStats())   # in the outbox: the sender sends a fresh snapshot there



def pin_threads(cpus: set[int]) -> None:
    """Every thread of this process (and those it starts later: they inherit it) runs on `cpus` only (Linux)."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except OSError:                      # a thread that ended meanwhile
            pass


def split_cpus(threads: int, cpus: list[int]) -> tuple[list[int], list[int]]:
    """(front, core): the engine's `threads` intra-op threads keep the last CPUs of the affinity to themselves, the
    front ends get the rest; ([], cpus) when there is nothing to leave (the engine takes every CPU)."""
    if threads < 1 or len(cpus) <= threads:
        return [], cpus
    return cpus[:-threads], cpus[-threads:]


@dataclass
class Forward:
    """The core sink's Delivery: the CoreOutputs go to the sender's outbox (no stop strings are looked for here)."""

    items: list[CoreOutput]
    process: "CoreProcess"
    stopped: dict[str, int] = field(default_factory=dict)

    def deliver(self) -> None:
        self.process.put_outputs(self.items)


class CoreProcess:
    """The Engine behind the sockets, and its output sink (add_request, process_outputs: engine.output.OutputSink)."""

    def __init__(self, rc: RuntimeConfig, commands: str, events: str):
        self.rc = rc
        from appliance.engine.engine import Engine  # here: the front process imports this module, not torch
        self.engine = Engine(rc, output_sink=self.sink)
        self.engine.on_failure = self._engine_failed
        self._ctx = zmq.Context(1)
        self._commands = self._ctx.socket(zmq.PULL)
        self._commands.connect(commands)
        self._events = self._ctx.socket(zmq.PUSH)
        self._events.setsockopt(zmq.SNDHWM, 0)
        self._events.connect(events)
        self._encoder = m.encoder()
        self._outbox: collections.deque[CoreOutput | m.Reply | m.Failed | m.Stats] = collections.deque()
        self._wake = threading.Event()
        self._done = threading.Event()        # Shutdown replied: the sender sends what is left and ends
        self._lock = threading.Lock()
        self._pending: set[int] = set()       # Submits compiling on the pool
        self._aborted: set[int] = set()       # of those, aborted before they were admitted
        self._pool = ThreadPoolExecutor(CONSTRAINT_WORKERS, thread_name_prefix="core-submit")
        self._last_sent = 0.0                 # when the sender last sent anything (it beats when idle)

    # -- the command thread ------------------------------------------------------------------------------------
    def run(self) -> None:
        sender = threading.Thread(target=self._send_loop, name="core-sender", daemon=True)
        sender.start()
        decoder = m.command_decoder()
        while not self._done.is_set():
            if not self._commands.poll(100):
                continue
            cmd = decoder.decode(self._commands.recv())
            if isinstance(cmd, m.Submit):
                if cmd.params.constraint is None:
                    self._submit(cmd)
                else:
                    with self._lock:
                        self._pending.add(cmd.call)
                    self._pool.submit(self._submit, cmd)
            elif isinstance(cmd, m.Abort):
                self._abort(cmd.call)
            elif isinstance(cmd, m.Stop):
                self.engine.stop(str(cmd.call), cmd.kept)
            elif isinstance(cmd, m.Prepare):
                self._in_thread("prepare", cmd.call, functools.partial(self._prepare, cmd))
            elif isinstance(cmd, m.Start):
                self._in_thread("start", cmd.call, functools.partial(self._start, cmd))
            elif isinstance(cmd, m.Drain):
                self._in_thread("drain", cmd.call, functools.partial(self._drain, cmd))
            elif isinstance(cmd, m.Shutdown):
                self._in_thread("shutdown", cmd.call, functools.partial(self._shutdown, cmd), last=True)
        sender.join(SEND_LINGER_MS / 1000)
        self._events.close(linger=SEND_LINGER_MS)
        self._commands.close(linger=0)

    def _in_thread(self, name: str, call: int, work: Callable[[], m.Reply], last: bool = False) -> None:
        def run() -> None:
            try:
                reply = work()
            except BaseException as exc:  # noqa: BLE001 - handed to the front end, which re-raises it
                if not isinstance(exc, (StartupError, EngineUnavailableError)):
                    log.exception("%s failed", name)
                reply = m.Reply(call, error=fault(exc))
            self._put(reply)
            if last:
                self._done.set()
                self._wake.set()
        threading.Thread(target=run, name=f"core-{name}", daemon=True).start()

    def _start(self, cmd: m.Start) -> m.Reply:
        return m.Reply(cmd.call, report=self.engine.start())

    def _drain(self, cmd: m.Drain) -> m.Reply:
        self.engine.drain(cmd.grace_s)
        return m.Reply(cmd.call)

    def _shutdown(self, cmd: m.Shutdown) -> m.Reply:
        self.engine.shutdown()
        self._pool.shutdown(wait=False)
        return m.Reply(cmd.call)

    def _prepare(self, cmd: m.Prepare) -> m.Reply:
        """The preflight; then, on the host CPU, the engine's threads keep their cores and the rest go to the front
        end (each process pins itself: cpu_threads.py left those cores to the front ends in the first place)."""
        checked = self.engine.prepare()
        if checked.backend.kind != "cpu" or world_size(self.rc.parallel) > 1 or not hasattr(os, "sched_getaffinity"):
            return m.Reply(cmd.call, prepared=m.Prepared([], [], 0))
        import torch  # loaded by the preflight already
        threads = torch.get_num_threads()
        front, core = split_cpus(threads, sorted(os.sched_getaffinity(0)))
        if front:
            pin_threads(set(core))
            log.info("the engine core's %d thread%s run on CPUs %s; the front ends on %s", threads,
                     "" if threads == 1 else "s", core, front)
        return m.Reply(cmd.call, prepared=m.Prepared(front, core, threads))

    def _submit(self, cmd: m.Submit) -> None:
        """Admit the request under its call id (its outputs go through process_outputs, not a handle)."""
        try:
            handle = self.engine.submit(str(cmd.call), cmd.prompt_token_ids, cmd.params)
        except BaseException as exc:  # noqa: BLE001 - the front end re-raises it (QueueFullError...)
            with self._lock:
                self._pending.discard(cmd.call)
                self._aborted.discard(cmd.call)
            self._put(m.Reply(cmd.call, error=fault(exc)))
            return
        with self._lock:
            self._pending.discard(cmd.call)
            abort = cmd.call in self._aborted
            self._aborted.discard(cmd.call)
        self._put(m.Reply(cmd.call))
        if abort:
            handle.abort()

    def _abort(self, call: int) -> None:
        with self._lock:
            if call in self._pending:         # still compiling its grammar: aborted once admitted
                self._aborted.add(call)
                return
        self.engine.abort(str(call))

    # -- the output sink (the engine loop's thread) --------------------------------------------------------------
    def sink(self, tokenizer: Tokenizer) -> "CoreProcess":
        """The Engine's output_sink: this object (the front end detokenizes: the tokenizer is not needed here)."""
        return self

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    on_output: OnOutput) -> None:
        """Nothing to track: the front end's output processor holds each request's state."""

    def process_outputs(self, core_outputs: Iterable[CoreOutput]) -> Forward:
        return Forward(list(core_outputs), self)

    def put_outputs(self, items: list[CoreOutput]) -> None:
        """Queued for the sender (nothing slow on the loop thread). Outputs that finish a request go after a stats
        snapshot the sender takes when it gets to them (the loop counted and published them before delivering): the
        front end holds it before its client hears the end, so /metrics and Stats read right after are current."""
        if any(item.finish_reason is not None for item in items):
            self._outbox.append(STATS_NOW)
        self._outbox.extend(items)
        self._wake.set()

    def _engine_failed(self, message: str) -> None:
        self._put(m.Failed(message))

    def _put(self, event: m.Reply | m.Failed) -> None:
        self._outbox.append(event)
        self._wake.set()

    # -- the sender thread -----------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        from npu.liveness import beat_interval
        beat_s = beat_interval(self.rc.parallel.step_timeout_s)
        last_stats: EngineStats | None = None
        next_stats = 0.0
        self._last_sent = time.monotonic()
        while True:
            self._wake.wait(STATS_EVERY_S)
            self._wake.clear()
            batch: list[CoreOutput] = []
            while self._outbox:
                item = self._outbox.popleft()
                if isinstance(item, CoreOutput):
                    batch.append(item)
                    continue
                if batch:
                    self._send(m.Outputs(batch))
                    batch = []
                if item is STATS_NOW:         # taken here: the snapshots go out in the order they were taken
                    last_stats = self.engine.stats()
                    item = m.Stats(last_stats)
                self._send(item)
            if batch:
                self._send(m.Outputs(batch))
            now = time.monotonic()
            if now >= next_stats:             # at most every 10 ms while busy; after the deltas it reflects
                stats = self.engine.stats()
                if stats != last_stats:
                    self._send(m.Stats(stats))
                    last_stats = stats
                next_stats = now + 0.01
            if now - self._last_sent >= beat_s:
                self._send(m.Beat())
            if self._done.is_set() and not self._outbox:
                return

    def _send(self, event: m.Event) -> None:
        self._events.send(self._encoder.encode(event), copy=False)
        self._last_sent = time.monotonic()


def main(argv: list[str]) -> int:
    commands, events, parent = argv[0], argv[1], int(argv[2])
    rc: RuntimeConfig = pickle.load(sys.stdin.buffer)
    for sig in (signal.SIGINT, signal.SIGTERM):   # meant for the front end, which drains and then says Shutdown
        signal.signal(sig, signal.SIG_IGN)
    from npu.liveness import exit_with_parent
    exit_with_parent(parent)
    logging.basicConfig(level=rc.logging.level, stream=sys.stdout,
                        format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    configure_logging(rc.logging.format, rc.logging.level)
    CoreProcess(rc, commands, events).run()
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    from npu.leaving import leave_process
    leave_process(status)
