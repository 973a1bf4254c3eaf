"""The device half of a Qwen3 step: one upload of a StepLayout's host tensor, then the decode buckets' page planes
and masks and the prefill groups, built once per step for every layer to reuse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from npu.fused_attention import FusedStep
from npu.qwen3.step_layout import StepLayout, pages_padding


@dataclass
class Prefill:
    """Chunks of more than one token at rows first..first+count*length-1 of the flat batch: either `count`
    chunks of equal length from position 0 (attending to their own K/V, one causal call for all), or `count`
    chunks after cached tokens (later chunks of long prompts, prefix-cache hits) with the same start and
    length, attending to their pages in the pool (one gather and one call for all, one shared mask)."""

    first: int
    count: int
    length: int
    planes: torch.Tensor | None = None  # cached chunks: K planes of the pages covering their contexts, then V planes
    ctx: int = 0                        # cached chunks: tokens in each context, the chunk included
    mask: torch.Tensor | None = None    # cached chunks: [length, ctx] bool offset-causal mask (True = attend)
    pages: torch.Tensor | None = None   # cached chunks: [count, pages per context] page ids (the CPU prefill kernel)


@dataclass
class Decode:
    """1-token sequences at rows first..first+count-1 of the flat batch, attended to as one padded batch."""

    first: int
    count: int
    planes: torch.Tensor | None  # [2 * count * width]: K planes of the rows' pages (padded with page 0), then V
                                 # planes; None for the CPU paged kernel, which reads `pages`
    ctx: int                   # columns attended to: the longest context in the bucket
    mask: torch.Tensor | None  # [count, 1, 1, ctx] bool, row i attends to columns 0..position_i; None: all equal
    pages: torch.Tensor | None = None    # CPU paged kernel: [count, width] the rows' page ids (padded with page 0)
    lengths: torch.Tensor | None = None  # CPU paged kernel: [count] tokens each row attends to


# Cached chunks of the same start and length are attended together while their contexts add up to at most
# this many tokens: one gather and one SDPA call instead of one per chunk saves per-call overhead where chunks
# are short (the startup profile's 64 chunks of 32 tokens: 0.58 -> 0.37 s in fp32), and the cap bounds the
# gather buffer that costs (the profile measures it; 16k tokens of K and V is 8 MB for the benchmark model).
GROUP_GATHER_TOKENS = 16384


def causal_mask(cols: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[len(positions), len(cols)] bool mask, True where col <= position. Bool, not an additive float mask:
    torch_npu's SDPA keeps its fused kernel only for a bool mask (or none), and the mask is 1/4 the bytes."""
    return cols[None, :] <= positions[:, None]


@dataclass
class StepMeta:
    """The device half of a step's metadata, built once per step from a StepLayout: one upload of its host tensor,
    then the decode buckets' page planes and masks and the prefill groups, for every layer to reuse."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor           # K-plane row (layer 0, in rows of kv_heads * head_dim) of each token
    sample_index: torch.Tensor | None  # flat rows to sample, in batch order; None: every row, in order
    num_tokens: int
    max_pos: int
    decodes: list[Decode]             # buckets of decode rows by context length, in flat order
    prefills: list[Prefill]
    fused: FusedStep | None            # the fused kernel's arguments, when the runner uses it

    @staticmethod
    def upload(layout: StepLayout, arange: Callable[[int], torch.Tensor], parity: torch.Tensor,
               device: torch.device) -> "StepMeta":
        n = layout.num_tokens
        t_tok, t_pos, t_rows, _, t_pages, t_sample = layout.host.to(device, non_blocking=True).split(
            [n, n, n, pages_padding(n), layout.num_pages, layout.num_sample])
        # Plane ids in a layer's [2 * pages, ...] view: row 0 the K planes (2p), row 1 the V planes (2p + 1). A
        # run of pages [a, b) is read as planes[:, a:b] flattened: K planes, then V planes (a view for one run).
        planes = t_pages * 2 + parity                   # parity: [[0], [1]]

        decodes, at = [], 0
        for lo, count, width, first, last in layout.decodes:
            span = slice(at, at + count * width)
            if layout.paged:                            # no padding to mask: each row stops at its own length
                decodes.append(Decode(lo, count, None, last + 1, None, t_pages[span].view(count, width),
                                       t_pos[lo:lo + count] + 1))
            else:
                mask = None if first == last else \
                    causal_mask(arange(last + 1), t_pos[lo:lo + count]).view(count, 1, 1, -1)
                decodes.append(Decode(lo, count, planes[:, span].reshape(-1), last + 1, mask))
            at += count * width
        prefills: list[Prefill] = []
        for first, length, start, used in layout.chunks:
            end = start + length
            prev = prefills[-1] if prefills else None
            if (start > 0 and prev is not None and prev.planes is not None and (prev.length, prev.ctx) == (length, end)
                    and (prev.count + 1) * end <= GROUP_GATHER_TOKENS):
                prev.count += 1                         # the same start and length: pages gathered together
                group = at - (prev.count - 1) * used    # where the first chunk's pages start
                prev.planes = planes[:, group:at + used].reshape(-1)
                prev.pages = t_pages[group:at + used].view(prev.count, used)
            elif start > 0:
                mask = causal_mask(arange(end), t_pos[first:first + length])
                prefills.append(Prefill(first, 1, length, planes[:, at:at + used].reshape(-1), end, mask,
                                        t_pages[at:at + used].view(1, used)))
            elif prefills and prefills[-1].planes is None and prefills[-1].length == length:
                prefills[-1].count += 1
            else:
                prefills.append(Prefill(first, 1, length))
            at += used
        fused = None
        if layout.fused is not None:
            table, query_ends, kv_lengths = layout.fused
            fused = FusedStep(table.to(device, non_blocking=True), query_ends, kv_lengths)
        return StepMeta(t_tok, t_pos, t_rows, None if layout.all_rows else t_sample, n, layout.max_pos, decodes,
                         prefills, fused)
