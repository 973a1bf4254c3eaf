"""Qwen3 over one paged KV group, in plain torch; Hugging Face parameter names, so HF checkpoints load as is.

Pool "kv": [num_layers, pages, block_size, 2 * kv_heads * head_dim]. A page holds two planes: the K rows
of its block_size tokens, then their V rows ([2, block_size, kv_heads * head_dim]), so one layer's pool
viewed as [2 * pages, block_size, kv_heads * head_dim] is a contiguous paged cache with page p's K at
block 2p and its V at 2p + 1: what a fused paged-attention kernel reads in place (npu.fused_attention).
In bfloat16 on a CPU with AVX512-BF16 and no AMX the planes keep their elements in the kv-pairs order instead
(npu.kv_pairs: K as dimension pairs across a page's keys, V as key pairs), written by its C++ writer and read by the
two CPU attention kernels alone.
A step flattens every sequence's tokens into one [N, hidden] batch for the projections and the MLP:
decode tokens first, then prefill chunks. Everything shared by the layers (token rows in the pool,
rope cos/sin, masks, page lists) is built once per step from one host tensor (StepMeta). Norms, q/k
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
- chunks after cached tokens (later chunks, prefix-cache hits): a kernel reading their pages in place (the CPU
  flash kernel, npu.prefill_attention_cpu; on a GPU a Triton kernel, npu.prefill_attention_triton); otherwise SDPA
  over their gathered pages with an offset causal mask; one call for chunks of the same start and length (up to
  GROUP_GATHER_TOKENS).
Row indices come from the pool tensor's strides at each step, so no pool size is baked in anywhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from appliance.core.archs.qwen3.layout import KV
from appliance.core.archs.qwen3.tensor_parallel import held_slices, parameters
from appliance.core.config import ModelSpec
from appliance.core.parallel import RankPlace, TensorSlice, split
from npu.fused_attention import FusedPagedAttention, fused_attention_op
from npu.fused_norms import layer_norms
from npu.graphs import DecodeGraphs, batch_buckets
from npu.kv_pairs import KVPairsWriter, kv_pairs_writer
from npu.linear import Projection
from npu.paged_attention_cpu import PagedDecodeAttention, paged_decode_attention
from npu.paged_attention_triton import TritonDecodeAttention, triton_decode_attention
from npu.prefill_attention_cpu import CausalPrefillAttention, causal_prefill_attention
from npu.prefill_attention_triton import TritonPrefillAttention, triton_prefill_attention
from npu.qwen3.graph_step import GraphStep, StaticDecode, decode_only
from npu.qwen3.step_layout import StepLayout
from npu.qwen3.step_meta import Decode, StepMeta
from npu.runner import ModelRunner
from npu.step import StepBatch

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

    feeds_tokens = True

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
        # Prefill chunks (from position 0, and after cached tokens): the CPU flash kernel where it beats SDPA.
        self.prefill_attention: CausalPrefillAttention | None = causal_prefill_attention(
            self.device, self.dtype, self.num_heads, self.num_kv_heads, self.head_dim)
        # bfloat16 on a CPU with AVX512-BF16 and no AMX: the pool in the kv-pairs layout (npu.kv_pairs), written by
        # its writer and read by the two CPU attention kernels alone, so only where both run (no gather path reads it).
        self.kv_pairs: KVPairsWriter | None = None
        pool_dtype = next(self.pool_dtype(spec) for spec in self.cache_specs if spec.name == KV)
        if self.fused_attention is None and self.device.type == "cpu" and self.prefill_attention is not None \
                and pool_dtype == self.dtype:
            self.kv_pairs = kv_pairs_writer(self.device, self.dtype, self.num_kv_heads, self.head_dim, self.block_size)
        # Decode rows read their pages in place: the C++ kernel on a CPU, the Triton kernel on a GPU; None: gather +
        # SDPA (and on an NPU the fused kernel takes every row).
        self.paged_decode: PagedDecodeAttention | TritonDecodeAttention | None = None
        if self.fused_attention is None and self.device.type == "cpu":
            self.paged_decode = paged_decode_attention(self.device, self.dtype, self.num_heads, self.num_kv_heads,
                                                       self.head_dim, self.block_size, pairs=self.kv_pairs is not None)
        elif self.fused_attention is None:
            self.paged_decode = triton_decode_attention(self.device, self.dtype, self.num_heads, self.num_kv_heads,
                                                        self.head_dim, self.block_size)
        # Chunks after cached tokens read their pages in place: the CPU kernel, else on a GPU a Triton kernel (chunks
        # from position 0 keep SDPA's causal flash kernel there); None: gather + SDPA.
        self.cached_prefill: CausalPrefillAttention | TritonPrefillAttention | None = self.prefill_attention
        if self.device.type != "cpu" and self.fused_attention is None:
            self.cached_prefill = triton_prefill_attention(self.device, self.dtype, self.num_heads, self.num_kv_heads,
                                                           self.head_dim, self.block_size)
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
        assert self.kv_pairs is None, "a pool in the kv-pairs layout is read by the CPU attention kernels alone"
        src = self._planes(pool, layer)
        numel = planes.numel() * src.shape[1] * src.shape[2]
        if self._kv_buf.numel() < numel or self._kv_buf.dtype != src.dtype:
            self._kv_buf = torch.empty(numel, dtype=src.dtype, device=self.device)
        out = torch.index_select(src, 0, planes, out=self._kv_buf[:numel].view(planes.numel(), *src.shape[1:]))
        out = out.view(2, seqs, -1, self.num_kv_heads, self.head_dim)
        return out if out.dtype == self.dtype else out.to(self.dtype)

    # -- step --------------------------------------------------------------------------------------
    def prepare(self, batch: StepBatch) -> StepLayout | GraphStep | None:
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
        bucket = self.graphs.bucket(len(batch.seqs)) if self.graphs is not None and decode_only(batch) else None
        if bucket is not None:
            graph_step = GraphStep.build(batch.seqs, self.block_size, pool.shape[1], pool.stride(1) // half, bucket,
                                         self.graph_pages, self.scratch_page(KV, 0))
            graph_step.fed = batch.fed
            return graph_step
        layout = StepLayout.build(batch.seqs, self.block_size, pool.shape[1], pool.stride(1) // half,
                                  fused=self.fused_attention is not None, paged=self._paged(pool))
        layout.fed = batch.fed
        return layout

    def _paged(self, pool: torch.Tensor) -> bool:
        return self.paged_decode is not None and pool.dtype == self.dtype

    @torch.inference_mode()
    def forward(self, layout: "StepLayout | GraphStep | None") -> torch.Tensor:
        """The device half: uploads the step's indices, then the layers (or replays the decode graph of its batch
        bucket, npu.graphs); no host sync."""
        if layout is None:
            return torch.empty(0, self.model.layout.vocab_size, dtype=self.dtype, device=self.device)
        if isinstance(layout, GraphStep):
            assert self.graphs is not None
            fed = layout.fed

            def fill(inputs: StaticDecode) -> None:
                inputs.buffer.copy_(layout.host, non_blocking=True)
                if fed is not None:                     # row i of a graph step is the batch's sequence i
                    self.feed_rows(inputs.tokens, [i for i, _ in fed.rows], fed)
            return self.graphs.replay(layout.rows, fill)
        meta = StepMeta.upload(layout, self._arange, self._parity, self.device)
        if layout.fed is not None:
            self.feed_rows(meta.tokens, [layout.last_rows[i] for i, _ in layout.fed.rows], layout.fed)
        return self._run(meta)

    def _run(self, meta: "StepMeta") -> torch.Tensor:
        """The layers over one step's device metadata: the logits of its sampled rows."""
        embed, norm, lm_head = self.embed, self.norm, self.lm_head
        assert embed is not None and norm is not None and lm_head is not None, "prepare checks the weights are in"
        pool = self.pools[KV]
        rows = pool.view(-1, self.num_kv_heads * self.head_dim)
        kv_rows = meta.write_rows[:, None] + self._row_offsets(pool)   # [layers, tokens, 2]: K row, V row
        rope = self._rope(meta.positions, meta.max_pos)

        n, nh, kvh, hd = meta.num_tokens, self.num_heads, self.num_kv_heads, self.head_dim
        half = kvh * hd
        norms = self.norms
        x = F.embedding(meta.tokens, embed)         # the residual stream, updated in place from here
        h = norms.rms_norm(x, self.layers[0].input_norm)
        for li, layer in enumerate(self.layers):
            qkv = layer.qkv(h)
            norms.qk_norm_rope_(qkv, nh + kvh, layer.qk_norm, rope)   # q and k heads in place: qkv is q | k | v
            if self.kv_pairs is not None:               # rows from page ids range-checked in StepLayout.build
                self.kv_pairs(pool, kv_rows[li], qkv[:, nh * hd:], checked=True)
            else:
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
        logits = lm_head(norms.add_rms_norm_(x, mlp, norm))
        if self.vocab_widths is not None:                # vocab-parallel head: every rank gets all the columns
            assert self.tensor_parallel is not None, "prepare checks a tensor-parallel rank has its collectives"
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

    def _static_inputs(self, batch: int) -> "StaticDecode":
        return StaticDecode.empty(batch, self.graph_pages, self.device)

    def _run_static(self, inputs: "StaticDecode") -> torch.Tensor:
        """The layers over a bucket's static inputs: every row a decode row through the paged kernel."""
        n = inputs.tokens.shape[0]
        meta = StepMeta(inputs.tokens, inputs.positions, inputs.write_rows, None, n, self._rope_table.shape[0] - 1,
                         [Decode(0, n, None, self.graph_pages * self.block_size, None, inputs.pages, inputs.lengths)],
                         [], None)
        return self._run(meta)

    def _attend(self, pool: torch.Tensor, li: int, qkv: torch.Tensor, q: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        """Attention of every row of the flat batch over layer li with SDPA: [n, heads, head_dim]."""
        nh, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        parts = []                                     # attention output of rows 0..n-1, in order
        for d in meta.decodes:                         # decode rows come first in the flat batch
            if d.lengths is not None:                  # the CPU kernel reads the pages in place
                assert self.paged_decode is not None and d.pages is not None, "StepMeta sets lengths with pages"
                parts.append(self.paged_decode(q[d.first:d.first + d.count], self._planes(pool, li), d.pages,
                                               d.lengths, checked_longest=d.ctx))   # page ids checked in build
                continue
            assert d.planes is not None, "StepMeta gives gathered buckets their planes"
            kd, vd = self._gather(pool, li, d.planes, d.count)[:, :, :d.ctx].transpose(2, 3)  # [count, kvh, ctx, hd]
            qd = q[d.first:d.first + d.count].view(d.count, kvh, self.group_size, hd)  # GQA: heads as queries
            # reshape, not view: the output's memory layout is the kernel's choice (CUDA's fused kernels return
            # [count, group, kvh, hd] memory seen as [count, kvh, group, hd])
            parts.append(F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask).reshape(d.count, nh, hd))
        kernel = self.prefill_attention
        for p in meta.prefills:
            rows = qkv[p.first:p.first + p.count * p.length]
            if kernel is not None and p.planes is None:       # the CPU kernel reads q, k and v in place
                parts.append(kernel(rows[:, :nh * hd], rows[:, nh * hd:(nh + kvh) * hd], rows[:, (nh + kvh) * hd:],
                                    [p.length] * p.count))
                continue
            cached = self.cached_prefill
            if cached is not None and p.pages is not None and pool.dtype == self.dtype:   # the pages in place
                planes = self._planes(pool, li)         # page ids range-checked in StepLayout.build
                parts.append(cached.paged(rows[:, :nh * hd], planes, p.pages, p.ctx, p.length, checked=True, pairs=True)
                             if self.kv_pairs is not None and isinstance(cached, CausalPrefillAttention) else
                             cached.paged(rows[:, :nh * hd], planes, p.pages, p.ctx, p.length, checked=True))
                continue
            chunk = rows.view(p.count, p.length, nh + 2 * kvh, hd)
            qp = chunk[:, :, :nh].transpose(1, 2)      # [count, nh, len, hd]
            if p.planes is None:                       # from position 0: the chunks' own K/V are the context
                kp, vp = chunk[:, :, nh:].view(p.count, p.length, 2, kvh, hd).permute(2, 0, 3, 1, 4)
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            else:
                kp, vp = self._gather(pool, li, p.planes, p.count)[:, :, :p.ctx].transpose(2, 3)  # [count, kvh, ctx, hd]
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, enable_gqa=True)
            parts.append(op.transpose(1, 2).reshape(p.count * p.length, nh, hd))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
