"""The owner's watch over the ranks it spawned: a rank that dies while the server is idle (no step to fail) is
noticed, named with how it ended, and reaped (no zombie), and a deliberate stop is no death. Stand-in children
(`sleep`) play the ranks: what is watched is the process, not what it runs."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

from npu.device_group import LocalRanks, exit_reason


def watched(*procs: subprocess.Popen) -> LocalRanks:
    ranks = LocalRanks.__new__(LocalRanks)          # the spawning itself is test_rank_death's (real ranks)
    ranks.procs = list(procs)
    return ranks


def test_an_idle_rank_killed_is_reported_by_name_and_reaped():
    alive, victim = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    heard: list[str] = []
    told = threading.Event()
    ranks = watched(alive, victim)
    try:
        ranks.watch(lambda message: (heard.append(message), told.set()), threading.Event())
        os.kill(victim.pid, signal.SIGKILL)
        assert told.wait(30)
        assert heard == [f"rank 2 (pid {victim.pid}) died: killed by SIGKILL"]
        assert not Path(f"/proc/{victim.pid}").exists()         # reaped, not a zombie
    finally:
        ranks.kill()
    assert alive.returncode == -signal.SIGKILL


def test_a_rank_exiting_0_while_serving_is_a_death_too():
    """Only the owner's stop ends a rank well; an exit 0 before it leaves the others waiting all the same."""
    alive, quitter = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["true"])
    heard: list[str] = []
    told = threading.Event()
    ranks = watched(alive, quitter)
    try:
        ranks.watch(lambda message: (heard.append(message), told.set()), threading.Event())
        assert told.wait(30)
        assert heard == [f"rank 2 (pid {quitter.pid}) died: exited with status 0"]
    finally:
        ranks.kill()


def test_stopping_kills_a_stopped_rank_at_once():
    """A SIGSTOPped rank can neither exit on the owner's stop nor take SIGTERM: it is killed, not waited for."""
    leaving, frozen = subprocess.Popen(["true"]), subprocess.Popen(["sleep", "60"])
    os.kill(frozen.pid, signal.SIGSTOP)
    ranks = watched(leaving, frozen)
    ranks.stop(wait_s=600)                              # returns long before the wait: nothing to wait for
    assert leaving.returncode == 0 and frozen.returncode == -signal.SIGKILL


def test_ranks_exiting_after_a_deliberate_stop_are_no_death():
    rank = subprocess.Popen(["sleep", "60"])
    heard: list[str] = []
    stopped = threading.Event()
    ranks = watched(rank)
    watcher = ranks.watch(heard.append, stopped)
    stopped.set()
    ranks.kill()
    watcher.join(30)
    assert not watcher.is_alive() and heard == []


def test_exit_reasons_read_as_words():
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_reason(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert exit_reason(1) == "exited with status 1"
