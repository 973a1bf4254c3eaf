"""The host half of a Qwen3 step: every index of the flat batch in one host tensor, and how its rows split into
decode buckets and prefill chunks (nothing here touches the device)."""

from __future__ import annotations

import array
import itertools
from dataclasses import dataclass, field

import torch

from appliance.core.archs.qwen3.layout import KV
from npu.step import FedTokens, SeqStep, logits_offsets

# Padding (token rows) a separate decode bucket must save to pay for its own gather and attention call;
# measured with the tiny model on CPU, where one call costs about as much as attending over 1k token rows.
SPLIT_MIN_SAVING = 1024


def decode_buckets(widths: list[int], block_size: int) -> list[tuple[int, int]]:
    """Split decode rows, sorted by decreasing width (pages), into [start, end) buckets, each padded to its
    first row's width. A new bucket starts where the width has at least halved (so there are few buckets)
    and the padding it saves, (bucket width - width) x remaining rows, is worth SPLIT_MIN_SAVING tokens."""
    out, start = [], 0
    for i, w in enumerate(widths):
        top = widths[start]
        if 2 * w <= top and (len(widths) - i) * (top - w) * block_size >= SPLIT_MIN_SAVING:
            out.append((start, i))
            start = i
    out.append((start, len(widths)))
    return out


def pages_padding(num_tokens: int) -> int:
    """int64s between a step's write rows and its pages in StepLayout.host, so the pages start 16 bytes aligned:
    the Triton kernels that read them specialize on their pointers' alignment, and pages at an odd offset one step
    and an even one the next would compile a second variant mid-serving."""
    return (3 * num_tokens) % 2


@dataclass
class StepLayout:
    """The host half of a step's metadata (ModelRunner.prepare): the flat batch's integers in one host tensor
    (tokens, positions, write rows, pages, sampled rows) and, as plain ints, how its rows split into decode buckets
    and prefill chunks. Nothing here touches the device; StepMeta.upload makes the device half from it.

    Flat order: decode rows (by decreasing context when that splits them into buckets), then chunks from position
    0 by length, then chunks after cached tokens by start and length (equal lengths, and for cached chunks equal
    starts, share one attention call). Page ids are range-checked here by one min/max."""

    host: torch.Tensor                 # int64: tokens, positions, write rows [n each], pages_padding, pages, sampled rows
    num_tokens: int
    num_pages: int
    num_sample: int
    all_rows: bool                     # every row is sampled, in order: no index_select at the end
    max_pos: int
    decodes: list[tuple[int, int, int, int, int]]   # buckets: (first row, rows, width in pages, min pos, max pos)
    chunks: list[tuple[int, int, int, int]]         # prefill chunks: (first row, length, start_pos, pages used)
    paged: bool                        # decode rows for the CPU paged kernel (no padding mask)
    fused: tuple[torch.Tensor, list[int], list[int]] | None   # the fused kernel's host block table and lengths
    last_rows: list[int] = field(default_factory=list)  # per sequence (batch order), the flat row of its last token
    fed: FedTokens | None = None       # async scheduling: rows whose token the runner writes on the device

    @staticmethod
    def build(seqs: list[SeqStep], block_size: int, num_pages: int, page_stride: int, fused: bool = False,
              paged: bool = False) -> "StepLayout":
        dec: list[tuple[int, SeqStep, list[int]]] = []     # (index in batch, seq, pages covering its context)
        chunks: list[tuple[int, SeqStep, list[int]]] = []
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            if n == 0:
                raise ValueError(f"request {s.request_id}: a step needs at least one token")
            table = s.block_tables.get(KV)
            end = s.start_pos + n
            if table is None or len(table) * block_size < end:
                raise ValueError(f"request {s.request_id}: block table {KV!r} covers "
                                 f"{0 if table is None else len(table) * block_size} tokens, the step needs {end}")
            (dec if n == 1 else chunks).append((i, s, table[:-(-end // block_size)]))
        buckets = [(0, len(dec))] if dec else []
        if not paged and len(dec) > 1 and max(len(e[2]) for e in dec) >= 2 * min(len(e[2]) for e in dec):   # else no split
            by_width = sorted(dec, key=lambda e: -len(e[2]))
            split = decode_buckets([len(e[2]) for e in by_width], block_size)
            if len(split) > 1:
                dec, buckets = by_width, split
        chunks.sort(key=lambda e: (e[1].start_pos > 0, e[1].start_pos, len(e[1].token_ids)))

        tokens = [s.token_ids[0] for _, s, _ in dec]
        positions = [s.start_pos for _, s, _ in dec]
        rows = [used[-1] * page_stride + s.start_pos % block_size for _, s, used in dec]
        last_row = [0] * len(seqs)              # flat row of each sequence's last token
        for r, (i, _, _) in enumerate(dec):
            last_row[i] = r
        pages: list[int] = []
        decodes = []
        for lo, hi in buckets:
            width = max(len(used) for _, _, used in dec[lo:hi])
            for _, _, used in dec[lo:hi]:
                pages += used
                pages += [0] * (width - len(used))
            decodes.append((lo, hi - lo, width, min(positions[lo:hi]), max(positions[lo:hi])))
        chunk_rows = []
        for i, s, used in chunks:
            end = s.start_pos + len(s.token_ids)
            chunk_rows.append((len(tokens), len(s.token_ids), s.start_pos, len(used)))
            tokens += s.token_ids
            positions += range(s.start_pos, end)
            rows += [used[p // block_size] * page_stride + p % block_size for p in range(s.start_pos, end)]
            pages += used
            last_row[i] = len(tokens) - 1
        sample = [last_row[i] - len(s.token_ids) + 1 + k for i, s in enumerate(seqs) for k in logits_offsets(s)]
        n = len(tokens)
        host = torch.frombuffer(array.array("q", tokens + positions + rows + [0] * pages_padding(n) + pages + sample),
                                dtype=torch.long)
        if pages and (min(pages) < 0 or max(pages) >= num_pages):   # name the culprit only on failure
            bad = next(s for _, s, used in dec + chunks if not 0 <= min(used) <= max(used) < num_pages)
            raise ValueError(f"request {bad.request_id}: page id out of range [0, {num_pages}) "
                             f"in {bad.block_tables[KV]}")
        return StepLayout(host, n, len(pages), len(sample), len(sample) == n and sample == list(range(n)),
                           max(positions), decodes, chunk_rows, paged,
                           fused_step([e[1:] for e in dec + chunks]) if fused else None, last_row)


def fused_step(order: list[tuple[SeqStep, list[int]]]) -> tuple[torch.Tensor, list[int], list[int]]:
    """The fused kernel's host block table and lengths for sequences in flat-batch order (each its pages)."""
    width = max(len(used) for _, used in order)
    table = array.array("i", [2 * p for _, used in order for p in used + [0] * (width - len(used))])
    query_ends = list(itertools.accumulate(len(s.token_ids) for s, _ in order))
    kv_lengths = [s.start_pos + len(s.token_ids) for s, _ in order]
    return torch.frombuffer(table, dtype=torch.int32).view(len(order), width), query_ends, kv_lengths
