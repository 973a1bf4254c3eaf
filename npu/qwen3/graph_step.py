"""A Qwen3 decode step that replays a device graph (npu/graphs.py): the bucket's static inputs on the device and
the host tensor that fills them."""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from appliance.core.archs.qwen3.layout import KV
from npu.step import FedTokens, SeqStep, StepBatch


def decode_only(batch: StepBatch) -> bool:
    """Every row computes one token and samples it (no prompt logprobs, no drafts): what a decode graph runs."""
    return all(len(s.token_ids) == 1 and s.sample and not s.all_logits and not s.num_draft for s in batch.seqs)


@dataclass
class StaticDecode:
    """A decode bucket's static inputs on the device, views of one buffer (one copy fills them all): per row its
    token, position, write row (K-plane row of its token in layer 0), context length, then its page table."""

    buffer: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor
    lengths: torch.Tensor
    pages: torch.Tensor

    @staticmethod
    def empty(batch: int, width: int, device: torch.device) -> "StaticDecode":
        buffer = torch.zeros(batch * (4 + width), dtype=torch.long, device=device)
        tokens, positions, write_rows, lengths, pages = buffer.split([batch, batch, batch, batch, batch * width])
        return StaticDecode(buffer, tokens, positions, write_rows, lengths, pages.view(batch, width))


@dataclass
class GraphStep:
    """The host half of a decode step that replays a graph: the bucket's static inputs as one host tensor (the
    real rows, then padding rows that read and write a scratch page)."""

    rows: int
    host: torch.Tensor
    fed: FedTokens | None = None       # async scheduling: rows whose token the runner writes on the device

    @staticmethod
    def build(seqs: list[SeqStep], block_size: int, num_pages: int, page_stride: int, batch: int, width: int,
              scratch: int) -> "GraphStep":
        pad = batch - len(seqs)
        tokens, positions, rows, lengths, pages = [], [], [], [], []
        for s in seqs:
            table = s.block_tables.get(KV)
            used = -(-(s.start_pos + 1) // block_size)
            if table is None or len(table) < used or used > width:
                raise ValueError(f"request {s.request_id}: block table {KV!r} {table} does not cover position "
                                 f"{s.start_pos} within {width} pages")
            if not 0 <= min(table[:used]) <= max(table[:used]) < num_pages:
                raise ValueError(f"request {s.request_id}: page id out of range [0, {num_pages}) in {table}")
            tokens.append(s.token_ids[0])
            positions.append(s.start_pos)
            rows.append(table[used - 1] * page_stride + s.start_pos % block_size)
            lengths.append(s.start_pos + 1)
            pages += table[:used] + [0] * (width - used)
        tokens += [0] * pad
        positions += [0] * pad
        rows += [scratch * page_stride] * pad
        lengths += [1] * pad
        pages += ([scratch] + [0] * (width - 1)) * pad
        host = torch.frombuffer(array.array("q", tokens + positions + rows + lengths + pages), dtype=torch.long)
        return GraphStep(len(seqs), host)
