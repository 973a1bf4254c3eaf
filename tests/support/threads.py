"""Running a call at a given torch thread count (and so the CPU kernels' OpenMP threads), restored after."""

from __future__ import annotations

import torch


def on_threads(threads: int, op, *args):
    """op(*args) with torch at `threads` intra-op threads."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return op(*args)
    finally:
        torch.set_num_threads(before)
