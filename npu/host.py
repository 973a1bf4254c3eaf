"""Facts about the host the CPU backend runs on, read when it starts: the memory available now (/proc/meminfo) and
the intra-op threads the host lets this process use (the rule and its inputs, load included: npu.cpu_threads).

Apart from the device backends because they are the host's, not a device's: the CPU backend reads them, and so
may a report or a benchmark, without opening a backend.
"""

from __future__ import annotations

import logging

from npu.cpu_threads import choose_cpu_threads, read_host_cpus

log = logging.getLogger("npu.host")

MEMINFO = "/proc/meminfo"


def read_meminfo(path: str = MEMINFO) -> dict[str, int]:
    """/proc/meminfo in bytes (the file states kB)."""
    values: dict[str, int] = {}
    with open(path) as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                values[name.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


def available_bytes(path: str = MEMINFO) -> int | None:
    """MemAvailable of /proc/meminfo: what the host can give this process now without swapping (None: the file has
    no such line, as some containers' do; the backend then needs a configured size)."""
    return read_meminfo(path).get("MemAvailable")


def intra_op_threads(ranks_on_host: int = 1) -> int:
    """The intra-op threads for device.cpu_threads=null, logged with why and what is left to the front ends: a
    server shares the host with its clients (and often more)."""
    choice = choose_cpu_threads(read_host_cpus(), ranks_on_host)
    left = (f"{choice.left_beside} of {choice.usable} usable cores left to" if choice.left_beside else
            f"all {choice.usable} usable cores taken, so the engine's threads share them with")
    log.info("device.cpu_threads=null: %d intra-op thread%s (%s); %s the front ends and anything else this "
             "process runs (the event loop, tokenizing, detokenizing); set device.cpu_threads to choose",
             choice.threads, "" if choice.threads == 1 else "s", choice.reason, left)
    return choice.threads
