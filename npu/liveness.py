"""Liveness of the ranks while serving: a rank that stops stepping is found within parallel.step_timeout_s.

A dead spawned rank is seen by its exit (npu/device_group.py polls the processes), but a hung one (stopped by
SIGSTOP or a debugger, stuck in a device call, deadlocked) never exits, and every rank waits for it in the
step's collectives. So each non-owner rank beats (`Heartbeat`, its own thread) and the owner watches
(`LivenessMonitor`), both through the ranks' rendezvous store, which torchrun's ranks share too:

    live/<rank>   "<beat> <received> <finished> <pid> <host>" every beat_interval(timeout): the beat counter
                  changes each time (a stopped or frozen process stops changing it), received / finished count
                  the owner's steps; "exit <status> <pid> <host>" when the rank leaves
    abort         written by the owner when it gives up on the ranks: every rank that can still run exits 1

The owner declares a rank lost (`LivenessMonitor.check`) when
- its beat has not changed for step_timeout_s (hung: idle or not),
- it wrote that it exited while the owner had not stopped it (an exit 0 too), or
- a step has been running for step_timeout_s: the ranks silent for several beats are named, else those that
  have not received the step, else every rank that has not finished it (all wait in its collectives).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("npu.liveness")

ABORT_KEY = "abort"
EXIT_OWNER_GONE = 1       # a spawned rank's exit status when its owner has gone (as after a failed step)
PARENT_POLL_S = 1.0
PR_SET_PDEATHSIG = 1      # prctl(2): the signal this process gets when the thread that started it ends
SILENT_BEATS = 3          # at a step's deadline, a rank whose beat has not changed for this many beats is the hung one


def beat_interval(step_timeout_s: float) -> float:
    """Seconds between beats: ten per deadline, at most one a second (a few store writes per rank and second)."""
    return min(1.0, step_timeout_s / 10)


def live_key(rank: int) -> str:
    return f"live/{rank}"


STATE_WORDS = {"T": "its process is stopped: SIGSTOP or a debugger", "t": "its process is stopped by a debugger",
               "D": "its process waits in the kernel (uninterruptible sleep: a device driver or I/O)",
               "Z": "its process has exited"}


def state_letter(pid: int) -> str:
    """A local process's state as /proc shows it (R, S, T, t, D, Z...), '' when there is none (gone, not Linux)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def is_stopped(pid: int) -> bool:
    """Stopped by a signal or a debugger: such a process can neither exit nor take SIGTERM until it is continued."""
    return state_letter(pid) in ("T", "t")


class Heartbeat:
    """A non-owner rank's sign of life (module docstring), written by its own thread.

    States: created -> start() -> beating (step_received / step_finished update what it writes) -> stop(status):
    writes the exit and ends. While beating it also ends the process (exit 1, `on_abort`) when the owner posts the
    abort key, or when the store is gone (the owner that hosts it has ended)."""

    def __init__(self, store: Any, rank: int, interval_s: float, on_abort: Callable[[str], None]):
        self.store, self.rank, self.interval_s, self.on_abort = store, rank, interval_s, on_abort
        self.received = 0          # steps received from the owner
        self.finished = 0          # steps run to their end
        self._who = f"{os.getpid()} {socket.gethostname()}"
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._write(0)
        self._thread.start()

    def step_received(self) -> None:
        self.received += 1

    def step_finished(self) -> None:
        self.finished += 1

    def stop(self, status: int) -> None:
        """This rank leaves (after the owner's stop: 0, or a failed step: 1): the owner hears it at once."""
        self._stopped.set()
        try:
            self.store.set(live_key(self.rank), f"exit {status} {self._who}")
        except (RuntimeError, ValueError):
            pass                                     # the store host is gone: the owner is gone too

    def _write(self, beat: int) -> None:
        self.store.set(live_key(self.rank), f"{beat} {self.received} {self.finished} {self._who}")

    def _run(self) -> None:
        beat = 0
        while not self._stopped.wait(self.interval_s):
            beat += 1
            try:
                self._write(beat)
                aborted = self.store.check([ABORT_KEY])
                reason = self.store.get(ABORT_KEY).decode() if aborted else ""
            except (RuntimeError, ValueError) as exc:
                if self._stopped.is_set():
                    return
                self.on_abort(f"the ranks' store is gone (rank 0 hosts it or torchrun's agent does): {exc}")
                return
            if aborted and not self._stopped.is_set():
                self.on_abort(f"the owner gave up on the ranks: {reason}")
                return


@dataclass
class _Seen:
    value: str | None          # the rank's last live/<rank> value (None: not written yet)
    changed_at: float          # when the owner saw it change (the owner's clock)


class LivenessMonitor:
    """The owner's view of every other rank's heartbeat and of the step in flight.

    States: watching (check() returns '' while every rank beats and no step overruns) -> a message naming the
    lost rank (the caller then ends every rank). step_begins / step_ends bracket each step the owner sends."""

    def __init__(self, store: Any, world: int, step_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.store, self.world, self.timeout_s = store, world, step_timeout_s
        self.clock = clock
        self.interval_s = beat_interval(step_timeout_s)
        now = clock()
        self._seen = {r: _Seen(None, now) for r in range(1, world)}
        self.step = 0                          # steps sent so far (the one in flight, while one is)
        self._step_started: float | None = None

    def step_begins(self) -> None:
        self.step += 1
        self._step_started = self.clock()

    def step_ends(self) -> None:
        self._step_started = None

    def check(self) -> str:
        """'' while every rank is alive, else why a rank is lost (reads every rank's heartbeat once)."""
        now = self.clock()
        for rank, seen in self._seen.items():
            value = self._read(rank)
            if value != seen.value:
                seen.value, seen.changed_at = value, now
        for rank, seen in self._seen.items():
            if seen.value is not None and seen.value.startswith("exit "):
                _, status, pid, host = seen.value.split()
                return f"{self._name(rank, pid, host)} died: exited with status {status} while serving"
        silent = {r: now - s.changed_at for r, s in self._seen.items() if now - s.changed_at > self.timeout_s}
        if silent:
            return "; ".join(f"{self._name(r)} hung: no heartbeat for {age:.0f} s, past "
                             f"parallel.step_timeout_s={self.timeout_s:g}{self._state(r)}" for r, age in silent.items())
        started = self._step_started
        if started is None or now - started <= self.timeout_s:
            return ""
        return self._overrun(now - started, now)

    def _overrun(self, age: float, now: float) -> str:
        """The step in flight has run past the deadline: name the ranks that hold it up."""
        step, limit = self.step, f"parallel.step_timeout_s={self.timeout_s:g}"
        quiet = [r for r, s in self._seen.items() if now - s.changed_at > SILENT_BEATS * self.interval_s]
        if quiet:
            return "; ".join(f"{self._name(r)} hung: step {step} has run {age:.0f} s, past {limit}, and the rank has "
                             f"sent no heartbeat for {now - self._seen[r].changed_at:.0f} s{self._state(r)}"
                             for r in quiet)
        counts = {r: self._counts(s.value) for r, s in self._seen.items()}
        behind = [r for r, (received, _) in counts.items() if received < step]
        if behind:
            return "; ".join(f"{self._name(r)} hung: it has not taken step {step} in {age:.0f} s ({limit})"
                             for r in behind)
        unfinished = [r for r, (_, finished) in counts.items() if finished < step]
        names = ", ".join(self._name(r) for r in unfinished) or "rank 0 (this process)"
        return (f"step {step} has run {age:.0f} s, past {limit}: {names} hung in it (every rank waits in the step's "
                f"collectives, so the one that holds them up cannot be told)")

    def _read(self, rank: int) -> str | None:
        key = live_key(rank)
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except (RuntimeError, ValueError):
            return self._seen[rank].value          # the store did not answer this time: nothing new seen

    def _counts(self, value: str | None) -> tuple[int, int]:
        if value is None or value.startswith("exit "):
            return 0, 0
        _, received, finished, *_ = value.split()
        return int(received), int(finished)

    def _who(self, rank: int) -> tuple[str, str]:
        value = self._seen[rank].value
        if value is None:
            return "", ""
        pid, host = value.split()[-2:]
        return pid, host

    def _name(self, rank: int, pid: str | None = None, host: str | None = None) -> str:
        """'rank 1 (pid 42)', with the host when it is not this one; 'rank 1' before its first beat."""
        if pid is None:
            pid, host = self._who(rank)
        if not pid:
            return f"rank {rank}"
        return f"rank {rank} (pid {pid}{'' if host == socket.gethostname() else f' on {host}'})"

    def _state(self, rank: int) -> str:
        pid, host = self._who(rank)
        if not pid or host != socket.gethostname():
            return ""
        state = STATE_WORDS.get(state_letter(int(pid)), "")
        return f" ({state})" if state else ""



def exit_with_parent(parent: int) -> None:
    """End this process when the owner that spawned it is gone (killed before it could stop its ranks).

    On Linux the kernel does it: SIGKILL when the owner's spawning thread ends, which kills this process even when
    it is stopped (SIGSTOP), so no exit path of the owner leaves a rank behind (npu/device_group.py spawns from a
    thread that lives as long as the owner). Elsewhere, and as a second line, a thread polls the parent."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:             # the owner ended before the signal was armed
        os._exit(EXIT_OWNER_GONE)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        log.error("the owner (pid %d) is gone; this rank exits", parent)
        os._exit(EXIT_OWNER_GONE)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
