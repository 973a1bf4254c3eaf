"""Qwen3 over one paged KV group, in plain torch; Hugging Face parameter names, so HF checkpoints load as is.

Pool "kv": [pages, num_layers, block_size, 2 * kv_heads * head_dim], each row K then V of one token.
A step flattens every sequence's tokens into one [N, hidden] batch for the projections and the MLP;
attention then runs as
- one batched decode path for all 1-token sequences: K/V gathered from the pool through flat row
  indices (one embedding lookup per layer), masked SDPA with the query heads of a KV head as the
  query axis (GQA without repeating K/V);
- per-sequence prefill: causal SDPA on the chunk's own K/V when it starts at 0, else over K/V gathered
  from the pool (cached prefix + chunk) with an offset causal mask.
Row indices come from the pool tensor's strides at each step, so no pool size is baked in anywhere.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from appliance.config.runtime import ModelSpec
from appliance.kv_cache_spec import CacheGroupSpec
from npu.runner import ModelRunner
from npu.step import SeqStep, StepBatch
from npu.weights import CheckpointError, load_state_dict, random_state_dict

log = logging.getLogger("npu.qwen3")

KV = "kv"


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor          # q_proj, k_proj, v_proj stacked: [(heads + 2 kv_heads) * head_dim, hidden]
    qk_norm: torch.Tensor      # [heads + kv_heads, head_dim]: q_norm for q heads, k_norm for k heads
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor      # gate_proj, up_proj stacked: [2 * intermediate, hidden]
    down: torch.Tensor


def check_kv_group(model: ModelSpec) -> CacheGroupSpec:
    """Qwen3 needs exactly one full-history group over all layers holding K and V of every kv head."""
    lay = model.layout
    if len(model.cache_groups) != 1 or model.cache_groups[0].name != KV:
        raise ValueError(f"model {model.name!r} (arch qwen3) needs exactly one cache group named {KV!r}; "
                         f"model.cache_groups has {[g.name for g in model.cache_groups]}")
    spec = model.cache_groups[0]
    width = 2 * lay.num_kv_heads * lay.head_dim
    problems = []
    if spec.layer_ids != tuple(range(lay.num_layers)):
        problems.append("layers must be 'all'")
    if spec.history != "full" or spec.tokens_per_row != 1 or spec.rows_per_block != lay.block_size:
        problems.append(f"history must be full with rows_per_block = block_size ({lay.block_size}) and tokens_per_row 1")
    if spec.row_width != width or spec.row_extra_bytes:
        problems.append(f"row.width must be 2 x num_kv_heads x head_dim = {width} with no extra bytes")
    if problems:
        raise ValueError(f"model.cache_groups[0] ({KV}) of {model.name!r}: " + "; ".join(problems))
    return spec


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask -> 0 / -inf; SDPA on CPU is faster with an additive mask than a boolean one."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class Qwen3Runner(ModelRunner):
    """Qwen3ForCausalLM (dense) on paged KV; logits of the last token of each sampled sequence."""

    def __init__(self, model: ModelSpec, device: torch.device | str):
        super().__init__(model, torch.device(device))
        lay = model.layout
        self.spec = check_kv_group(model)
        self.dtype: torch.dtype = getattr(torch, lay.dtype)
        self.hidden = lay.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = lay.num_heads, lay.num_kv_heads, lay.head_dim
        self.group_size = self.num_heads // self.num_kv_heads
        self.block_size = lay.block_size
        self.eps = lay.rms_norm_eps
        self.layers: list[_Layer] = []
        self.embed: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        self._inv_freq = 1.0 / (lay.rope_theta ** (
            torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(self.device, torch.float32) / self.head_dim))
        self._cos = torch.empty(0, self.head_dim, device=self.device, dtype=self.dtype)
        self._sin = self._cos

    # -- weights -----------------------------------------------------------------------------------
    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        lay, dt = self.model.layout, self.dtype
        h, hd, inter = lay.hidden_size, lay.head_dim, lay.intermediate_size
        q, kv = lay.num_heads * hd, lay.num_kv_heads * hd
        out = {"model.embed_tokens.weight": ((lay.vocab_size, h), dt), "model.norm.weight": ((h,), dt)}
        if not lay.tie_word_embeddings:
            out["lm_head.weight"] = ((lay.vocab_size, h), dt)
        for i in range(lay.num_layers):
            p = f"model.layers.{i}."
            out.update({
                p + "input_layernorm.weight": ((h,), dt),
                p + "self_attn.q_proj.weight": ((q, h), dt),
                p + "self_attn.k_proj.weight": ((kv, h), dt),
                p + "self_attn.v_proj.weight": ((kv, h), dt),
                p + "self_attn.o_proj.weight": ((h, q), dt),
                p + "self_attn.q_norm.weight": ((hd,), dt),
                p + "self_attn.k_norm.weight": ((hd,), dt),
                p + "post_attention_layernorm.weight": ((h,), dt),
                p + "mlp.gate_proj.weight": ((inter, h), dt),
                p + "mlp.up_proj.weight": ((inter, h), dt),
                p + "mlp.down_proj.weight": ((h, inter), dt),
            })
        return out

    def load_weights(self) -> None:
        expected = self.expected_weights()
        if self.model.weights == "random":
            log.info("%s: seeded random weights (seed %d)", self.model.name, self.model.weights_seed)
            state = random_state_dict(expected, self.model.weights_seed, self.device)
        else:
            from npu.checkpoint import check_checkpoint_config
            check_checkpoint_config(self.model.weights, self.model)
            state = load_state_dict(self.model.weights, expected, self.device)
        self.set_weights(state)

    def set_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Install a state dict with exactly expected_weights(); q/k/v and gate/up are fused for speed."""
        expected = self.expected_weights()
        if set(state) != set(expected):
            raise CheckpointError(f"state dict mismatch: missing {sorted(set(expected) - set(state))}, "
                                  f"unexpected {sorted(set(state) - set(expected))}")
        w = {n: t.to(device=self.device, dtype=self.dtype) for n, t in state.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = self.embed if self.model.layout.tie_word_embeddings else w["lm_head.weight"]
        self.layers = []
        for i in range(self.model.layout.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(_Layer(
                input_norm=w[p + "input_layernorm.weight"],
                qkv=torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]),
                qk_norm=torch.cat([w[a + "q_norm.weight"].expand(self.num_heads, -1),
                                   w[a + "k_norm.weight"].expand(self.num_kv_heads, -1)]),
                o=w[a + "o_proj.weight"],
                post_norm=w[p + "post_attention_layernorm.weight"],
                gate_up=torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]),
                down=w[m + "down_proj.weight"]))

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor the runner holds for weights (fused ones included)."""
        out = [t for t in (self.embed, self.norm, self.lm_head) if t is not None]
        for layer in self.layers:
            out += [layer.input_norm, layer.qkv, layer.qk_norm, layer.o,
                    layer.post_norm, layer.gate_up, layer.down]
        return out

    # -- rope --------------------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        if max_pos >= self._cos.shape[0]:
            n = max(2 * self._cos.shape[0], max_pos + 1, 256)
            freqs = torch.outer(torch.arange(n, device=self.device, dtype=torch.float32), self._inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            # rotate_half(x) * sin == swap_halves(x) * (-sin | sin): one flip instead of slices, neg and cat
            signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
            self._cos, self._sin = emb.cos().to(self.dtype), signed.to(self.dtype)
        return self._cos[positions], self._sin[positions]

    # -- step --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        if self.embed is None:
            raise RuntimeError("Qwen3Runner.execute before load_weights()/set_weights()")
        if KV not in self.pools:
            raise RuntimeError("Qwen3Runner.execute before allocate_pools()")
        seqs = batch.seqs
        if not seqs:
            return torch.empty(0, self.model.layout.vocab_size, dtype=torch.float32, device=self.device)
        pool = self.pools[KV]
        if not pool.is_contiguous():
            raise ValueError("the kv pool must be contiguous")
        width = pool.shape[-1]
        rows = pool.view(-1, width)
        page_stride, layer_stride, row_stride = (s // width for s in pool.stride()[:3])
        meta = _StepMeta.build(seqs, self.block_size, pool.shape[0], self.device)
        positions = meta.positions
        base = meta.page_of_token * page_stride + (positions % self.block_size) * row_stride
        cos, sin = self._rope(positions, meta.max_pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

        dec = meta.decode
        if dec is not None:
            ar = torch.arange(dec.max_ctx, device=self.device)
            ctx_pages = dec.tables[:, ar // self.block_size]
            dec_base = (ctx_pages * page_stride + (ar % self.block_size) * row_stride).reshape(-1)
            dec_mask = _additive_mask((ar < dec.ctx[:, None]).view(len(dec.ctx), 1, 1, dec.max_ctx), self.dtype)
        for p in meta.prefills:
            if p.start > 0:  # a later chunk (or a prefix-cache hit): attend over the cached rows too
                ar = torch.arange(p.ctx, device=self.device)
                p.ctx_rows = p.table[ar // self.block_size] * page_stride + (ar % self.block_size) * row_stride
                p.mask = _additive_mask(p.causal_mask(self.device), self.dtype)

        n, nh, kvh, hd = meta.num_tokens, self.num_heads, self.num_kv_heads, self.head_dim
        pure_decode = dec is not None and not meta.prefills      # decode tokens are then tokens 0..n-1
        x = F.embedding(meta.tokens, self.embed)
        for li, layer in enumerate(self.layers):
            r = F.rms_norm(x, (self.hidden,), layer.input_norm, self.eps)
            qkv = F.linear(r, layer.qkv)
            # q and k heads are normalised and rotated together: [n, nh + kvh, hd]
            qk = F.rms_norm(qkv[:, :(nh + kvh) * hd].view(n, nh + kvh, hd), (hd,), eps=self.eps) * layer.qk_norm
            qk = qk * cos + qk.view(n, nh + kvh, 2, hd // 2).flip(2).view(n, nh + kvh, hd) * sin
            q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, (nh + kvh) * hd:]
            off = li * layer_stride
            rows.index_copy_(0, base + off, torch.cat([k.reshape(n, kvh * hd), v], dim=-1).to(rows.dtype))
            attn = None if pure_decode else torch.empty(n, nh, hd, device=self.device, dtype=self.dtype)
            if dec is not None:
                b = len(dec.ctx)
                kv_rows = F.embedding(dec_base + off, rows).view(b, dec.max_ctx, 2, kvh, hd).to(self.dtype)
                kd, vd = kv_rows.permute(2, 0, 3, 1, 4).unbind(0)         # [b, kvh, ctx, hd] each
                qd = q if pure_decode else q.index_select(0, dec.token_index)
                od = F.scaled_dot_product_attention(qd.view(b, kvh, self.group_size, hd), kd, vd, attn_mask=dec_mask)
                if pure_decode:
                    attn = od.reshape(n, nh, hd)
                else:
                    attn.index_copy_(0, dec.token_index, od.reshape(b, nh, hd))
            for p in meta.prefills:
                qp = q[p.first:p.first + p.length].transpose(0, 1).unsqueeze(0)   # [1, nh, len, hd]
                if p.ctx_rows is None:
                    kp = k[p.first:p.first + p.length].transpose(0, 1).unsqueeze(0)
                    vp = v[p.first:p.first + p.length].view(p.length, kvh, hd).transpose(0, 1).unsqueeze(0)
                    op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
                else:
                    kv_rows = F.embedding(p.ctx_rows + off, rows).view(p.ctx, 2, kvh, hd).to(self.dtype)
                    kp, vp = kv_rows.permute(1, 2, 0, 3).unsqueeze(1).unbind(0)   # [1, kvh, ctx, hd] each
                    op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, enable_gqa=True)
                attn[p.first:p.first + p.length] = op[0].transpose(0, 1)
            x = x + F.linear(attn.view(n, nh * hd), layer.o)
            r = F.rms_norm(x, (self.hidden,), layer.post_norm, self.eps)
            gate, up = F.linear(r, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        if meta.sample_index.numel() == 0:
            return torch.empty(0, self.model.layout.vocab_size, dtype=torch.float32, device=self.device)
        last = F.rms_norm(x.index_select(0, meta.sample_index), (self.hidden,), self.norm, self.eps)
        return F.linear(last, self.lm_head).float()

    # -- profiling ---------------------------------------------------------------------------------
    def profile_batch(self, max_num_tokens: int, max_num_seqs: int) -> StepBatch:
        """max_num_tokens tokens over min(max_num_seqs, max_num_tokens) sequences, each at the end of a
        full-length context (so attention reads the longest history), every page a scratch page."""
        if self.num_scratch < 1:
            raise RuntimeError("profile_batch needs scratch pages: allocate_pools(..., num_scratch >= 1) first")
        max_ctx = self.spec.max_blocks_per_seq * self.block_size
        num_seqs = max(1, min(max_num_seqs, max_num_tokens))
        total = min(max_num_tokens, num_seqs * max_ctx)
        pages = self.spec.max_blocks_per_seq
        seqs = []
        for i in range(num_seqs):
            length = total // num_seqs + (1 if i < total % num_seqs else 0)
            table = [self.scratch_page(KV, (i + j) % self.num_scratch) for j in range(pages)]
            seqs.append(SeqStep(f"profile-{i}", [0] * length, max_ctx - length, {KV: table}, sample=True))
        return StepBatch(seqs)


@dataclass
class _Prefill:
    first: int                 # index of its first token in the flat batch
    length: int
    start: int                 # tokens already cached
    table: torch.Tensor        # [pages] physical page ids
    ctx_rows: torch.Tensor | None = None   # start > 0: pool row of every context token (layer 0)
    mask: torch.Tensor | None = None       # start > 0: [length, ctx] offset causal mask

    @property
    def ctx(self) -> int:
        return self.start + self.length

    def causal_mask(self, device: torch.device) -> torch.Tensor:
        """[length, ctx]: token i of the chunk sees cached tokens and chunk tokens up to itself."""
        q_pos = torch.arange(self.start, self.ctx, device=device)
        return torch.arange(self.ctx, device=device)[None, :] <= q_pos[:, None]


@dataclass
class _Decode:
    token_index: torch.Tensor  # [b] flat index of each decode token
    tables: torch.Tensor       # [b, max pages] page ids, padded with 0 (masked out)
    ctx: torch.Tensor          # [b] context length including this token
    max_ctx: int


@dataclass
class _StepMeta:
    """Flat token batch and per-sequence index data for one step, built once and shared by all layers."""

    tokens: torch.Tensor
    positions: torch.Tensor
    page_of_token: torch.Tensor
    sample_index: torch.Tensor
    num_tokens: int
    max_pos: int
    decode: _Decode | None
    prefills: list[_Prefill]

    @staticmethod
    def build(seqs: list[SeqStep], block_size: int, num_pages: int, device: torch.device) -> "_StepMeta":
        tokens: list[int] = []
        positions: list[int] = []
        pages: list[int] = []
        sample: list[int] = []
        dec_tok: list[int] = []
        dec_tables: list[list[int]] = []
        dec_ctx: list[int] = []
        prefills: list[_Prefill] = []
        for s in seqs:
            n = len(s.token_ids)
            if n == 0:
                raise ValueError(f"request {s.request_id}: a step needs at least one token")
            table = s.block_tables.get(KV)
            end = s.start_pos + n
            if table is None or len(table) * block_size < end:
                raise ValueError(f"request {s.request_id}: block table {KV!r} covers "
                                 f"{0 if table is None else len(table) * block_size} tokens, the step needs {end}")
            if any(not 0 <= p < num_pages for p in table[: math.ceil(end / block_size)]):
                raise ValueError(f"request {s.request_id}: page id out of range [0, {num_pages}) in {table}")
            first = len(tokens)
            tokens.extend(s.token_ids)
            positions.extend(range(s.start_pos, end))
            pages.extend(table[p // block_size] for p in range(s.start_pos, end))
            if s.sample:
                sample.append(first + n - 1)
            if n == 1:
                dec_tok.append(first)
                dec_tables.append(table[: math.ceil(end / block_size)])
                dec_ctx.append(end)
            else:
                prefills.append(_Prefill(first, n, s.start_pos, torch.tensor(table, dtype=torch.long, device=device)))
        decode = None
        if dec_tok:
            width = max(len(t) for t in dec_tables)
            padded = [t + [0] * (width - len(t)) for t in dec_tables]
            decode = _Decode(torch.tensor(dec_tok, dtype=torch.long, device=device),
                             torch.tensor(padded, dtype=torch.long, device=device),
                             torch.tensor(dec_ctx, dtype=torch.long, device=device), max(dec_ctx))
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return _StepMeta(as_long(tokens), as_long(positions), as_long(pages), as_long(sample), len(tokens),
                         max(positions), decode, prefills)
