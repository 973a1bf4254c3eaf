"""DeepSeek V4 (as released: DeepSeek-V4-Flash) over the seven paged KV-cache groups, the tiny and the full layout.

Per main layer, on hc_mult residual streams (npu/dsv4/hyper.py):
    post, comb, x = hc_pre(streams); streams = post * attention(attn_norm(x)) + comb^T streams
    post, comb, x = hc_pre(streams); streams = post * moe(ffn_norm(x)) + comb^T streams
then logits = head(norm(hc_head(streams))). Attention (npu/dsv4/attention.py): q-LoRA queries, one shared
KV row, a sliding window (`ori`), compressed rows (overlapping CSA with the lightning indexer, HCA), a
learned sink, grouped output projection. MoE (npu/dsv4/moe.py): routed experts (the first num_hash_layers
layers route by tid2eid[token]) plus a shared expert. The oracle is transformers' DeepseekV4ForCausalLM on
the same weights (tests/npu/test_dsv4_oracle.py).

Weights: the tensors and names of the released checkpoint (appliance/core/archs/deepseek_v4_weights.py).
They are held as stored: FP8 / FP4 matrices stay quantized on the device and each is dequantized to the
compute dtype when its layer runs (a routed expert only when some token picks it), so the model is never
in the compute dtype all at once. MTP layers (`mtp.J.*`) are loaded, checked and held the same way under
their released names (self.params), but not run: a speculative-decoding drafter can read them there.

Steps may start anywhere and hold up to tokens_in_flight tokens per sequence, as long as every
compressor-state ring has a slot for each page the step touches (block-aligned chunks always do; see
appliance.core.archs.deepseek_v4.state_span_pages). Nothing bakes in a pool size: rows are located through
the step's block tables on the runtime pools.
"""

from __future__ import annotations

import zlib

import torch

from appliance.core.archs.deepseek_v4 import STATE_GROUPS, compress_ratios
from appliance.core.archs.deepseek_v4_weights import checkpoint_tensors, rank_weights, scale_name, stored_tensors
from appliance.core.config import ModelSpec
from appliance.core.errors import CheckpointError
from appliance.core.parallel import RankPlace
from npu.dsv4.attention import Attention, rms_norm
from npu.dsv4.hyper import hc_head, hc_post, hc_pre
from npu.dsv4.moe import exchange_experts, route, routed_experts, swiglu
from npu.dsv4.paging import Compression, PoolIO, StepPlan, build_plan
from npu.dsv4.rope import Rotation, layer_ropes
from npu.quant import QuantizedWeight
from npu.runner import ModelRunner
from npu.step import StepBatch
from npu.weights import is_norm_weight

Held = torch.Tensor | QuantizedWeight


class DeepseekV4Runner(ModelRunner):
    """DeepSeek V4 over paged caches: sliding window (ori), CSA (cmp_c{small}, idx) and HCA (cmp_c{large})."""

    def __init__(self, model: ModelSpec, device: torch.device | str, place: RankPlace | None = None):
        super().__init__(model, torch.device(device), place)
        lay = model.layout
        self.ratios = model.main_layer_ratios
        self.csa_ratio, self.hca_ratio = compress_ratios(lay)
        self.dtype = getattr(torch, lay.dtype)
        self.kinds = {
            self.csa_ratio: Compression(self.csa_ratio, ("csa_state", "csa_inner_state"),
                                        (f"cmp_c{self.csa_ratio}", "idx"), overlap=True),
            self.hca_ratio: Compression(self.hca_ratio, ("hca_state",), (f"cmp_c{self.hca_ratio}",), overlap=False),
        }
        self.state_groups = STATE_GROUPS
        self.params: dict[str, Held] = {}
        self.io = PoolIO(model, self.pools)
        self.attention = Attention(lay, self.ratios, self.kinds, layer_ropes(lay, self.device, self.dtype),
                                   self.weight, self.io, self.dtype)

    # -- weights -----------------------------------------------------------------------------------
    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {t.name: (t.shape, getattr(torch, t.dtype)) for t in checkpoint_tensors(self.model.layout)}

    def held_weights(self) -> dict[str, None]:
        """Expert parallel: the replicated weights and this rank's routed experts, each whole."""
        lay = self.model.layout
        return {t.name: None for w in rank_weights(lay, self.place) for t in stored_tensors(w, lay)}

    def random_weights(self, seed: int, std: float = 0.02, device: torch.device | str | None = None
                       ) -> dict[str, torch.Tensor]:
        """Seeded random weights whose hash-routing tables name distinct valid experts per token."""
        state = super().random_weights(seed, std, device)
        lay = self.model.layout
        for name, table in state.items():
            if name.endswith(".tid2eid") and table.device.type != "meta":
                gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
                picks = torch.rand(lay.vocab_size, lay.num_experts, generator=gen).argsort(dim=-1)
                state[name] = picks[:, :lay.num_experts_per_tok].to(table.dtype).to(table.device)
        return state

    def install_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Hold quantized matrices as QuantizedWeight (values + scales), norm gains and float32 tensors in
        float32, routing tables as indices, everything else as loaded (the compute dtype)."""
        lay, held = self.model.layout, {}
        for w in rank_weights(lay, self.place):
            t = weights[w.name]
            if w.format in ("fp8", "fp4"):
                scale = weights[scale_name(w.name)]
                held[w.name] = QuantizedWeight(w.name, t, scale, lay.quant_block_size or 0).check()
            elif w.format == "int32":
                held[w.name] = t.long()
                if t.device.type != "meta" and t.numel() and not 0 <= int(t.min()) <= int(t.max()) < lay.num_experts:
                    raise CheckpointError(f"{w.name}: expert ids {int(t.min())}..{int(t.max())} outside "
                                          f"[0, {lay.num_experts}) (model.layout.num_experts)")
            elif w.format == "float32" or is_norm_weight(w.name):
                held[w.name] = t.float()
            else:
                held[w.name] = t
        self.params = held

    def weight_tensors(self) -> list[torch.Tensor]:
        return [t for w in self.params.values()
                for t in ((w.values, w.scale) if isinstance(w, QuantizedWeight) else (w,))]

    def weight(self, name: str) -> torch.Tensor:
        """A weight for the math: quantized matrices dequantized to the compute dtype now, others as held."""
        w = self.params[name]
        return w.dequantize(self.dtype) if isinstance(w, QuantizedWeight) else w

    # -- model -------------------------------------------------------------------------------------
    def _moe(self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, worst_case: bool) -> torch.Tensor:
        """Routed experts plus the shared one. worst_case (a profiling step): every token routes to the same
        num_experts_per_tok experts, the routing whose expert activations are largest (an expert computes
        all N tokens at once; a uniform routing gives each about N k / num_experts)."""
        lay, w, p = self.model.layout, self.weight, f"layers.{layer}.ffn."
        hashed = layer < lay.num_hash_layers
        table, ids = (w(p + "gate.tid2eid"), token_ids) if hashed else (None, None)
        if worst_case:
            table = torch.arange(lay.num_experts_per_tok, device=x.device)[None]
            ids = torch.zeros_like(token_ids)
        weights, experts = route(x, w(p + "gate.weight"), lay.scoring_func, lay.num_experts_per_tok,
                                 lay.routed_scaling_factor, bias=None if hashed else w(p + "gate.bias"),
                                 table=table, token_ids=ids)
        expert = lambda e: tuple(w(f"{p}experts.{e}.{n}.weight") for n in ("w1", "w3", "w2"))  # noqa: E731
        if self.expert_parallel is None:
            routed = routed_experts(x, weights, experts, expert, lay.swiglu_limit)
        else:
            routed = exchange_experts(self.expert_parallel, x, weights, experts, expert, lay.swiglu_limit,
                                      lay.num_experts)
        shared = swiglu(x, *(w(f"{p}shared_experts.{n}.weight") for n in ("w1", "w3", "w2")), lay.swiglu_limit)
        return routed + shared

    def _hc(self, prefix: str, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lay = self.model.layout
        return hc_pre(streams, self.weight(prefix + "_fn"), self.weight(prefix + "_base"),
                      self.weight(prefix + "_scale"), lay.hc_sinkhorn_iters, lay.hc_eps, lay.rms_norm_eps)

    def _block(self, layer: int, streams: torch.Tensor, plan: StepPlan, rot: dict[object, Rotation],
               worst_case: bool) -> torch.Tensor:
        p, eps = f"layers.{layer}.", self.model.layout.rms_norm_eps
        post, comb, x = self._hc(p + "hc_attn", streams)
        out = self.attention(layer, rms_norm(x, self.weight(p + "attn_norm.weight"), eps), plan, rot)
        streams = hc_post(out, streams, post, comb)
        post, comb, x = self._hc(p + "hc_ffn", streams)
        out = self._moe(layer, rms_norm(x, self.weight(p + "ffn_norm.weight"), eps), plan.token_ids, worst_case)
        return hc_post(out, streams, post, comb)

    # -- steps -------------------------------------------------------------------------------------
    def execute(self, batch: StepBatch) -> torch.Tensor:
        if not self.params:
            raise RuntimeError("DeepseekV4Runner.execute: no weights; call load_weights() or set_weights() first")
        if not self.pools:
            raise RuntimeError("DeepseekV4Runner.execute: no pools; call allocate_pools() first")
        for name in self.state_groups:
            if batch.new_pages.get(name):
                self.zero_pages(name, batch.new_pages[name])
        lay = self.model.layout
        if not batch.seqs:
            if self.expert_parallel is not None:
                self._serve_experts_only()
            return torch.empty(0, lay.vocab_size, dtype=torch.float32, device=self.device)
        plan = build_plan(self.model, batch, list(self.kinds.values()), self.device)
        with torch.no_grad():
            x = self.weight("embed.weight")[plan.token_ids]
            streams = x.unsqueeze(1).expand(-1, lay.hc_mult, -1).contiguous()
            rot = self.attention.rotations(plan)
            for layer in range(len(self.ratios)):
                streams = self._block(layer, streams, plan, rot, batch.worst_case)
            last = hc_head(streams[plan.sample_index], self.weight("hc_head_fn"), self.weight("hc_head_base"),
                           self.weight("hc_head_scale"), lay.hc_eps, lay.rms_norm_eps)
            last = rms_norm(last, self.weight("norm.weight"), lay.rms_norm_eps)
            head = self.weight("embed.weight" if lay.tie_word_embeddings else "head.weight")
            return torch.nn.functional.linear(last, head).float()

    @torch.no_grad()
    def _serve_experts_only(self) -> None:
        """A step with no sequences on this rank: its routed experts still serve the other ranks' tokens, so it
        joins every layer's expert exchange with no tokens of its own (expert-parallel ranks step in lockstep)."""
        x = torch.zeros(0, self.model.layout.hidden_size, dtype=self.dtype, device=self.device)
        no_tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        for layer in range(len(self.ratios)):
            self._moe(layer, x, no_tokens, worst_case=False)
