"""KV pools on 2 MiB pages (transparent huge pages) on a CPU host, where the kernel grants them.

Why: a pool is as large as the memory budget (GiBs), and a decode step reads each sequence's pages wherever its
block table puts them. On 4 KiB pages nearly every KV page read is a TLB miss, and in a virtual machine (nested
paging) each miss walks two page tables. Measured on an AMD EPYC KVM guest (bench/ab_huge_pages.py: two runners in
one process taking decode steps in turn, each row's pages scattered over its pool): 2-4% off every decode step in 7
runs of 7 (6 x 768 bf16 at 64 rows over 1.5 and 6 GB, 25.0-29.8 -> 24.3-28.6 ms; 12 x 1024 bf16 at 32 rows over 1.3
and 6 GB, 37.9-38.7 -> 36.5-37.9 ms). Served over a 400 MB pool (vllm bench serve, 12 x 1024 at concurrency 32) the
difference was within the host's noise. The weights (read in order, a few MB at a time) gained nothing measurable,
so only pools ask.

Most Linux hosts ship THP as `madvise` (/sys/kernel/mm/transparent_hugepage/enabled): a region gets huge pages
only when asked, with madvise(MADV_HUGEPAGE) before its pages are first touched. A pool is allocated with
torch.empty and never touched as a whole, so its pages fault in as 2 MiB ones when first written. Only the
tensor's 2 MiB-aligned interior is advised: nothing is allocated beyond what the planner counted (the pool's
first and last partial 2 MiB stay on 4 KiB pages). A pool that malloc serves from memory the process already
touched (a small one, from freed heap chunks: npu.cpu_malloc never trims the heap) keeps the 4 KiB pages it has
until the kernel's khugepaged collapses them; a pool the size of a memory budget is a fresh mapping. torch has
the same for every CPU allocation behind THP_MEM_ALLOC_ENABLE, but process-wide and read once at its first
allocation (before this package is imported wherever torch came first); this asks for it where it was measured to
help.

APPLIANCE_CPU_HUGE_PAGES=0 turns it off (pools then take whatever the host's THP setting gives).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys

import torch

log = logging.getLogger("npu.huge_pages")

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14              # <sys/mman.h>, Linux
SWITCH = "APPLIANCE_CPU_HUGE_PAGES"


@functools.cache
def _madvise():
    """libc's madvise, or None where this libc has none."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "madvise", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def aligned_interior(start: int, nbytes: int) -> tuple[int, int]:
    """The 2 MiB-aligned [first, last) address range inside [start, start + nbytes); first == last if none."""
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = max(first, (start + nbytes) // HUGE_PAGE * HUGE_PAGE)
    return first, last


def advise_huge_pages(t: torch.Tensor) -> int:
    """Ask the kernel for 2 MiB pages under t's 2 MiB-aligned interior (call it before t is written). Returns the
    bytes advised: 0 where t has no whole aligned 2 MiB, is not on the CPU, the switch is off, the host is not Linux,
    or the kernel refused (logged)."""
    if t.device.type != "cpu" or os.environ.get(SWITCH, "1") == "0" or not sys.platform.startswith("linux"):
        return 0
    first, last = aligned_interior(t.data_ptr(), t.numel() * t.element_size())
    if last == first:
        return 0
    madvise = _madvise()
    if madvise is None or madvise(first, last - first, MADV_HUGEPAGE) != 0:
        err = ctypes.get_errno()
        log.info("madvise(MADV_HUGEPAGE) refused for a %d MiB pool (%s): it stays on the host's default pages",
                 (last - first) >> 20, os.strerror(err) if err else "no madvise in this libc")
        return 0
    return last - first
