"""Qwen3 over one paged KV group, in plain torch; Hugging Face parameter names, so HF checkpoints load as is.

Pool "kv": [num_layers, pages, block_size, 2 * kv_heads * head_dim]. A page holds two planes: the K rows
of its block_size tokens, then their V rows ([2, block_size, kv_heads * head_dim]), so one layer's pool
viewed as [2 * pages, block_size, kv_heads * head_dim] is a contiguous paged cache with page p's K at
block 2p and its V at 2p + 1: what a fused paged-attention kernel reads in place (npu.fused_attention).
A step flattens every sequence's tokens into one [N, hidden] batch for the projections and the MLP:
decode tokens first, then prefill chunks. Everything shared by the layers (token rows in the pool,
rope cos/sin, masks, page lists) is built once per step from one host tensor (_StepMeta). Norms, q/k
norm + RoPE and SiLU-and-mul go through npu.fused_norms (one C++ pass each on CPU, torch ops elsewhere).
Attention, on an NPU where the fused kernel applies: one call per layer for every row
(npu.fused_attention). Elsewhere, SDPA with bool masks (or is_causal), which accelerator backends keep on
their fused kernels:
- decode rows, batched: on CPU, a C++ kernel reads each row's pages in place (npu.paged_attention_cpu); on a GPU,
  a Triton kernel does (npu.paged_attention_triton), with the same launches every step. Otherwise, per layer the K and V planes of their pages are gathered from the layer's contiguous pool
  (one index_select into a reused buffer), then one SDPA with a kv head's query heads as the query axis
  (GQA without repeating K/V), masked only where contexts differ. Rows of very different lengths are
  split into a few buckets by context length, so short contexts are not padded to the longest one;
- chunks from position 0: causal SDPA on their own K/V, one call for all chunks of equal length;
- chunks after cached tokens (later chunks, prefix-cache hits): SDPA over their gathered pages with an
  offset causal mask, one call for chunks of the same start and length (up to GROUP_GATHER_TOKENS).
Row indices come from the pool tensor's strides at each step, so no pool size is baked in anywhere.
"""

from __future__ import annotations

import array
import itertools
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from appliance.core.archs.qwen3.layout import KV
from appliance.core.archs.qwen3.tensor_parallel import held_slices, parameters
from appliance.core.config import ModelSpec
from appliance.core.parallel import RankPlace, TensorSlice, split
from npu.fused_attention import FusedPagedAttention, FusedStep, fused_attention_op
from npu.fused_norms import layer_norms
from npu.graphs import DecodeGraphs, batch_buckets
from npu.linear import Projection
from npu.paged_attention_cpu import PagedDecodeAttention, paged_decode_attention
from npu.paged_attention_triton import TritonDecodeAttention, triton_decode_attention
from npu.runner import ModelRunner
from npu.step import SeqStep, StepBatch, logits_offsets

log = logging.getLogger("npu.qwen3")


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Projection            # q_proj, k_proj, v_proj stacked: [(heads + 2 kv_heads) * head_dim, hidden]
    qk_norm: torch.Tensor      # [heads + kv_heads, head_dim]: q_norm for q heads, k_norm for k heads
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection        # gate_proj, up_proj stacked: [2 * intermediate, hidden]
    down: Projection


class Qwen3Runner(ModelRunner):
    """Qwen3ForCausalLM (dense) on paged KV; logits of the last token of each sampled sequence."""

    def __init__(self, model: ModelSpec, device: torch.device | str, place: RankPlace | None = None):
        super().__init__(model, torch.device(device), place)
        lay = model.layout
        self.dtype: torch.dtype = getattr(torch, lay.dtype)
        self.hidden = lay.hidden_size
        # Tensor parallel: this rank's heads and kv heads (appliance.core.archs.qwen3.parameters says how every
        # weight is divided); the vocab-parallel head's column widths per rank, None when every rank has all.
        tp = self.place.tensor
        self.num_heads, self.num_kv_heads, self.head_dim = lay.num_heads // tp, lay.num_kv_heads // tp, lay.head_dim
        head_divided = tp > 1 and not lay.tie_word_embeddings
        self.vocab_widths = [b - a for a, b in (split(lay.vocab_size, tp, i) for i in range(tp))] \
            if head_divided else None
        self.group_size = self.num_heads // self.num_kv_heads
        self.block_size = lay.block_size
        self.eps = lay.rms_norm_eps
        self.layers: list[_Layer] = []
        self.embed: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.lm_head: Projection | None = None
        self._inv_freq = 1.0 / (lay.rope_theta ** (
            torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(self.device, torch.float32) / self.head_dim))
        self._rope_table = torch.empty(0, 2, self.head_dim, device=self.device, dtype=self.dtype)
        self._kv_buf = torch.empty(0, device=self.device)     # reused by _gather
        self._cols = torch.arange(256, device=self.device)    # sliced by _arange
        self._parity = torch.arange(2, device=self.device)[:, None]   # K plane (0) / V plane (1) of a page
        self._kv_offsets: torch.Tensor | None = None          # see _row_offsets
        op = fused_attention_op(self.device, self.dtype, self.block_size)
        self.fused_attention = None if op is None else FusedPagedAttention(
            op, self.num_heads, self.num_kv_heads, self.head_dim, self.block_size, self.device)
        # Decode rows read their pages in place: the C++ kernel on a CPU, the Triton kernel on a GPU; None: gather +
        # SDPA (and on an NPU the fused kernel takes every row).
        self.paged_decode: PagedDecodeAttention | TritonDecodeAttention | None = None
        if self.fused_attention is None:
            self.paged_decode = (paged_decode_attention if self.device.type == "cpu" else triton_decode_attention)(
                self.device, self.dtype, self.num_heads, self.num_kv_heads, self.head_dim, self.block_size)
        self.norms = layer_norms(self.device, self.dtype, self.eps)      # fused CPU kernels or torch ops
        self.graphs: DecodeGraphs | None = None                # decode steps through static buffers (capture_graphs)
        self.graph_pages = 0                                   # page-table width of those buffers: max_model_len
        # The pool starts uninitialized; gather + SDPA reads rows past a row's position and padding pages under a
        # mask, which does not stop a NaN there (NaN x 0 = NaN): each page is zeroed when a step first announces it.
        self.zero_on_first_use = frozenset({KV})

    # -- weights -----------------------------------------------------------------------------------
    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (shape, self.dtype) for name, shape, _ in parameters(self.model.layout)}

    def held_weights(self) -> dict[str, TensorSlice | None]:
        return held_slices(self.model.layout, self.place)

    def install_weights(self, w: dict[str, torch.Tensor]) -> None:
        """q/k/v and gate/up are fused for speed."""
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = Projection.of(self.embed if self.model.layout.tie_word_embeddings else w["lm_head.weight"])
        self.layers = []
        for i in range(self.model.layout.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(_Layer(
                input_norm=w[p + "input_layernorm.weight"],
                qkv=Projection.of(torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])),
                qk_norm=torch.cat([w[a + "q_norm.weight"].expand(self.num_heads, -1),
                                   w[a + "k_norm.weight"].expand(self.num_kv_heads, -1)]),
                o=Projection.of(w[a + "o_proj.weight"]),
                post_norm=w[p + "post_attention_layernorm.weight"],
                gate_up=Projection.of(torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]])),
                down=Projection.of(w[m + "down_proj.weight"])))

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor the runner holds for weights (fused and packed ones included)."""
        out = [t for t in (self.embed, self.norm) if t is not None] + ([] if self.lm_head is None else self.lm_head.tensors())
        for layer in self.layers:
            out += [layer.input_norm, layer.qk_norm, layer.post_norm]
            for proj in (layer.qkv, layer.o, layer.gate_up, layer.down):
                out += proj.tensors()
        return out

    # -- pools -------------------------------------------------------------------------------------
    def free_pools(self) -> None:
        self.release_graphs()                                 # they read the pools at their addresses
        super().free_pools()
        self._kv_buf = torch.empty(0, device=self.device)     # the gather workspace goes with the pools
        self._kv_offsets = None

    # -- rope --------------------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, max_pos: int) -> torch.Tensor:
        """[n, 2, head_dim]: cos, then the signed sin, of each position; one lookup per step for all layers."""
        if max_pos >= self._rope_table.shape[0]:
            n = max(2 * self._rope_table.shape[0], max_pos + 1, 256)
            freqs = torch.outer(torch.arange(n, device=self.device, dtype=torch.float32), self._inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            # rotate_half(x) * sin == swap_halves(x) * (-sin | sin): one flip instead of slices, neg and cat
            signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
            self._rope_table = torch.stack((emb.cos(), signed), dim=1).to(self.dtype)   # [n, 2, head_dim]
        return self._rope_table.index_select(0, positions)

    def _row_offsets(self, pool: torch.Tensor) -> torch.Tensor:
        """[layers, 1, 2]: what to add to a token's K-plane row in layer 0 for its K and V rows in every layer
        (V is block_size rows further, in the V plane). From the pool's strides, once per pool."""
        if self._kv_offsets is None:
            layer_stride = pool.stride(0) // (self.num_kv_heads * self.head_dim)
            layers = torch.arange(len(self.layers), device=self.device)[:, None, None] * layer_stride
            self._kv_offsets = layers + self._parity.view(1, 1, 2) * self.block_size
        return self._kv_offsets

    def _arange(self, n: int) -> torch.Tensor:
        """0..n-1 on the device, a slice of a cached tensor (masks and row offsets are built from it)."""
        if self._cols.numel() < n:
            self._cols = torch.arange(max(n, 2 * self._cols.numel()), device=self.device)
        return self._cols[:n]

    def _planes(self, pool: torch.Tensor, layer: int) -> torch.Tensor:
        """One layer's pool as [2 * pages, block_size, kv_heads * head_dim]: contiguous storage, no copy."""
        return pool[layer].view(-1, self.block_size, self.num_kv_heads * self.head_dim)

    def _gather(self, pool: torch.Tensor, layer: int, planes: torch.Tensor, seqs: int) -> torch.Tensor:
        """K and V of some pages for one layer: [2 (K, V), seqs, pages per seq * block_size, kv_heads, head_dim].
        `planes` lists the pages' K planes, then their V planes (2p, then 2p + 1); they are copied from the
        layer's contiguous storage into a buffer reused across layers and steps (a fresh multi-MB tensor per
        layer costs more in page faults on CPU than the copy)."""
        src = self._planes(pool, layer)
        numel = planes.numel() * src.shape[1] * src.shape[2]
        if self._kv_buf.numel() < numel or self._kv_buf.dtype != src.dtype:
            self._kv_buf = torch.empty(numel, dtype=src.dtype, device=self.device)
        out = torch.index_select(src, 0, planes, out=self._kv_buf[:numel].view(planes.numel(), *src.shape[1:]))
        out = out.view(2, seqs, -1, self.num_kv_heads, self.head_dim)
        return out if out.dtype == self.dtype else out.to(self.dtype)

    # -- step --------------------------------------------------------------------------------------
    def prepare(self, batch: StepBatch) -> "_StepLayout | None":
        """The host half of a step: every index of the flat batch in one host tensor (None: nothing to run)."""
        if self.embed is None:
            raise RuntimeError("Qwen3Runner.execute before load_weights()/set_weights()")
        if KV not in self.pools:
            raise RuntimeError("Qwen3Runner.execute before allocate_pools()")
        if self.place.tensor > 1 and self.tensor_parallel is None:
            raise RuntimeError("Qwen3Runner.execute on a tensor-parallel rank before use_collectives()")
        if not batch.seqs:
            return None
        pool = self.pools[KV]
        if not pool.is_contiguous():
            raise ValueError("the kv pool must be contiguous")
        half = self.num_kv_heads * self.head_dim       # one token's K (or V): a row of a plane
        if self.graphs is not None and _decode_only(batch) and self.graphs.bucket(len(batch.seqs)) is not None:
            return _GraphStep.build(batch.seqs, self.block_size, pool.shape[1], pool.stride(1) // half,
                                    self.graphs.bucket(len(batch.seqs)), self.graph_pages,  # type: ignore[arg-type]
                                    self.scratch_page(KV, 0))
        return _StepLayout.build(batch.seqs, self.block_size, pool.shape[1], pool.stride(1) // half,
                                 fused=self.fused_attention is not None, paged=self._paged(pool))

    def _paged(self, pool: torch.Tensor) -> bool:
        return self.paged_decode is not None and pool.dtype == self.dtype

    @torch.inference_mode()
    def forward(self, layout: "_StepLayout | _GraphStep | None") -> torch.Tensor:
        """The device half: uploads the step's indices, then the layers (or replays the decode graph of its batch
        bucket, npu.graphs); no host sync."""
        if layout is None:
            return torch.empty(0, self.model.layout.vocab_size, dtype=self.dtype, device=self.device)
        if isinstance(layout, _GraphStep):
            assert self.graphs is not None
            return self.graphs.replay(layout.rows, lambda inputs: inputs.buffer.copy_(layout.host, non_blocking=True))
        return self._run(_StepMeta.upload(layout, self._arange, self._parity, self.device))

    def _run(self, meta: "_StepMeta") -> torch.Tensor:
        """The layers over one step's device metadata: the logits of its sampled rows."""
        pool = self.pools[KV]
        rows = pool.view(-1, self.num_kv_heads * self.head_dim)
        kv_rows = meta.write_rows[:, None] + self._row_offsets(pool)   # [layers, tokens, 2]: K row, V row
        rope = self._rope(meta.positions, meta.max_pos)

        n, nh, kvh, hd = meta.num_tokens, self.num_heads, self.num_kv_heads, self.head_dim
        half = kvh * hd
        norms = self.norms
        x = F.embedding(meta.tokens, self.embed)         # the residual stream, updated in place from here
        h = norms.rms_norm(x, self.layers[0].input_norm)
        for li, layer in enumerate(self.layers):
            qkv = layer.qkv(h)
            norms.qk_norm_rope_(qkv, nh + kvh, layer.qk_norm, rope)   # q and k heads in place: qkv is q | k | v
            rows.index_put_((kv_rows[li],), qkv[:, nh * hd:].unflatten(1, (2, half)).to(rows.dtype))
            q = qkv[:, :nh * hd].view(n, nh, hd)
            if self.fused_attention is not None and meta.fused is not None:
                attn = self.fused_attention(q, self._planes(pool, li), meta.fused)
            else:
                attn = self._attend(pool, li, qkv, q, meta)
            h = norms.add_rms_norm_(x, self._summed(layer.o(attn.reshape(n, nh * hd))), layer.post_norm)
            mlp = self._summed(layer.down(norms.silu_and_mul(layer.gate_up(h))))
            if li + 1 < len(self.layers):
                h = norms.add_rms_norm_(x, mlp, self.layers[li + 1].input_norm)
        # the last residual add and the final norm, for the sampled rows only
        if meta.sample_index is not None:
            x, mlp = x.index_select(0, meta.sample_index), mlp.index_select(0, meta.sample_index)
        if x.shape[0] == 0:
            return torch.empty(0, self.model.layout.vocab_size, dtype=self.dtype, device=self.device)
        logits = self.lm_head(norms.add_rms_norm_(x, mlp, self.norm))
        if self.vocab_widths is not None:                # vocab-parallel head: every rank gets all the columns
            logits = self.tensor_parallel.all_gather_columns(logits, self.vocab_widths)
        return logits       # in the model's dtype: the sampler widens only what it reads (npu.sampler)

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: this rank's partial product, summed over the tensor-parallel
        ranks (one all-reduce; nothing to sum in a one-process deployment)."""
        return partial if self.tensor_parallel is None else self.tensor_parallel.all_reduce(partial)

    # -- decode graphs (npu/graphs.py) -----------------------------------------------------------------
    def capture_graphs(self, max_batch: int, record: bool, max_model_len: int) -> str | None:
        """Decode steps of up to max_batch rows through static buffers, one per batch bucket, recorded as graphs
        where the device has them and `record` is set (else replayed eagerly: the same path, for CPU tests).
        Needs the paged decode kernel (its launches do not depend on the contexts' lengths) and one rank (no
        collective inside a graph yet). Returns what was set up, for the startup report, or None."""
        self.release_graphs()
        if self.paged_decode is None or KV not in self.pools or not self._paged(self.pools[KV]) or self.place.world > 1:
            return None
        self.graph_pages = -(-max_model_len // self.block_size)
        self._rope(torch.zeros(1, dtype=torch.long, device=self.device), max_model_len)   # sized once: no re-allocation
        self.graphs = DecodeGraphs(self.device, batch_buckets(max_batch), self._static_inputs, self._run_static, record)
        with torch.inference_mode():
            self.graphs.capture()
        kind = "recorded as device graphs" if self.graphs.recorded else "replayed eagerly (no device graphs)"
        return f"decode steps of 1..{max_batch} rows through static buffers, buckets {list(self.graphs.buckets)}, {kind}"

    def release_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None

    def _static_inputs(self, batch: int) -> "_StaticDecode":
        return _StaticDecode.empty(batch, self.graph_pages, self.device)

    def _run_static(self, inputs: "_StaticDecode") -> torch.Tensor:
        """The layers over a bucket's static inputs: every row a decode row through the paged kernel."""
        n = inputs.tokens.shape[0]
        meta = _StepMeta(inputs.tokens, inputs.positions, inputs.write_rows, None, n, self._rope_table.shape[0] - 1,
                         [_Decode(0, n, None, self.graph_pages * self.block_size, None, inputs.pages, inputs.lengths)],
                         [], None)
        return self._run(meta)

    def _attend(self, pool: torch.Tensor, li: int, qkv: torch.Tensor, q: torch.Tensor, meta: _StepMeta) -> torch.Tensor:
        """Attention of every row of the flat batch over layer li with SDPA: [n, heads, head_dim]."""
        nh, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        parts = []                                     # attention output of rows 0..n-1, in order
        for d in meta.decodes:                         # decode rows come first in the flat batch
            if d.lengths is not None:                  # the CPU kernel reads the pages in place
                parts.append(self.paged_decode(q[d.first:d.first + d.count], self._planes(pool, li), d.pages,
                                               d.lengths, checked_longest=d.ctx))   # page ids checked in build
                continue
            kd, vd = self._gather(pool, li, d.planes, d.count)[:, :, :d.ctx].transpose(2, 3)  # [count, kvh, ctx, hd]
            qd = q[d.first:d.first + d.count].view(d.count, kvh, self.group_size, hd)  # GQA: heads as queries
            # reshape, not view: the output's memory layout is the kernel's choice (CUDA's fused kernels return
            # [count, group, kvh, hd] memory seen as [count, kvh, group, hd])
            parts.append(F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask).reshape(d.count, nh, hd))
        for p in meta.prefills:
            chunk = qkv[p.first:p.first + p.count * p.length].view(p.count, p.length, nh + 2 * kvh, hd)
            qp = chunk[:, :, :nh].transpose(1, 2)      # [count, nh, len, hd]
            if p.planes is None:                       # from position 0: the chunks' own K/V are the context
                kp, vp = chunk[:, :, nh:].view(p.count, p.length, 2, kvh, hd).permute(2, 0, 3, 1, 4)
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            else:
                kp, vp = self._gather(pool, li, p.planes, p.count)[:, :, :p.ctx].transpose(2, 3)  # [count, kvh, ctx, hd]
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, enable_gqa=True)
            parts.append(op.transpose(1, 2).reshape(p.count * p.length, nh, hd))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class _Prefill:
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


@dataclass
class _Decode:
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


def _causal_mask(cols: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[len(positions), len(cols)] bool mask, True where col <= position. Bool, not an additive float mask:
    torch_npu's SDPA keeps its fused kernel only for a bool mask (or none), and the mask is 1/4 the bytes."""
    return cols[None, :] <= positions[:, None]


@dataclass
class _StepLayout:
    """The host half of a step's metadata (ModelRunner.prepare): the flat batch's integers in one host tensor
    (tokens, positions, write rows, pages, sampled rows) and, as plain ints, how its rows split into decode buckets
    and prefill chunks. Nothing here touches the device; _StepMeta.upload makes the device half from it.

    Flat order: decode rows (by decreasing context when that splits them into buckets), then chunks from position
    0 by length, then chunks after cached tokens by start and length (equal lengths, and for cached chunks equal
    starts, share one attention call). Page ids are range-checked here by one min/max."""

    host: torch.Tensor                 # int64: tokens, positions, write rows [n each], pages, sampled rows
    num_tokens: int
    num_pages: int
    num_sample: int
    all_rows: bool                     # every row is sampled, in order: no index_select at the end
    max_pos: int
    decodes: list[tuple[int, int, int, int, int]]   # buckets: (first row, rows, width in pages, min pos, max pos)
    chunks: list[tuple[int, int, int, int]]         # prefill chunks: (first row, length, start_pos, pages used)
    paged: bool                        # decode rows for the CPU paged kernel (no padding mask)
    fused: tuple[torch.Tensor, list[int], list[int]] | None   # the fused kernel's host block table and lengths

    @staticmethod
    def build(seqs: list[SeqStep], block_size: int, num_pages: int, page_stride: int, fused: bool = False,
              paged: bool = False) -> "_StepLayout":
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
        host = torch.frombuffer(array.array("q", tokens + positions + rows + pages + sample), dtype=torch.long)
        if pages and (min(pages) < 0 or max(pages) >= num_pages):   # name the culprit only on failure
            bad = next(s for _, s, used in dec + chunks if not 0 <= min(used) <= max(used) < num_pages)
            raise ValueError(f"request {bad.request_id}: page id out of range [0, {num_pages}) "
                             f"in {bad.block_tables[KV]}")
        return _StepLayout(host, n, len(pages), len(sample), len(sample) == n and sample == list(range(n)),
                           max(positions), decodes, chunk_rows, paged,
                           _fused_step([e[1:] for e in dec + chunks]) if fused else None)


@dataclass
class _StepMeta:
    """The device half of a step's metadata, built once per step from a _StepLayout: one upload of its host tensor,
    then the decode buckets' page planes and masks and the prefill groups, for every layer to reuse."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor           # K-plane row (layer 0, in rows of kv_heads * head_dim) of each token
    sample_index: torch.Tensor | None  # flat rows to sample, in batch order; None: every row, in order
    num_tokens: int
    max_pos: int
    decodes: list[_Decode]             # buckets of decode rows by context length, in flat order
    prefills: list[_Prefill]
    fused: FusedStep | None            # the fused kernel's arguments, when the runner uses it

    @staticmethod
    def upload(layout: _StepLayout, arange: Callable[[int], torch.Tensor], parity: torch.Tensor,
               device: torch.device) -> "_StepMeta":
        n = layout.num_tokens
        t_tok, t_pos, t_rows, t_pages, t_sample = layout.host.to(device, non_blocking=True).split(
            [n, n, n, layout.num_pages, layout.num_sample])
        # Plane ids in a layer's [2 * pages, ...] view: row 0 the K planes (2p), row 1 the V planes (2p + 1). A
        # run of pages [a, b) is read as planes[:, a:b] flattened: K planes, then V planes (a view for one run).
        planes = t_pages * 2 + parity                   # parity: [[0], [1]]

        decodes, at = [], 0
        for lo, count, width, first, last in layout.decodes:
            span = slice(at, at + count * width)
            if layout.paged:                            # no padding to mask: each row stops at its own length
                decodes.append(_Decode(lo, count, None, last + 1, None, t_pages[span].view(count, width),
                                       t_pos[lo:lo + count] + 1))
            else:
                mask = None if first == last else \
                    _causal_mask(arange(last + 1), t_pos[lo:lo + count]).view(count, 1, 1, -1)
                decodes.append(_Decode(lo, count, planes[:, span].reshape(-1), last + 1, mask))
            at += count * width
        prefills: list[_Prefill] = []
        for first, length, start, used in layout.chunks:
            end = start + length
            prev = prefills[-1] if prefills else None
            if (start > 0 and prev is not None and prev.planes is not None and (prev.length, prev.ctx) == (length, end)
                    and (prev.count + 1) * end <= GROUP_GATHER_TOKENS):
                prev.count += 1                         # the same start and length: pages gathered together
                group = at - (prev.count - 1) * used    # where the first chunk's pages start
                prev.planes = planes[:, group:at + used].reshape(-1)
            elif start > 0:
                mask = _causal_mask(arange(end), t_pos[first:first + length])
                prefills.append(_Prefill(first, 1, length, planes[:, at:at + used].reshape(-1), end, mask))
            elif prefills and prefills[-1].planes is None and prefills[-1].length == length:
                prefills[-1].count += 1
            else:
                prefills.append(_Prefill(first, 1, length))
            at += used
        fused = None
        if layout.fused is not None:
            table, query_ends, kv_lengths = layout.fused
            fused = FusedStep(table.to(device, non_blocking=True), query_ends, kv_lengths)
        return _StepMeta(t_tok, t_pos, t_rows, None if layout.all_rows else t_sample, n, layout.max_pos, decodes,
                         prefills, fused)


def _decode_only(batch: StepBatch) -> bool:
    """Every row computes one token and samples it (no prompt logprobs, no drafts): what a decode graph runs."""
    return all(len(s.token_ids) == 1 and s.sample and not s.all_logits and not s.num_draft for s in batch.seqs)


@dataclass
class _StaticDecode:
    """A decode bucket's static inputs on the device, views of one buffer (one copy fills them all): per row its
    token, position, write row (K-plane row of its token in layer 0), context length, then its page table."""

    buffer: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor
    lengths: torch.Tensor
    pages: torch.Tensor

    @staticmethod
    def empty(batch: int, width: int, device: torch.device) -> "_StaticDecode":
        buffer = torch.zeros(batch * (4 + width), dtype=torch.long, device=device)
        tokens, positions, write_rows, lengths, pages = buffer.split([batch, batch, batch, batch, batch * width])
        return _StaticDecode(buffer, tokens, positions, write_rows, lengths, pages.view(batch, width))


@dataclass
class _GraphStep:
    """The host half of a decode step that replays a graph: the bucket's static inputs as one host tensor (the
    real rows, then padding rows that read and write a scratch page)."""

    rows: int
    host: torch.Tensor

    @staticmethod
    def build(seqs: list[SeqStep], block_size: int, num_pages: int, page_stride: int, batch: int, width: int,
              scratch: int) -> "_GraphStep":
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
        return _GraphStep(len(seqs), host)


def _fused_step(order: list[tuple[SeqStep, list[int]]]) -> tuple[torch.Tensor, list[int], list[int]]:
    """The fused kernel's host block table and lengths for sequences in flat-batch order (each its pages)."""
    width = max(len(used) for _, used in order)
    table = array.array("i", [2 * p for _, used in order for p in used + [0] * (width - len(used))])
    query_ends = list(itertools.accumulate(len(s.token_ids) for s, _ in order))
    kv_lengths = [s.start_pos + len(s.token_ids) for s, _ in order]
    return torch.frombuffer(table, dtype=torch.int32).view(len(order), width), query_ends, kv_lengths
