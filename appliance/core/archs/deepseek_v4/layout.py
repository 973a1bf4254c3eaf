"""DeepSeek V4's layout (model.layout of arch deepseek_v4) and the facts every other module reads off it: the cache
group names the runner keeps beside the seven of DESIGN.md section 4, and the two compress ratios (CSA smallest,
HCA largest)."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.core.config import Layout

STATE_GROUPS = ("hca_state", "csa_state", "csa_inner_state")
# The MTP layers' sliding-window rows, a group of their own that exists only with speculative.method=mtp.
MTP_WINDOW_GROUP = "mtp"
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
EXPERT_DTYPES = ("fp4", "fp8")


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Layout(Layout):
    """DeepSeek V4 as released: sliding-window attention with CSA / HCA compressed layers and an indexer, q-LoRA
    queries and a grouped output projection, MoE with hash-routed first layers, hyper-connections, MTP layers."""

    num_mtp_layers: int = 0
    sliding_window: int
    compress_ratios: tuple[int, ...]       # one per layer, main layers then MTP layers
    index_head_dim: int
    index_num_heads: int
    index_topk: int
    q_lora_rank: int                       # queries: wq_a to this rank, q_norm, then wq_b
    qk_rope_head_dim: int                  # trailing channels of a head that RoPE rotates (interleaved pairs)
    o_groups: int                          # grouped output projection: head groups (wo_a per group, then wo_b)
    o_lora_rank: int                       # ... and the width each group is projected to
    compress_rope_theta: float             # RoPE base of compressed layers (window-only layers: rope_theta)
    yarn_factor: float | None = None       # YaRN of the compressed layers' RoPE (config.json rope_scaling); null: none
    yarn_original_max_position_embeddings: int | None = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    num_experts: int                       # routed experts per MoE layer
    num_experts_per_tok: int
    num_shared_experts: int = 1
    moe_intermediate_size: int
    num_hash_layers: int = 0               # the first layers route by a fixed table tid2eid[token]
    scoring_func: str = "sqrtsoftplus"     # router scores of the experts
    routed_scaling_factor: float = 1.0     # routed weights are renormalized, then scaled by this
    swiglu_limit: float                    # experts clamp their gate (above) and up (both sides) to this
    hc_mult: int                           # hyper-connections: residual streams
    hc_sinkhorn_iters: int = 20            # Sinkhorn iterations of the stream-mixing matrix
    hc_eps: float = 1e-6
    quant_block_size: int | None = None    # checkpoint linears FP8 e4m3 with [b, b] ue8m0 block scales; null: dtype
    expert_dtype: str | None = None        # checkpoint routed experts: fp4 (e2m1, per-32 ue8m0 scales), fp8,
                                           # null: dtype

    @property
    def main_layer_ratios(self) -> tuple[int, ...]:
        return self.compress_ratios[: self.num_layers]

    @property
    def num_routed_experts(self) -> int:
        return self.num_experts

    def ring_spans(self) -> dict[str, int]:
        return {"sliding_window": self.sliding_window}


def compress_ratios(layout: DeepseekV4Layout) -> tuple[int, int] | None:
    """(CSA ratio, HCA ratio) of the main layers, or None when there are not exactly two nonzero ratios."""
    nonzero = sorted({r for r in layout.main_layer_ratios if r})
    return (nonzero[0], nonzero[1]) if len(nonzero) == 2 else None


def csa_ratio(layout: DeepseekV4Layout) -> int:
    """The CSA ratio: the smallest nonzero one. Its compressors (and the indexer's) pool overlapping windows."""
    return min((r for r in layout.main_layer_ratios if r), default=0)
