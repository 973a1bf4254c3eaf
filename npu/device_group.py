"""The owner's handle on every rank: starts them, and runs each step on all of them as one runner would.

    group, report = start_ranks(rc, backend, runner)      # every rank loaded, profiled, agreed, allocated
    logits = group.execute_partitions(batches)           # one StepBatch per data-parallel rank

The engine talks to this object as it talks to a ModelRunner (execute, device, shutdown), plus
execute_partitions for data parallel, so the scheduler never sees processes. On one host the owner spawns
ranks 1..world-1 itself (LocalRanks) and hosts their rendezvous store; under torchrun the ranks exist already
and meet through torchrun's environment (env://).

While serving, the owner watches every rank (`DeviceGroup.watch`): a spawned rank's exit (polled), and every
rank's heartbeat and the step in flight (npu/liveness.py: parallel.step_timeout_s). A lost rank, dead or hung,
ends them all: the engine is told first (its requests fail naming the rank), then the abort key is posted for
torchrun's ranks and the spawned ones are killed and reaped, which also frees the owner's step from the
collective it waits in.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from appliance.core.config import RuntimeConfig
from appliance.core.parallel import RankPlace, place_of, world_size
from appliance.core.startup_report import StartupReport
from npu.backends import Backend
from npu.launcher import launch
from npu.leaving import before_leaving
from npu.liveness import ABORT_KEY, LivenessMonitor, is_stopped
from npu.ranks import RankGroup, Rendezvous, StartupBoard, connect_store, host_store
from npu.runner import ModelRunner
from npu.step import StepBatch
from npu.worker import STOP, run_step

log = logging.getLogger("npu.device_group")

STOP_WAIT_S = 30.0       # how long stopped ranks may take to exit before they are terminated
WATCH_POLL_S = 0.1       # how often the spawned ranks are checked while serving (a dead one is reaped then)
DEATH_GRACE_S = 2.0      # after a failed step: how long a rank whose connection broke may take to be seen dead
STOP_POLL_S = 0.1        # while stopping: how often a rank that has not exited is looked at (stopped? killed at once)

_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Popen (stdin a pipe) from one thread that lives as long as this process. A spawned rank asks the kernel to
    kill it when the thread that started it ends (npu.liveness.exit_with_parent), so that no exit of the owner, even
    SIGKILL, leaves a rank behind; the engine's loop thread, which starts the ranks, ends before they stop."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rank-spawner")
    return _spawner.submit(subprocess.Popen, argv, stdin=subprocess.PIPE, env=env).result()


class RanksLostError(RuntimeError):
    """The ranks can no longer step together (a rank died, or a step collective failed): the device plane is
    gone for good. The message names the rank when a spawned one died and holds no transport internals, so
    front ends may show it to clients; the engine fails every request and stops (the service restarts it)."""


def exit_reason(status: int) -> str:
    """A Popen returncode in words: 'killed by SIGKILL', 'exited with status 1'."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exited with status {status}"


class LocalRanks:
    """Ranks 1..world-1 as processes of this host, each a fresh `python -m npu.worker` (its own torch, its own
    device: local index = rank) that reads the RuntimeConfig from its stdin. Not multiprocessing's spawn: that
    re-imports the caller's main module, which a script using the offline API may not guard."""

    def __init__(self, rc: RuntimeConfig, world: int, port: int):
        env = dict(os.environ)
        source = str(Path(__file__).resolve().parents[1])        # the code this process runs, for the ranks too
        env["PYTHONPATH"] = os.pathsep.join([source] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        config = pickle.dumps(rc)
        self.procs = []
        for rank in range(1, world):
            proc = spawn([sys.executable, "-m", "npu.worker", str(rank), str(world), str(port), str(os.getpid())], env)
            assert proc.stdin is not None, "spawn opens the rank's stdin as a pipe"
            proc.stdin.write(config)
            proc.stdin.close()
            self.procs.append(proc)
        before_leaving(self.kill)                # whatever way the owner leaves, it reaps its ranks first
        log.info("spawned ranks 1..%d: pids %s", world - 1, self.pids)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def exited(self) -> str:
        """Which spawned rank has already exited ('' when all run): while joining, that is a failure."""
        gone = [(rank, p.poll()) for rank, p in enumerate(self.procs, start=1) if p.poll() is not None]
        return "; ".join(f"rank {rank} exited with status {code} before joining (its output says why)"
                         for rank, code in gone)

    def died(self) -> str:
        """Which spawned rank has exited while serving ('' when all run), e.g. 'rank 1 (pid 42) died: killed by
        SIGKILL'. Polling reaps the exited process, so no zombie is left behind."""
        gone = [(rank, p.pid, code) for rank, p in enumerate(self.procs, start=1) if (code := p.poll()) is not None]
        return "; ".join(f"rank {rank} (pid {pid}) died: {exit_reason(code)}" for rank, pid, code in gone)

    def watch(self, on_death: Callable[[str], None], stopped: threading.Event) -> threading.Thread:
        """Call on_death(message) once, from a watcher thread (returned), as soon as a spawned rank dies (before
        `stopped` is set): a dead rank is noticed while the server is idle too, not only by the next step."""
        def run() -> None:
            while not stopped.wait(WATCH_POLL_S):
                message = self.died()
                if message:
                    if not stopped.is_set():
                        on_death(message)
                    return

        thread = threading.Thread(target=run, name="rank-watch", daemon=True)
        thread.start()
        return thread

    def kill(self) -> None:
        """End every spawned rank now and reap it: after a failure the live ones wait for a step that never comes
        (and ignore SIGTERM, which is meant for the owner)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Wait for the ranks to exit (after STOP), then terminate, then kill whatever is left. A stopped process
        (SIGSTOP: it can neither exit nor take SIGTERM) is killed at once."""
        deadline = time.monotonic() + wait_s
        for p in self.procs:
            while p.poll() is None and time.monotonic() < deadline:
                if is_stopped(p.pid):
                    log.warning("rank process %d is stopped; killing it", p.pid)
                    p.kill()
                    break
                try:
                    p.wait(min(STOP_POLL_S, max(0.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    pass
            if p.poll() is None and time.monotonic() >= deadline:
                log.warning("rank process %d did not exit; terminating it", p.pid)
                p.terminate()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class DeviceGroup:
    """Every rank, driven by the owner: one step on all of them per call.

    States: serving -> lost (a rank died or hung, or a step failed: `failure` says why, every later step raises
    RanksLostError) -> shut down; or serving -> shut down (`stopping` set first, so ranks exiting then are no
    failure)."""

    def __init__(self, runner: ModelRunner, group: RankGroup, ranks: LocalRanks | None, step_timeout_s: float):
        self.runner = runner
        self.group = group
        self.ranks = ranks
        self.failure: str | None = None      # once a step fails the ranks are out of lockstep: every later one fails
        self.stopping = threading.Event()    # set before a deliberate stop: ranks exiting then are no failure
        self.liveness = LivenessMonitor(group.board.store, group.world, step_timeout_s)
        self._on_lost: Callable[[str], None] | None = None
        self._lost = False
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def place(self) -> RankPlace:
        return self.group.place

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """One step of a single data-parallel rank (tensor parallel only): the runner interface."""
        return self.execute_partitions([batch])

    def execute_partitions(self, batches: Sequence[StepBatch]) -> torch.Tensor:
        """One step on every rank, batches[d] on data-parallel rank d; the sampled logits of every batch, in
        batch order."""
        if self.failure is None and self.ranks is not None:
            self.failure = self.ranks.died() or None
        if self.failure is not None:
            raise RanksLostError(self.failure)
        self.liveness.step_begins()
        try:
            self.group.send(list(batches))
            logits = run_step(self.runner, self.group, batches)
            assert logits is not None, "rank 0 gathers the logits of every data-parallel rank"
            return logits
        except Exception as exc:
            log.error("a step failed on rank 0 (%s: %s); the ranks can no longer step together",
                      type(exc).__name__, exc)
            with self._lock:                 # a rank found lost meanwhile (its kill broke this step) keeps its message
                lost = self.failure
            self.failure = lost or self.lost_rank() or ("the ranks stopped stepping together: a step failed on rank "
                                                        "0 or a peer rank (the server's log says why)")
            raise RanksLostError(self.failure) from exc
        finally:
            self.liveness.step_ends()

    def lost_rank(self) -> str:
        """After a failed step: the spawned rank that died, waiting briefly (a killed peer's connection can break
        a moment before its exit is visible), or '' when every spawned rank still runs."""
        if self.ranks is None:
            return ""
        deadline = time.monotonic() + DEATH_GRACE_S
        while not (message := self.ranks.died()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return message

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call on_lost(message) once when a rank is lost while serving: a spawned rank that exits (seen within
        WATCH_POLL_S), a rank whose heartbeat stops or that holds a step past parallel.step_timeout_s (spawned or
        torchrun's, npu/liveness.py). Every rank is then ended (`lose`)."""
        self._on_lost = on_lost
        if self.ranks is not None:
            self.ranks.watch(self.lose, self.stopping)
        threading.Thread(target=self._watch_liveness, name="rank-liveness", daemon=True).start()

    def _watch_liveness(self) -> None:
        while not self.stopping.wait(self.liveness.interval_s):
            message = self.liveness.check()
            if message:
                self.lose(message)
                return

    def lose(self, message: str) -> None:
        """A rank is lost (any thread; once, and never after a deliberate stop began): tell the engine first, so
        that its requests fail naming the rank, then end every rank: the abort key for torchrun's ranks, SIGKILL
        and reaping for the spawned ones (their connections close, which ends the owner's step in flight)."""
        with self._lock:
            if self._lost or self.stopping.is_set():
                return
            self._lost = True
            self.failure = self.failure or message
        log.error("the ranks are lost: %s", message)
        if self._on_lost is not None:
            self._on_lost(message)
        try:
            self.group.board.store.set(ABORT_KEY, message)
        except (RuntimeError, ValueError) as exc:     # the store's host (torchrun's agent) is gone
            log.warning("could not post the abort for the ranks: %s", exc)
        if self.ranks is not None:
            self.ranks.kill()

    def shutdown(self) -> None:
        """Stop every rank (they free their pools and exit), then free this rank's. After a failure the ranks
        still alive wait for a step that never comes: they are terminated at once."""
        self.stopping.set()
        if self.failure is None:
            try:
                self.group.send(STOP)
            except RuntimeError as exc:      # a rank is gone already
                log.warning("stopping the ranks: %s", exc)
                self.failure = str(exc)
        if self.ranks is not None and self.failure is None:
            self.ranks.stop()
        elif self.ranks is not None:
            self.ranks.kill()
        self.group.close()
        self.runner.shutdown()


def start_ranks(rc: RuntimeConfig, backend: Backend, runner: ModelRunner) -> tuple[DeviceGroup, StartupReport]:
    """Start every rank (spawned here, or torchrun's), and launch with all of them: this process is the owner,
    whose backend and runner the preflight already opened and checked."""
    world, timeout = world_size(rc.parallel), rc.parallel.startup_timeout_s
    rdv = Rendezvous.from_environment()
    ranks: LocalRanks | None = None
    group: RankGroup | None = None
    store: dist.Store
    try:
        if rdv is None:
            store = host_store(world, timeout)
            ranks = LocalRanks(rc, world, store.port)
            rank = 0
        else:
            rdv.check_world(world)
            store, rank = connect_store(rdv, timeout), rdv.rank
        board = StartupBoard(store, rank, world)
        group = RankGroup(place_of(rc.parallel, rank), board, backend.torch_device(0).type, timeout,
                          watch=ranks.exited if ranks is not None else None)
        runner, report = launch(rc, backend, runner, group)
    except BaseException:
        if ranks is not None:
            ranks.stop(wait_s=0)
        if group is not None:
            group.close()
        raise
    return DeviceGroup(runner, group, ranks, rc.parallel.step_timeout_s), report
