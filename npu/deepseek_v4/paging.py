"""Where a step's rows live in the paged pools, and reading / writing them.

A step's plan is built once on the CPU (every layer reuses it), then moved to the device: for each cache
group the physical page and row of every row the step writes or reads, and whether that row exists. Rows
are located through the step's block tables only; ring groups find logical page L in slot L mod
max_blocks_per_seq, so a ring must have as many slots as the logical pages one step touches: the runner
checks that (appliance.core.archs.deepseek_v4.cache_groups.state_span_pages) instead of reading a reused slot.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch

from appliance.core.archs.deepseek_v4.cache_groups import state_span_pages
from appliance.core.config import ModelSpec
from appliance.core.kv_cache_spec import CacheGroupSpec
from npu.step import SeqStep, StepBatch, logits_offsets


@dataclass
class Rows:
    """Rows of one cache group for one step: physical page, row in page, and validity."""

    page: torch.Tensor
    row: torch.Tensor
    ok: torch.Tensor

    def map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "Rows":
        return Rows(move(self.page), move(self.row), move(self.ok))


@dataclass
class QueryGroup:
    """The sequences of a step that compute the same number of tokens (q_len), attended to together. Their
    tokens are the flat rows first .. first + num_seqs * q_len, so their queries are a [S, Q] view of the
    flat batch: no sequence is padded to a longer one (a step of decode rows next to a long chunk would
    otherwise attend num_seqs x the chunk's length queries, most of them padding)."""

    first: int
    num_seqs: int
    q_len: int
    window_mask: torch.Tensor                                          # [S, Q, Kw] query sees window key
    visible: dict[int, torch.Tensor] = field(default_factory=dict)     # ratio -> [S, Q, Kc]
    keys: dict[str, Rows] = field(default_factory=dict)                # group -> key rows: ori [S, Kw], others [S, Kc]
    # [S, Q] tokens whose compressed rows the indexer ranks a query's picks over, see Attention._index: a prompt
    # token's, the prompt's length (the step's end when not known); a later token's, its position + 1 (what one
    # -token decoding ranks over: so verifying drafts, or recomputing after preemption, ranks as decoding did)
    ranked_end: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    index: IndexPlan | None = None     # the CSA indexer's top-k sizes and tie rows (groups of a step with CSA)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """[N, ...] flat tokens -> this group's [S, Q, ...] queries (a view)."""
        return flat[self.first:self.first + self.num_seqs * self.q_len].unflatten(0, (self.num_seqs, self.q_len))

    def map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "QueryGroup":
        """The group with `move` applied to every tensor the device half reads (ranked_end stays on the host)."""
        return QueryGroup(self.first, self.num_seqs, self.q_len, move(self.window_mask),
                          {r: move(v) for r, v in self.visible.items()}, {k: v.map(move) for k, v in self.keys.items()},
                          self.ranked_end, None if self.index is None else self.index.map(move))


@dataclass
class IndexPlan:
    """The host-known sizes of one query group's indexer top-k (Attention._index), so the device half needs no
    value of its own: k (index_topk, or fewer when no query ranks that many rows), the padded score width, and,
    per distinct ranked length T > k, the queries ([S * Q] flat indices) ranking over T rows: where the k-th and the
    (k + 1)-th score tie, those queries take torch.topk's choice on their row cut to T, as transformers does."""

    k: int
    width: int
    by_length: list[tuple[int, torch.Tensor]]

    def map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "IndexPlan":
        return IndexPlan(self.k, self.width, [(n, move(q)) for n, q in self.by_length])


def index_plan(ranked_end: torch.Tensor, ratio: int, topk: int, num_rows: int) -> IndexPlan:
    """The IndexPlan of a group whose queries rank over ranked_end // ratio rows, num_rows compressed rows read."""
    ranked = (ranked_end // ratio).flatten()
    k = min(topk, int(ranked.max()) if ranked.numel() else 0)
    width = max(int(ranked.max()) if ranked.numel() else 0, num_rows)
    lengths = sorted(set(ranked.tolist()))
    return IndexPlan(k, width, [(n, (ranked == n).nonzero().flatten()) for n in lengths if n > k])


@dataclass
class StepPlan:
    """Layer-independent indices of one step. Flat tokens are ordered by query group (sequences by how many
    tokens they compute, decode rows first; batch order within a group); sample_index gives the logits
    rows back in batch order."""

    token_ids: torch.Tensor        # [N]
    pos: torch.Tensor              # [N] position of each flat token
    sample_index: torch.Tensor     # [M] flat index of the last token of each sampled sequence, in batch order
    groups: list[QueryGroup]
    run_pos: dict[int, torch.Tensor] = field(default_factory=dict)   # ratio -> [J] first token of each completed run
    rows: dict[str, Rows] = field(default_factory=dict)              # "group.use" -> rows written or pooled

    def map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "StepPlan":
        """The plan with `move` applied to every tensor the device half reads, in a fixed order."""
        return StepPlan(move(self.token_ids), move(self.pos), move(self.sample_index), [g.map(move) for g in self.groups],
                        {r: move(v) for r, v in self.run_pos.items()}, {k: v.map(move) for k, v in self.rows.items()})

    def to(self, device: torch.device) -> "StepPlan":
        """The plan on the device, once per step: its host tensors packed into one buffer per dtype (index and mask
        tensors: two) and each buffer uploaded without waiting; the plan's tensors are views of those. About 40
        tensors per step, each its own copy before (a launch and a staging copy apiece)."""
        host: list[torch.Tensor] = []

        def collect(t: torch.Tensor) -> torch.Tensor:
            host.append(t)
            return t

        self.map(collect)
        moved = iter(packed_upload(host, device))
        return self.map(lambda t: next(moved))


ALIGN_BYTES = 16     # where each packed tensor starts in its buffer: a kernel sees the same pointer alignment each step


def packed_upload(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors on `device` with one non-blocking copy per dtype: each dtype's tensors laid one after another in a
    host buffer (each from a multiple of ALIGN_BYTES: Triton specializes a kernel on its pointers' alignment, so a
    table at an odd offset one step and an even one the next would compile a second variant mid-serving), uploaded,
    and handed back as views of the device buffer in the order given (their shapes, contiguous)."""
    by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        by_dtype[t.dtype].append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for dtype, indices in by_dtype.items():
        unit = max(1, ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size())
        starts, at = [], 0
        for i in indices:
            starts.append(at)
            at += -(-tensors[i].numel() // unit) * unit
        host = torch.zeros(at, dtype=dtype)
        for i, start in zip(indices, starts):
            host[start:start + tensors[i].numel()] = tensors[i].reshape(-1)
        flat = host.to(device, non_blocking=True)
        for i, start in zip(indices, starts):
            out[i] = flat[start:start + tensors[i].numel()].view(tensors[i].shape)
    return out


@dataclass(frozen=True)
class Compression:
    """One compressed attention kind: its ratio, its state and output groups, whether windows overlap."""

    ratio: int
    states: tuple[str, ...]        # state ring groups, written per token
    outputs: tuple[str, ...]       # compressed row groups, written per completed window
    overlap: bool


def block_table(spec: CacheGroupSpec, seqs: list[SeqStep]) -> torch.Tensor:
    """[S, M] physical pages of each sequence's logical pages (ring: slots), -1 where none."""
    lists = [s.block_tables.get(spec.name, []) for s in seqs]
    width = max(1, *map(len, lists))
    return torch.tensor([[*pages, *[-1] * (width - len(pages))] for pages in lists], dtype=torch.long)   # one copy


def locate(spec: CacheGroupSpec, table: torch.Tensor, seq: torch.Tensor, row_pos: torch.Tensor, ok: torch.Tensor,
           seqs: list[SeqStep]) -> Rows:
    """Page and row of row number `row_pos` (tokens, or compressed rows) of sequence `seq`."""
    row_pos = row_pos.clamp(min=0)
    logical = row_pos // spec.rows_per_block
    slot = logical % spec.max_blocks_per_seq if spec.is_ring else logical
    inside = slot < table.shape[1]
    page = torch.where(inside, table[seq, slot.clamp(max=table.shape[1] - 1)], -1)
    missing = ok & (page < 0)
    if missing.any():
        i = int(missing.nonzero()[0][0]) if missing.dim() == 1 else tuple(missing.nonzero()[0].tolist())
        raise ValueError(f"request {seqs[int(seq[i])].request_id!r}: cache group {spec.name!r} has no page for "
                         f"row {int(row_pos[i])} (logical page {int(logical[i])}, block table index "
                         f"{int(slot[i])})")
    return Rows(page.clamp(min=0), row_pos % spec.rows_per_block, ok)


def check_state_rings(model: ModelSpec, kinds: list[Compression], seqs: list[SeqStep]) -> None:
    """Every compressor-state ring has a slot for each logical page the step touches (see state_span_pages);
    the scheduler's block-aligned chunks always fit, a longer chunk from mid-window may not."""
    for kind in kinds:
        for name in kind.states:
            spec = model.group(name)
            for s in seqs:
                need = state_span_pages(s.start_pos, len(s.token_ids), kind.ratio, spec.tokens_per_page, kind.overlap)
                if need > spec.max_blocks_per_seq:
                    raise ValueError(
                        f"request {s.request_id!r}: a step of {len(s.token_ids)} tokens from position {s.start_pos} "
                        f"touches {need} pages of ring {name!r}, which keeps {spec.max_blocks_per_seq}: start "
                        f"multi-token steps on a block boundary (as the scheduler does) or shorten them")


def flat_order(seqs: list[SeqStep]) -> list[int]:
    """Batch indices in the order a plan lays out their tokens: by tokens computed, batch order among equals."""
    return sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids))


def build_plan(model: ModelSpec, batch: StepBatch, kinds: list[Compression], device: torch.device,
               window: str = "ori") -> StepPlan:
    """The step's rows. `window`: the group holding the sliding-window rows (plan keys "ori"): `ori` for the
    main layers, the MTP layers' own group for a drafting pass."""
    tif = model.layout.tokens_in_flight
    for s in batch.seqs:
        if not 1 <= len(s.token_ids) <= tif or s.start_pos < 0:
            raise ValueError(f"request {s.request_id!r}: a step computes 1..{tif} tokens (tokens_in_flight) "
                             f"from start_pos >= 0, got {len(s.token_ids)} tokens at {s.start_pos}")
    check_state_rings(model, kinds, batch.seqs)
    order = flat_order(batch.seqs)
    seqs = [batch.seqs[i] for i in order]
    S = len(seqs)
    lens = torch.tensor([len(s.token_ids) for s in seqs])
    starts = torch.tensor([s.start_pos for s in seqs])
    ends = starts + lens
    prompt_lens = torch.tensor([s.prompt_len for s in seqs])
    prompt_ends = torch.where(prompt_lens > 0, prompt_lens, ends)
    last = torch.cumsum(lens, 0) - 1                                      # flat index of each sequence's last token
    tok_seq = torch.repeat_interleave(torch.arange(S), lens)
    pos = starts[tok_seq] + torch.arange(len(tok_seq)) - (last + 1 - lens)[tok_seq]
    all_tokens = torch.ones_like(pos, dtype=torch.bool)
    tables = {spec.name: block_table(spec, seqs) for spec in model.cache_groups}
    tables["ori"] = tables[window]

    def at(name: str, seq: torch.Tensor, row_pos: torch.Tensor, ok: torch.Tensor) -> Rows:
        return locate(model.group(name), tables[name], seq, row_pos, ok, seqs)

    rows = {"ori.write": at(window, tok_seq, pos, all_tokens)}
    flat_last = dict(zip(order, last.tolist()))
    sample = torch.tensor([flat_last[i] - len(s.token_ids) + 1 + k for i, s in enumerate(batch.seqs)
                           for k in logits_offsets(s)], dtype=torch.long)
    plan = StepPlan(torch.tensor([t for s in seqs for t in s.token_ids]), pos, sample, [])

    for kind in kinds:
        r = kind.ratio
        # windows completing in this step: i in [start // r, end // r)
        first, stop = starts // r, ends // r
        run_seq = torch.repeat_interleave(torch.arange(S), stop - first)
        offsets = torch.cumsum(stop - first, 0) - (stop - first)
        run = first[run_seq] + torch.arange(len(run_seq)) - offsets[run_seq]
        span = (2 if kind.overlap else 1) * r                              # overlap: the previous window too
        run_tokens = (run[:, None] + 1) * r - span + torch.arange(span)[None]   # [J, span]
        plan.run_pos[r] = run * r
        for name in kind.states:
            rows[f"{name}.write"] = at(name, tok_seq, pos, all_tokens)
            rows[f"{name}.read"] = at(name, run_seq[:, None].expand_as(run_tokens), run_tokens, run_tokens >= 0)
        for name in kind.outputs:
            rows[f"{name}.write"] = at(name, run_seq, run, torch.ones_like(run, dtype=torch.bool))

    W = model.layout.sliding_window
    for q_len in sorted(set(lens.tolist())):
        members = (lens == q_len).nonzero().squeeze(1)                    # consecutive sequences
        g_starts, g_ends = starts[members], ends[members]
        qpos = g_starts[:, None] + torch.arange(q_len)[None]                # [S, Q]
        # window keys: positions start - W + 1 .. end - 1 of each sequence
        kpos = g_starts[:, None] - (W - 1) + torch.arange(q_len + W - 1)[None]      # [S, Kw]
        kvalid = (kpos >= 0) & (kpos < g_ends[:, None])
        dist = qpos[:, :, None] - kpos[:, None, :]
        group = QueryGroup(int(last[members[0]]) + 1 - q_len, len(members), q_len,
                           kvalid[:, None, :] & (dist >= 0) & (dist < W),
                           ranked_end=torch.maximum(qpos + 1, prompt_ends[members][:, None]))
        if kinds:
            csa = min(kind.ratio for kind in kinds)
            group.index = index_plan(group.ranked_end, csa, model.layout.index_topk, int((g_ends // csa).max()))
        group.keys["ori"] = at(window, members[:, None].expand_as(kpos), kpos, kvalid)
        for kind in kinds:
            # compressed rows 0 .. end // r - 1, visible once their window has ended
            g_stop = g_ends // kind.ratio
            ci = torch.arange(int(g_stop.max()))[None].expand(len(members), -1)   # [S, Kc]
            group.visible[kind.ratio] = (ci[:, None, :] + 1) * kind.ratio - 1 <= qpos[:, :, None]
            for name in kind.outputs:
                group.keys[name] = at(name, members[:, None].expand_as(ci), ci, ci < g_stop[:, None])
        plan.groups.append(group)

    plan.rows = rows
    return plan if device.type == "cpu" else plan.to(device)     # built on the host


class PoolIO:
    """Reads and writes rows of the runner's pools ([layers, pages, rows, width] per group)."""

    def __init__(self, model: ModelSpec, pools: dict[str, torch.Tensor]):
        self.model = model
        self.pools = pools
        self.layer_index = {s.name: {layer: i for i, layer in enumerate(s.layer_ids)} for s in model.cache_groups}

    def read(self, group: str, layer: int, rows: Rows, width: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `width` values of each row, as dtype; zeros where rows.ok is False, so stale or NaN
        contents of pages never leak into the math."""
        spec, pool = self.model.group(group), self.pools[group]
        if is_scaled(spec, pool):                   # 1-byte values, then their fp32 scale
            raw = pool.view(torch.int8)[self.layer_index[group][layer], rows.page, rows.row]
            scale = raw[..., spec.row_width:spec.row_width + 4].contiguous().view(torch.float32)
            values = (raw[..., :width].view(pool.dtype).float() * scale).to(dtype)
        else:
            values = pool[self.layer_index[group][layer], rows.page, rows.row][..., :width].to(dtype)
        return torch.where(rows.ok[..., None], values, torch.zeros((), dtype=dtype, device=values.device))

    def layer_pool(self, group: str, layer: int) -> torch.Tensor:
        """One layer's rows of a group, [pages, rows, width] (a view), for a kernel that reads them in place."""
        return self.pools[group][self.layer_index[group][layer]]

    def scaled(self, group: str) -> bool:
        """Whether the group's rows are 1-byte values with an inline scale (read them with `read`)."""
        return is_scaled(self.model.group(group), self.pools[group])

    def write(self, group: str, layer: int, rows: Rows, values: torch.Tensor) -> None:
        spec, pool = self.model.group(group), self.pools[group]
        if is_scaled(spec, pool):
            data, pool = quantize_rows(values, pool.dtype), pool.view(torch.int8)
        else:
            data = values.to(pool.dtype)
        pool[self.layer_index[group][layer], rows.page, rows.row, :data.shape[-1]] = data


def is_scaled(spec: CacheGroupSpec, pool: torch.Tensor) -> bool:
    """Rows of 1-byte values (int8, float8) with an fp32 scale inline in 4 extra bytes: a quantized cache."""
    return pool.element_size() == 1 and spec.row_extra_bytes >= 4


def quantize_rows(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each row as 1-byte values plus its fp32 scale (the bytes as int8): one scale per row of amax / max,
    symmetric. int8: rounded to nearest; float8 (e4m3: DeepSeek V3.2's indexer cache, as vLLM and SGLang
    store it, 128 values and one fp32 scale per row): cast with round-to-nearest-even."""
    f = values.float()
    top = float(torch.iinfo(dtype).max) if not dtype.is_floating_point else float(torch.finfo(dtype).max)
    scale = f.abs().amax(-1, keepdim=True).clamp(min=1e-12) / top
    q = (f / scale).clamp(-top, top)
    q = q.round().to(dtype) if not dtype.is_floating_point else q.to(dtype).view(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)
