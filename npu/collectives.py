"""The collectives a runner calls inside a step, over one process group (its tensor- or expert-parallel ranks).

A runner holds one of these per kind of parallelism it uses (None in a one-process deployment, where no
collective runs at all). Every rank of the group calls the same operations in the same order: that is what
keeps ranks in lockstep, so a rank with nothing to compute still calls them (with empty tensors).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

# One tensor gathered into one: torch 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there);
# the GPU host's torch 2.11 has only the older name.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collective:
    """Sum, gather and exchange over the ranks of `group` (size ranks; this one is `rank` among them)."""

    def __init__(self, group: Any, size: int, rank: int):
        self.group = group
        self.size = size
        self.rank = rank

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (row-parallel partial products)."""
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather_columns(self, t: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
        """Concatenate every rank's columns (rank i holds widths[i] of them) along the last dimension
        (vocab-parallel logits). Parts are padded to the widest, since a gather moves equal shapes."""
        widest = max(widths)
        padded = t if t.shape[-1] == widest else torch.nn.functional.pad(t, (0, widest - t.shape[-1]))
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat([p[..., :w] for p, w in zip(parts, widths)], dim=-1)

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """How many rows each rank will send this one, given how many this one sends each ([size] int64)."""
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts, group=self.group)
        return recv

    def all_to_all(self, t: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows [sum(send_counts), ...] in rank order, send_counts[i] of them to rank i; returns the rows received,
        recv_counts[i] from rank i, in rank order."""
        out = t.new_empty((sum(recv_counts), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv_counts, send_counts, group=self.group)
        return out

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (the same shape on each), concatenated along the first dimension in rank order."""
        out = t.new_empty((self.size * t.shape[0], *t.shape[1:]))
        ALL_GATHER_SINGLE(out, t.contiguous(), group=self.group)
        return out

    def exchange_blocks(self, t: torch.Tensor) -> torch.Tensor:
        """t [size x m, ...]: block i (rows i m .. (i + 1) m) goes to rank i; returns the block each rank sent this
        one, in rank order. Equal blocks: no count crosses to the host."""
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t.contiguous(), group=self.group)
        return out
