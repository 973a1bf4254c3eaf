"""DeepSeek V4 model runner over the seven paged KV-cache groups (the tiny and the full layout).

The math, per main layer (tests/dsv4_reference.py computes the same, unpaged, as the oracle):
- h = RMSNorm(x). Queries: num_heads heads of head_dim; keys = values = one latent row per token,
  RMSNorm(h Wkv) (MQA). RoPE rotates the last head_dim // 8 channels of queries and keys.
- Window: a query at position t sees the raw rows of tokens t - sliding_window + 1 .. t (ring `ori`).
- Compressed layers (ratio r): token t writes one state row [kv_t, g_t] with kv_t = h Wkv_c and
  g_t = h Wgate_c + ape[t % r]. Once tokens [i r, (i + 1) r) are all in, row i of cmp_c{r} is
  RoPE@(i r)(RMSNorm(sum_t softmax_t(g_t) * kv_t)) (softmax per channel over the run's tokens).
  Row i is visible to a query at t only when (i + 1) r - 1 <= t.
  HCA (largest ratio): attend to every visible row. CSA (smallest ratio): a lightning indexer
  (index_num_heads queries of index_head_dim; keys compressed the same way into `idx`) scores the
  visible rows, sum_h w_h relu(q_h . k_i), and the top index_topk rows (ties: lower row first) join.
- One softmax over window and compressed keys plus a learned per-head sink logit; output
  projection; residual; dense SwiGLU MLP; final RMSNorm; LM head. The MTP layer is not served.

Runs do not overlap (a run reads only its own tokens' state), so every step finds what it needs in
state rings of ratio + tokens_in_flight tokens; a state row uses the first 2 x width channels.
Steps may start at any position and hold up to tokens_in_flight tokens per sequence. Nothing here
bakes in a pool size: rows are located through the step's block tables on the runtime pools.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from appliance.core.archs.deepseek_v4 import STATE_GROUPS, compress_ratios
from appliance.core.config import ModelSpec
from appliance.core.kv_cache_spec import CacheGroupSpec
from npu.runner import ModelRunner
from npu.step import SeqStep, StepBatch

ROPE_FRACTION = 8   # DeepSeek V4 rotates 64 of its 512 latent channels


def rope_dim(width: int) -> int:
    """Channels RoPE rotates in a row of `width` (the last ones; an even count)."""
    return max(2, width // ROPE_FRACTION) // 2 * 2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def apply_rope(x: torch.Tensor, pos: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """Rotate the last `dim` channels of x (NeoX halves); pos gives x's leading dims (heads broadcast)."""
    half = dim // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) * 2 / dim)
    angle = pos.to(torch.float32)[..., None] * inv_freq
    while angle.dim() < x.dim():
        angle = angle.unsqueeze(-2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    keep, x1, x2 = x.split([x.shape[-1] - dim, half, half], dim=-1)
    return torch.cat([keep, x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass
class _Rows:
    """Where rows of one cache group live for one step: physical page, row in page, and validity."""

    page: torch.Tensor
    row: torch.Tensor
    ok: torch.Tensor

    def to(self, device: torch.device) -> "_Rows":
        return _Rows(self.page.to(device), self.row.to(device), self.ok.to(device))


@dataclass
class _StepPlan:
    """Layer-independent indices of one step (built on the CPU, then moved to the device).

    Queries are padded to [S, Q] (S sequences, Q = longest chunk); flat tokens follow batch order.
    """

    num_seqs: int
    max_q: int
    token_ids: torch.Tensor        # [N]
    pos: torch.Tensor              # [N] position of each flat token
    pad_index: torch.Tensor        # [N] index of each flat token in the padded [S * Q] layout
    sample_index: torch.Tensor     # [M] flat index of the last token of each sampled sequence
    window_mask: torch.Tensor      # [S, Q, Kw] query sees window key
    visible: dict[int, torch.Tensor] = field(default_factory=dict)   # ratio -> [S, Q, Kc]
    run_pos: dict[int, torch.Tensor] = field(default_factory=dict)   # ratio -> [J] first token of each completed run
    rows: dict[str, _Rows] = field(default_factory=dict)             # "group.use" -> rows


class DeepseekV4Runner(ModelRunner):
    """DeepSeek V4 over paged caches: sliding window (ori), CSA (cmp_c{small}, idx) and HCA (cmp_c{large})."""

    def __init__(self, model: ModelSpec, device: torch.device | str):
        super().__init__(model, torch.device(device))
        lay = model.layout
        self.ratios = model.main_layer_ratios
        self.csa_ratio, self.hca_ratio = compress_ratios(model)
        self.dtype = getattr(torch, lay.dtype)
        self.head_dim, self.index_dim = lay.head_dim, lay.index_head_dim
        self.window = lay.sliding_window
        self.cmp = {r: f"cmp_c{r}" for r in (self.csa_ratio, self.hca_ratio)}
        self.state = {self.csa_ratio: "csa_state", self.hca_ratio: "hca_state"}
        self.state_groups = STATE_GROUPS
        self.layer_index = {s.name: {l: i for i, l in enumerate(s.layer_ids)} for s in model.cache_groups}
        self.params: dict[str, torch.Tensor] = {}

    # -- weights -----------------------------------------------------------------------------------
    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        lay, dt, f32 = self.model.layout, self.dtype, torch.float32
        D, H, d, V, inner = lay.hidden_size, lay.num_heads, self.head_dim, lay.vocab_size, lay.intermediate_size
        w: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"embed.weight": ((V, D), dt)}

        def compressor(prefix: str, width: int, ratio: int) -> None:
            w[prefix + "wkv.weight"] = ((width, D), dt)
            w[prefix + "wgate.weight"] = ((width, D), dt)
            w[prefix + "ape"] = ((ratio, width), f32)
            w[prefix + "norm.weight"] = ((width,), dt)

        for layer, ratio in enumerate(self.ratios):
            p = f"layers.{layer}."
            w[p + "attn_norm.weight"] = ((D,), dt)
            w[p + "attn.wq.weight"] = ((H * d, D), dt)
            w[p + "attn.wkv.weight"] = ((d, D), dt)
            w[p + "attn.kv_norm.weight"] = ((d,), dt)
            w[p + "attn.sink"] = ((H,), f32)
            w[p + "attn.wo.weight"] = ((D, H * d), dt)
            if ratio:
                compressor(p + "attn.compressor.", d, ratio)
            if ratio == self.csa_ratio:
                w[p + "attn.indexer.wq.weight"] = ((lay.index_num_heads * self.index_dim, D), dt)
                w[p + "attn.indexer.weights.weight"] = ((lay.index_num_heads, D), dt)
                compressor(p + "attn.indexer.compressor.", self.index_dim, ratio)
            w[p + "ffn_norm.weight"] = ((D,), dt)
            w[p + "mlp.gate.weight"] = ((inner, D), dt)
            w[p + "mlp.up.weight"] = ((inner, D), dt)
            w[p + "mlp.down.weight"] = ((D, inner), dt)
        w["norm.weight"] = ((D,), dt)
        if not lay.tie_word_embeddings:
            w["lm_head.weight"] = ((V, D), dt)
        return w

    def install_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.params = weights

    # -- rows in pools -----------------------------------------------------------------------------
    def _table(self, spec: CacheGroupSpec, seqs: list[SeqStep]) -> torch.Tensor:
        """[S, M] physical pages of each sequence's logical pages (ring: slots), -1 where none."""
        lists = [s.block_tables.get(spec.name, []) for s in seqs]
        table = torch.full((len(seqs), max(1, *map(len, lists))), -1, dtype=torch.long)
        for i, pages in enumerate(lists):
            table[i, :len(pages)] = torch.tensor(pages, dtype=torch.long)
        return table

    def _locate(self, spec: CacheGroupSpec, table: torch.Tensor, seq: torch.Tensor, row_pos: torch.Tensor,
                ok: torch.Tensor, seqs: list[SeqStep]) -> _Rows:
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
        return _Rows(page.clamp(min=0), row_pos % spec.rows_per_block, ok)

    def _read(self, group: str, layer: int, rows: _Rows, width: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The first `width` values of each row (as dtype, default the model's); zeros where rows.ok is
        False, so stale or NaN contents of pages never leak into the math."""
        spec, pool, dtype = self.model.group(group), self.pools[group], dtype or self.dtype
        raw = pool[self.layer_index[group][layer], rows.page, rows.row]
        if pool.dtype.is_floating_point:
            values = raw[..., :width].to(dtype)
        else:   # int rows with an fp32 scale in the extra bytes
            scale = raw[..., spec.row_width:].contiguous().view(torch.float32)
            values = (raw[..., :width].float() * scale).to(dtype)
        return torch.where(rows.ok[..., None], values, torch.zeros((), dtype=dtype, device=values.device))

    def _write(self, group: str, layer: int, rows: _Rows, values: torch.Tensor) -> None:
        pool = self.pools[group]
        if pool.dtype.is_floating_point:
            data = values.to(pool.dtype)
        else:   # symmetric per-row quantization, fp32 scale stored inline after the row
            qmax = torch.iinfo(pool.dtype).max
            scale = values.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / qmax
            q = (values.float() / scale).round().clamp(-qmax, qmax).to(pool.dtype)
            data = torch.cat([q, scale.view(pool.dtype)], dim=-1)
        pool[self.layer_index[group][layer], rows.page, rows.row, :data.shape[-1]] = data

    # -- step plan ---------------------------------------------------------------------------------
    def _plan(self, batch: StepBatch) -> _StepPlan:
        seqs = batch.seqs
        tif = self.model.layout.tokens_in_flight
        for s in seqs:
            if not 1 <= len(s.token_ids) <= tif or s.start_pos < 0:
                raise ValueError(f"request {s.request_id!r}: a step computes 1..{tif} tokens (tokens_in_flight) "
                                 f"from start_pos >= 0, got {len(s.token_ids)} tokens at {s.start_pos}")
        S = len(seqs)
        lens = torch.tensor([len(s.token_ids) for s in seqs])
        starts = torch.tensor([s.start_pos for s in seqs])
        ends = starts + lens
        Q = int(lens.max())
        qvalid = torch.arange(Q)[None] < lens[:, None]                        # [S, Q]
        qpos = starts[:, None] + torch.arange(Q)[None]                        # [S, Q]
        pad_index = qvalid.flatten().nonzero().squeeze(1)
        tok_seq, pos = pad_index // Q, qpos.flatten()[pad_index]
        all_tokens = torch.ones_like(pos, dtype=torch.bool)
        tables = {spec.name: self._table(spec, seqs) for spec in self.model.cache_groups}
        locate = lambda name, seq, row_pos, ok: self._locate(  # noqa: E731
            self.model.group(name), tables[name], seq, row_pos, ok, seqs)

        # window keys: positions start - W + 1 .. end - 1 of each sequence
        W = self.window
        kpos = starts[:, None] - (W - 1) + torch.arange(Q + W - 1)[None]      # [S, Kw]
        kvalid = (kpos >= 0) & (kpos < ends[:, None])
        dist = qpos[:, :, None] - kpos[:, None, :]
        window_mask = qvalid[:, :, None] & kvalid[:, None, :] & (dist >= 0) & (dist < W)
        seq_of = lambda t: torch.arange(S)[:, None].expand_as(t)  # noqa: E731
        rows = {"ori.write": locate("ori", tok_seq, pos, all_tokens),
                "ori.keys": locate("ori", seq_of(kpos), kpos, kvalid)}
        plan = _StepPlan(S, Q, torch.tensor([t for s in seqs for t in s.token_ids]), pos, pad_index,
                         torch.cumsum(lens, 0)[torch.tensor([s.sample for s in seqs], dtype=torch.bool)] - 1,
                         window_mask)

        for r in (self.csa_ratio, self.hca_ratio):
            states = [self.state[r]] + (["csa_inner_state"] if r == self.csa_ratio else [])
            outs = [self.cmp[r]] + (["idx"] if r == self.csa_ratio else [])
            # runs completing in this step: i in [start // r, end // r)
            first, stop = starts // r, ends // r
            run_seq = torch.repeat_interleave(torch.arange(S), stop - first)
            offsets = torch.cumsum(stop - first, 0) - (stop - first)
            run = first[run_seq] + torch.arange(len(run_seq)) - offsets[run_seq]
            run_tokens = run[:, None] * r + torch.arange(r)[None]             # [J, r]
            plan.run_pos[r] = run * r
            for name in states:
                rows[f"{name}.write"] = locate(name, tok_seq, pos, all_tokens)
                rows[f"{name}.read"] = locate(name, run_seq[:, None].expand_as(run_tokens), run_tokens,
                                              torch.ones_like(run_tokens, dtype=torch.bool))
            # compressed keys: rows 0 .. end // r - 1, visible once their run has ended
            ci = torch.arange(int(stop.max()))[None].expand(S, -1)           # [S, Kc]
            plan.visible[r] = qvalid[:, :, None] & ((ci[:, None, :] + 1) * r - 1 <= qpos[:, :, None])
            for name in outs:
                rows[f"{name}.write"] = locate(name, run_seq, run, torch.ones_like(run, dtype=torch.bool))
                rows[f"{name}.keys"] = locate(name, seq_of(ci), ci, ci < stop[:, None])

        dev = self.device
        plan.rows = {k: v.to(dev) for k, v in rows.items()}
        for name in ("token_ids", "pos", "pad_index", "sample_index", "window_mask"):
            setattr(plan, name, getattr(plan, name).to(dev))
        plan.visible = {r: v.to(dev) for r, v in plan.visible.items()}
        plan.run_pos = {r: v.to(dev) for r, v in plan.run_pos.items()}
        return plan

    # -- model -------------------------------------------------------------------------------------
    def _pad(self, plan: _StepPlan, flat: torch.Tensor) -> torch.Tensor:
        """[N, ...] flat tokens -> [S, Q, ...] padded queries (zeros in the padding)."""
        out = flat.new_zeros((plan.num_seqs * plan.max_q, *flat.shape[1:]))
        out[plan.pad_index] = flat
        return out.view(plan.num_seqs, plan.max_q, *flat.shape[1:])

    def _compress(self, layer: int, prefix: str, ratio: int, width: int, h: torch.Tensor, plan: _StepPlan,
                  state: str, out: str) -> None:
        """Write this step's state rows; compress every run that completed in this step into `out`."""
        w, lay = self.params, self.model.layout
        kv = F.linear(h, w[prefix + "wkv.weight"])
        gate = F.linear(h, w[prefix + "wgate.weight"]) + w[prefix + "ape"][plan.pos % ratio]
        self._write(state, layer, plan.rows[f"{state}.write"], torch.cat([kv.float(), gate.float()], -1))
        read = plan.rows[f"{state}.read"]
        if read.page.numel() == 0:
            return
        rows = self._read(state, layer, read, 2 * width, torch.float32)     # [J, r, 2 * width]
        kv, gate = rows.split(width, dim=-1)
        pooled = (kv * gate.softmax(dim=1)).sum(dim=1).to(self.dtype)
        pooled = rms_norm(pooled, w[prefix + "norm.weight"], lay.rms_norm_eps)
        self._write(out, layer, plan.rows[f"{out}.write"],
                    apply_rope(pooled, plan.run_pos[ratio], rope_dim(width), lay.rope_theta))

    def _index_select(self, layer: int, h: torch.Tensor, plan: _StepPlan) -> _Rows | None:
        """Rows of the top index_topk visible CSA rows of each query, [S, Q, k] (ties: lower row first)."""
        w, lay = self.params, self.model.layout
        p, Hi, di = f"layers.{layer}.attn.indexer.", lay.index_num_heads, self.index_dim
        visible = plan.visible[self.csa_ratio]
        k = min(lay.index_topk, visible.shape[-1])
        if k == 0:
            return None
        q = apply_rope(F.linear(h, w[p + "wq.weight"]).view(-1, Hi, di), plan.pos, rope_dim(di), lay.rope_theta)
        head_w = F.linear(h, w[p + "weights.weight"]) * (Hi * di) ** -0.5
        keys = self._read("idx", layer, plan.rows["idx.keys"], di)          # [S, Kc, di]
        dots = torch.einsum("sqhd,skd->sqhk", self._pad(plan, q), keys).relu()
        score = (dots * self._pad(plan, head_w)[..., None]).sum(dim=2).float() + 0.0   # -0.0 -> 0.0: ties
        score = score.masked_fill(~visible, float("-inf"))
        order = score.sort(dim=-1, descending=True, stable=True).indices[..., :k]          # [S, Q, k]
        where = plan.rows[f"{self.cmp[self.csa_ratio]}.keys"]                           # [S, Kc]
        pick = lambda t: t.gather(1, order.flatten(1)).view_as(order)  # noqa: E731
        return _Rows(pick(where.page), pick(where.row), score.gather(-1, order) > float("-inf"))

    def _attend(self, layer: int, q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """q [S, Q, H, d] over parts of keys = values with masks [S, Q, K]: keys [S, K, d] are shared by a
        sequence's queries, keys [S, Q, K, d] are per query. One softmax over all parts and a sink logit."""
        S, Q, H, d = q.shape
        scores = []
        for keys, mask in parts:
            eq = "sqhd,skd->shqk" if keys.dim() == 3 else "sqhd,sqkd->shqk"
            scores.append(torch.einsum(eq, q, keys).float().div(math.sqrt(d)).masked_fill(~mask[:, None], -math.inf))
        sink = self.params[f"layers.{layer}.attn.sink"].float().view(1, H, 1, 1).expand(S, H, Q, 1)
        probs = torch.cat([*scores, sink], dim=-1).softmax(dim=-1)
        out = torch.zeros_like(q)
        for (keys, _), prob in zip(parts, probs[..., :-1].split([s.shape[-1] for s in scores], dim=-1)):
            eq = "shqk,skd->sqhd" if keys.dim() == 3 else "shqk,sqkd->sqhd"
            out = out + torch.einsum(eq, prob.to(keys.dtype), keys)
        return out

    def _layer(self, layer: int, x: torch.Tensor, plan: _StepPlan) -> torch.Tensor:
        w, lay = self.params, self.model.layout
        p, ratio, d, eps = f"layers.{layer}.", self.ratios[layer], self.head_dim, lay.rms_norm_eps
        h = rms_norm(x, w[p + "attn_norm.weight"], eps)
        q = apply_rope(F.linear(h, w[p + "attn.wq.weight"]).view(-1, lay.num_heads, d), plan.pos,
                       rope_dim(d), lay.rope_theta)
        kv = rms_norm(F.linear(h, w[p + "attn.wkv.weight"]), w[p + "attn.kv_norm.weight"], eps)
        self._write("ori", layer, plan.rows["ori.write"], apply_rope(kv, plan.pos, rope_dim(d), lay.rope_theta))
        parts = [(self._read("ori", layer, plan.rows["ori.keys"], d), plan.window_mask)]
        if ratio:
            cmp = self.cmp[ratio]
            self._compress(layer, p + "attn.compressor.", ratio, d, h, plan, self.state[ratio], cmp)
            if ratio == self.hca_ratio:      # dense over every visible compressed row
                parts.append((self._read(cmp, layer, plan.rows[f"{cmp}.keys"], d), plan.visible[ratio]))
            else:                            # sparse: only the rows the indexer picked, per query
                self._compress(layer, p + "attn.indexer.compressor.", ratio, self.index_dim, h, plan,
                               "csa_inner_state", "idx")
                picked = self._index_select(layer, h, plan)
                if picked is not None:
                    parts.append((self._read(cmp, layer, picked, d), picked.ok))
        out = self._attend(layer, self._pad(plan, q), parts)
        out = out.reshape(plan.num_seqs * plan.max_q, -1)[plan.pad_index]
        x = x + F.linear(out, w[p + "attn.wo.weight"])
        return x + self._mlp(layer, rms_norm(x, w[p + "ffn_norm.weight"], eps))

    def _mlp(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Dense SwiGLU (the place a routed MoE would go)."""
        p = f"layers.{layer}.mlp."
        w = self.params
        return F.linear(F.silu(F.linear(h, w[p + "gate.weight"])) * F.linear(h, w[p + "up.weight"]),
                        w[p + "down.weight"])

    # -- steps -------------------------------------------------------------------------------------
    def execute(self, batch: StepBatch) -> torch.Tensor:
        if not self.params:
            raise RuntimeError("DeepseekV4Runner.execute: no weights; call load_weights() or set_weights() first")
        if not self.pools:
            raise RuntimeError("DeepseekV4Runner.execute: no pools; call allocate_pools() first")
        for name in self.state_groups:
            if batch.new_pages.get(name):
                self.zero_pages(name, batch.new_pages[name])
        if not batch.seqs:
            return torch.empty(0, self.model.layout.vocab_size, dtype=torch.float32, device=self.device)
        plan = self._plan(batch)
        w = self.params
        with torch.no_grad():
            x = w["embed.weight"][plan.token_ids]
            for layer in range(len(self.ratios)):
                x = self._layer(layer, x, plan)
            last = rms_norm(x[plan.sample_index], w["norm.weight"], self.model.layout.rms_norm_eps)
            head = w["embed.weight"] if self.model.layout.tie_word_embeddings else w["lm_head.weight"]
            return F.linear(last, head).float()

    def profile_batch(self, max_num_tokens: int, max_num_seqs: int) -> StepBatch:
        """The largest step: chunks of up to tokens_in_flight tokens ending at the longest sequence
        length, so every key set is at its largest; all pages are scratch pages (contents don't matter)."""
        if not self.pools or self.num_scratch < 1:
            raise RuntimeError("profile_batch needs pools with at least one scratch page (allocate_pools first)")
        tif = self.model.layout.tokens_in_flight
        max_len = max(s.max_blocks_per_seq * s.tokens_per_page for s in self.model.cache_groups if not s.is_ring)
        seqs = []
        for j, n in enumerate(self.profile_lengths(max_num_tokens, max_num_seqs, tif)):
            tables = {s.name: [self.scratch_page(s.name, j % self.num_scratch)] * s.max_blocks_per_seq
                      for s in self.model.cache_groups}
            seqs.append(SeqStep(f"profile-{j}", [0] * n, max_len - n, tables))
        return StepBatch(seqs)
