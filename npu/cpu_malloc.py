"""Keep freed tensor memory in the process on CPU, so a step reuses the pages of the step before.

torch's CPU allocator is plain malloc. glibc serves blocks above its mmap threshold (dynamic, from 128 KiB)
with fresh mmap()s, gives trimmed heap tops back to the kernel, and gives each new thread its own arena; so
every prefill step's multi-MB activations (and the engine thread's tensors) were new pages, zeroed by the
kernel on first touch. In a virtual machine a first touch also faults in the host: a 2048-token prefill step
of the 45M-parameter benchmark model took ~9,000-23,000 page faults, 15-25% of its time. With the
settings below the same step takes a few (tensors above 32 MiB, glibc's ceiling for the threshold, still
come from mmap). The cost: the process keeps its peak heap, which the startup profile already counted
(peak activations are planned as resident, outside the KV pools).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("npu.cpu_malloc")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_MAX = 32 << 20    # glibc refuses more (half its 64 MiB heap size on 64-bit hosts)
NEVER_TRIM = 2**31 - 1          # M_TRIM_THRESHOLD is an int: the largest, i.e. never


def keep_freed_memory() -> bool:
    """Make glibc's malloc reuse freed blocks up to 32 MiB and never trim them; False where there is no glibc
    mallopt (another libc: allocation stays as it is)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        log.info("no glibc mallopt: freed tensor memory goes back to the kernel (more page faults per step)")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
        (M_TRIM_THRESHOLD, NEVER_TRIM),
        (M_ARENA_MAX, 1)))          # the engine thread allocates from the main heap too, which is never trimmed
    if not ok:
        log.info("glibc mallopt refused a setting: freed tensor memory may go back to the kernel")
    return ok
