"""Leaving a process at once, without the interpreter's teardown (stdlib only: a front end that never loads torch
uses it too).

An owner of ranks registers what must happen first (before_leaving: reap the ranks it spawned); leave_process runs
those hooks, flushes the output and exits with os._exit.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, NoReturn

log = logging.getLogger("npu.ranks")


_before_leaving: list[Callable[[], None]] = []


def before_leaving(hook: Callable[[], None]) -> None:
    """Run `hook` when this process leaves through leave_process (the owner ends the ranks it spawned and reaps
    them, whichever way it leaves: a rank it could not stop, e.g. a stopped one, would otherwise outlive it)."""
    _before_leaving.append(hook)


def leave_process(status: int) -> NoReturn:
    """End this rank's process now with `status`, its output flushed, without the interpreter's teardown.

    After a failed startup the process group may still hold gloo's threads in a collective a vanished peer
    never answers; tearing them down at exit can abort ("terminate called without an active exception"),
    turning exit 2 into SIGABRT. No state of a rank outlives its process, so nothing is lost by skipping it."""
    for hook in _before_leaving:
        try:
            hook()
        except Exception as exc:  # noqa: BLE001 - leaving anyway; the kernel ends spawned ranks with this process
            log.warning("before leaving: %s: %s", type(exc).__name__, exc)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
