"""The ranks' liveness (npu/liveness.py) on a real in-process store (torch's HashStore, the API of the rendezvous
store) and a clock the test moves: a rank whose heartbeat stops is declared hung once parallel.step_timeout_s has
passed and not before; a rank that says it exited, with status 0 too, is dead; a step past its deadline names the
rank that holds it up. A worker's heartbeat leaves when the owner posts the abort. A spawned rank dies with its
owner even when it is stopped (SIGSTOP), whichever thread of the owner started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch.distributed as dist

from npu.liveness import ABORT_KEY, Heartbeat, LivenessMonitor, live_key
from tests.conftest import REPO
from tests.serve.test_ranks_cli import env, gone, wait_for

TIMEOUT_S = 10.0


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(store, rank: int, n: int, received: int = 0, finished: int = 0, pid: int = 4242, host: str | None = None):
    """What a rank's Heartbeat writes (this host unless `host`)."""
    import socket
    store.set(live_key(rank), f"{n} {received} {finished} {pid} {host or socket.gethostname()}")


def each_second(clock: Clock, monitor: LivenessMonitor, seconds: int, beats) -> list[str]:
    """Move the clock one second at a time, `beats(n)` writing second n's heartbeats; the check after each."""
    checks = []
    for n in range(seconds):
        clock.now += 1
        beats(n)
        checks.append(monitor.check())
    return checks


@pytest.fixture
def watched():
    store, clock = dist.HashStore(), Clock()
    return store, clock, LivenessMonitor(store, 3, TIMEOUT_S, clock=clock)


def test_a_rank_whose_heartbeat_stops_is_hung_only_past_the_step_timeout(watched):
    store, clock, monitor = watched
    for n in range(1, 4):                        # both ranks beat
        beat(store, 1, n), beat(store, 2, n, pid=4343)
        clock.now += 1
        assert monitor.check() == ""
    beat(store, 2, 4, pid=4343)                   # rank 1 falls silent: its last beat was seen just now
    clock.now += TIMEOUT_S
    beat(store, 2, 5, pid=4343)
    assert monitor.check() == ""                  # silent for TIMEOUT_S exactly: not yet
    clock.now += 1
    beat(store, 2, 6, pid=4343)
    assert monitor.check() == "rank 1 (pid 4242) hung: no heartbeat for 11 s, past parallel.step_timeout_s=10"


def test_a_rank_that_never_beats_is_hung_and_a_remote_one_is_named_with_its_host(watched):
    store, clock, monitor = watched
    beat(store, 2, 1, pid=77, host="node-b")
    assert monitor.check() == ""
    clock.now += TIMEOUT_S + 1
    message = monitor.check()
    assert "rank 1 hung: no heartbeat for 11 s" in message
    assert "rank 2 (pid 77 on node-b) hung" in message


@pytest.mark.parametrize("status", [0, 1])
def test_a_rank_that_exits_while_serving_is_dead_whatever_its_status(watched, status):
    """A torchrun rank is no child of the owner: its exit is known from what it wrote on leaving."""
    store, clock, monitor = watched
    beat(store, 1, 1), beat(store, 2, 1)
    assert monitor.check() == ""
    store.set(live_key(2), f"exit {status} 4343 {__import__('socket').gethostname()}")
    assert monitor.check() == f"rank 2 (pid 4343) died: exited with status {status} while serving"


def test_a_step_past_its_deadline_names_the_rank_that_has_not_taken_it(watched):
    store, clock, monitor = watched
    monitor.step_begins()
    beat(store, 1, 1, received=1, finished=1), beat(store, 2, 1, received=0, finished=0)
    assert monitor.check() == ""
    # both keep beating, alive, but rank 2 never takes the step
    checks = each_second(clock, monitor, 11, lambda n: (beat(store, 1, n + 2, received=1, finished=1),
                                                        beat(store, 2, n + 2)))
    assert checks == [""] * 10 + ["rank 2 (pid 4242) hung: it has not taken step 1 in 11 s (parallel.step_timeout_s=10)"]


def test_a_step_past_its_deadline_names_the_silent_rank_before_its_heartbeat_runs_out(watched):
    """Stopped mid-step: the step's deadline comes first; the rank silent for several beats is the one named."""
    store, clock, monitor = watched
    monitor.step_begins()
    beat(store, 1, 1, received=1), beat(store, 2, 1, received=1)
    monitor.check()
    clock.now += 1
    beat(store, 1, 2, received=1), beat(store, 2, 2, received=1)   # rank 1's last beat
    monitor.check()
    checks = each_second(clock, monitor, 10, lambda n: beat(store, 2, n + 3, received=1))
    assert checks == [""] * 9 + ["rank 1 (pid 4242) hung: step 1 has run 11 s, past parallel.step_timeout_s=10, and "
                                 "the rank has sent no heartbeat for 10 s"]


def test_a_finished_step_has_no_deadline(watched):
    store, clock, monitor = watched
    monitor.step_begins()
    monitor.step_ends()
    checks = each_second(clock, monitor, 30, lambda n: (beat(store, 1, n, received=1, finished=1),
                                                        beat(store, 2, n, received=1, finished=1)))
    assert checks == [""] * 30


def test_a_heartbeat_counts_steps_beats_and_leaves_on_the_owners_abort():
    store = dist.HashStore()
    aborted: list[str] = []
    left = threading.Event()
    heartbeat = Heartbeat(store, 1, 0.01, lambda reason: (aborted.append(reason), left.set()))
    heartbeat.start()
    heartbeat.step_received()
    heartbeat.step_finished()
    heartbeat.step_received()
    wait_for(lambda: store.get(live_key(1)).decode().split()[1:4] == ["2", "1", str(os.getpid())], 30,
             "the counts in a beat")
    first = store.get(live_key(1))
    wait_for(lambda: store.get(live_key(1)) != first, 30, "the next beat")
    store.set(ABORT_KEY, "rank 2 (pid 9) hung")
    assert left.wait(30)
    assert aborted == ["the owner gave up on the ranks: rank 2 (pid 9) hung"]
    heartbeat.stop(1)
    assert store.get(live_key(1)).decode().startswith("exit 1 ")


SPAWNING_OWNER = textwrap.dedent("""
    import os, sys, threading
    from npu.device_group import spawn
    child = f"from npu.liveness import exit_with_parent; import time; exit_with_parent({os.getpid()}); " \\
            "print('armed', flush=True); time.sleep(600)"
    procs = []
    starter = threading.Thread(target=lambda: procs.append(spawn([sys.executable, "-c", child], dict(os.environ))))
    starter.start()
    starter.join()                                  # the thread that asked for the rank has ended
    print(procs[0].pid, flush=True)
    threading.Event().wait()
""")


def test_a_stopped_spawned_rank_dies_with_its_owner(tmp_path):
    """SIGKILL to the owner (no cleanup runs) while the rank is SIGSTOPped: the kernel kills the rank."""
    owner = subprocess.Popen([sys.executable, "-c", SPAWNING_OWNER], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                             text=True)
    try:
        lines = [owner.stdout.readline(), owner.stdout.readline()]
        rank = int(next(ln for ln in lines if ln.strip().isdigit()))
        assert "armed\n" in lines
        os.kill(rank, signal.SIGSTOP)
        assert not gone(rank)                       # outlived the thread that asked for it
        owner.kill()
        owner.wait(30)
        wait_for(lambda: gone(rank), 30, "the stopped rank killed with its owner")
    finally:
        if owner.poll() is None:
            owner.kill()
