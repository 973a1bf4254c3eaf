"""Every tensor of a deepseek_v4 checkpoint as released, derived from the layout alone (no torch).

One description, three readers: the runner's expected weights (names, shapes, stored dtypes), the planner's
weight estimate (bytes, replicated vs divided by expert parallel) and the parameter counts `mode=validate`
prints. Names are the released ones (`layers.3.attn.wq_b.weight`, `layers.3.ffn.experts.7.w1.weight`,
`mtp.0.e_proj.weight`, ...).

Storage formats, as released:
- "fp8": e4m3 values [out, in] and one ue8m0 scale per [b, b] block in `<name>.scale`
  [ceil(out / b), ceil(in / b)] (b = layout.quant_block_size);
- "fp4": e2m1 values two per byte [out, in / 2] (low nibble first) and one ue8m0 scale per 32 values of a
  row in `<name>.scale` [out, in / 32];
- "dense": layout.dtype; "float32" and "int32" as named.
Linears (q/kv/o projections, indexer queries, shared experts, MTP projections) are fp8 when the layout
quantizes; routed experts follow layout.expert_dtype; embeddings, head, norms, router, compressors and the
indexer's head weights stay dense; hyper-connections, attention sinks, position biases and router biases are
float32; the hash layers' routing table is int32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from appliance.core.archs.deepseek_v4.layout import DeepseekV4Layout, csa_ratio
from appliance.core.archs.parameter_counts import ParameterCounts
from appliance.core.kv_cache_spec import DTYPE_BYTES
from appliance.core.parallel import RankPlace

FP8, FP4, SCALE = "float8_e4m3fn", "float4_e2m1fn_x2", "float8_e8m0fnu"
FP4_BLOCK = 32          # FP4 values per ue8m0 scale, along a row


@dataclass(frozen=True)
class Weight:
    """One parameter the math reads, at its logical shape (an FP4 matrix [out, in] is stored [out, in / 2])."""

    name: str                  # the released name of its main tensor
    shape: tuple[int, ...]
    format: str                # dense | float32 | int32 | fp8 | fp4
    expert: bool = False       # a routed expert's: divided over expert-parallel ranks, active only when routed to
    mtp: bool = False          # an MTP layer's: loaded and held, not served
    expert_id: int = -1        # a routed expert's: which one (the ranks of an expert group each hold a range)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_parameter(self) -> bool:
        """Learned values (the int32 routing table of the hash layers is a lookup table, not counted)."""
        return self.format != "int32"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the checkpoint file: its name, stored shape and torch dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    weight: Weight

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def scale_name(name: str) -> str:
    """`layers.0.attn.wq_a.weight` -> `layers.0.attn.wq_a.scale` (the released name of its block scales)."""
    return name.removesuffix(".weight") + ".scale"


def stored_tensors(w: Weight, layout: DeepseekV4Layout) -> list[StoredTensor]:
    """The tensors that hold `w` in a checkpoint: its values, and its scales when quantized."""
    if w.format == "fp8":
        out, inp = w.shape
        b = layout.quant_block_size
        assert b is not None, "fp8 linears come with model.layout.quant_block_size"
        return [StoredTensor(w.name, w.shape, FP8, w),
                StoredTensor(scale_name(w.name), (-(-out // b), -(-inp // b)), SCALE, w)]
    if w.format == "fp4":
        out, inp = w.shape
        return [StoredTensor(w.name, (out, inp // 2), FP4, w),
                StoredTensor(scale_name(w.name), (out, inp // FP4_BLOCK), SCALE, w)]
    dtype = {"dense": layout.dtype, "float32": "float32", "int32": "int32"}[w.format]
    return [StoredTensor(w.name, w.shape, dtype, w)]


def layer_weights(layout: DeepseekV4Layout, prefix: str, layer: int, mtp: bool = False) -> list[Weight]:
    """The weights of decoder layer `layer` (main layers, then MTP layers) under `prefix`
    (`layers.L.` or `mtp.J.`)."""
    lay = layout
    D, H, hd, q_rank = lay.hidden_size, lay.num_heads, lay.head_dim, lay.q_lora_rank
    G, o_rank, hc = lay.o_groups, lay.o_lora_rank, lay.hc_mult
    E, inter = lay.num_experts, lay.moe_intermediate_size
    ratio = lay.compress_ratios[layer]
    csa = csa_ratio(lay)
    linear = "fp8" if lay.quant_block_size else "dense"
    expert = {"fp4": "fp4", "fp8": "fp8"}.get(lay.expert_dtype or "", "dense")
    out: list[Weight] = []

    def add(name: str, shape: tuple[int, ...], fmt: str, expert_id: int = -1) -> None:
        out.append(Weight(prefix + name, shape, fmt, expert_id >= 0, mtp, expert_id))

    def compressor(at: str, width: int, overlap: bool) -> None:
        coff = 2 if overlap else 1
        add(at + "wkv.weight", (coff * width, D), "dense")
        add(at + "wgate.weight", (coff * width, D), "dense")
        add(at + "ape", (ratio, coff * width), "float32")
        add(at + "norm.weight", (width,), "dense")

    add("attn_norm.weight", (D,), "dense")
    add("ffn_norm.weight", (D,), "dense")
    for site in ("attn", "ffn"):
        add(f"hc_{site}_fn", ((2 + hc) * hc, hc * D), "float32")
        add(f"hc_{site}_base", ((2 + hc) * hc,), "float32")
        add(f"hc_{site}_scale", (3,), "float32")
    add("attn.wq_a.weight", (q_rank, D), linear)
    add("attn.q_norm.weight", (q_rank,), "dense")
    add("attn.wq_b.weight", (H * hd, q_rank), linear)
    add("attn.wkv.weight", (hd, D), linear)
    add("attn.kv_norm.weight", (hd,), "dense")
    add("attn.wo_a.weight", (G * o_rank, H * hd // G), linear)
    add("attn.wo_b.weight", (D, G * o_rank), linear)
    add("attn.attn_sink", (H,), "float32")
    if ratio:
        compressor("attn.compressor.", hd, overlap=ratio == csa)
    if ratio and ratio == csa:
        add("attn.indexer.wq_b.weight", (lay.index_num_heads * lay.index_head_dim, q_rank), linear)
        add("attn.indexer.weights_proj.weight", (lay.index_num_heads, D), "dense")
        compressor("attn.indexer.compressor.", lay.index_head_dim, overlap=True)
    add("ffn.gate.weight", (E, D), "dense")
    if layer < lay.num_hash_layers:
        add("ffn.gate.tid2eid", (lay.vocab_size, lay.num_experts_per_tok), "int32")
    else:
        add("ffn.gate.bias", (E,), "float32")
    for e in range(E):
        add(f"ffn.experts.{e}.w1.weight", (inter, D), expert, e)
        add(f"ffn.experts.{e}.w2.weight", (D, inter), expert, e)
        add(f"ffn.experts.{e}.w3.weight", (inter, D), expert, e)
    for name, shape in (("w1", (inter, D)), ("w2", (D, inter)), ("w3", (inter, D))):
        add(f"ffn.shared_experts.{name}.weight", shape, linear)
    return out


def hc_head_weights(layout: DeepseekV4Layout, prefix: str, mtp: bool = False) -> list[Weight]:
    hc, D = layout.hc_mult, layout.hidden_size
    return [Weight(prefix + "hc_head_fn", (hc, hc * D), "float32", mtp=mtp),
            Weight(prefix + "hc_head_base", (hc,), "float32", mtp=mtp),
            Weight(prefix + "hc_head_scale", (1,), "float32", mtp=mtp)]


def model_weights(layout: DeepseekV4Layout) -> list[Weight]:
    """Every weight of the checkpoint: embedding, main layers, final norm, head, hc head, then MTP layers
    (which share the embedding and head of the main model)."""
    lay = layout
    D, V = lay.hidden_size, lay.vocab_size
    out = [Weight("embed.weight", (V, D), "dense")]
    for layer in range(lay.num_layers):
        out += layer_weights(lay, f"layers.{layer}.", layer)
    out.append(Weight("norm.weight", (D,), "dense"))
    if not lay.tie_word_embeddings:
        out.append(Weight("head.weight", (V, D), "dense"))
    out += hc_head_weights(lay, "")
    linear = "fp8" if lay.quant_block_size else "dense"
    for j in range(lay.num_mtp_layers):
        p = f"mtp.{j}."
        out += layer_weights(lay, p, lay.num_layers + j, mtp=True)
        out += [Weight(p + "e_proj.weight", (D, D), linear, mtp=True),
                Weight(p + "h_proj.weight", (D, D), linear, mtp=True)]
        out += [Weight(p + n, (D,), "dense", mtp=True) for n in ("enorm.weight", "hnorm.weight", "norm.weight")]
        out += hc_head_weights(lay, p, mtp=True)
    return out


def checkpoint_tensors(layout: DeepseekV4Layout) -> list[StoredTensor]:
    """Every tensor a checkpoint of this layout holds, as stored."""
    return [t for w in model_weights(layout) for t in stored_tensors(w, layout)]


def rank_weights(layout: DeepseekV4Layout, place: RankPlace) -> list[Weight]:
    """The weights one rank holds: everything but the routed experts (attention, shared expert, router, embedding
    and head are replicated over data-parallel ranks), plus its expert-parallel slice of the routed experts."""
    mine = place.experts(layout.num_experts)
    return [w for w in model_weights(layout) if not w.expert or w.expert_id in mine]


def rank_weight_bytes(layout: DeepseekV4Layout, place: RankPlace) -> int:
    """Checkpoint bytes of the tensors one rank loads (rank_weights, as stored)."""
    replicated, per_expert = _bytes_by_expert(layout)
    return replicated + sum(per_expert.get(e, 0) for e in place.experts(layout.num_experts))


@functools.cache
def _bytes_by_expert(layout: DeepseekV4Layout) -> tuple[int, dict[int, int]]:
    """(bytes every rank holds, bytes of each routed expert over all layers): the full layout has some 70,000
    tensors, and a plan asks this for every rank, so the description is walked once per layout."""
    replicated = 0
    per_expert: dict[int, int] = {}
    for w in model_weights(layout):
        nbytes = sum(t.nbytes for t in stored_tensors(w, layout))
        if w.expert:
            per_expert[w.expert_id] = per_expert.get(w.expert_id, 0) + nbytes
        else:
            replicated += nbytes
    return replicated, per_expert


def parameter_counts(layout: DeepseekV4Layout) -> ParameterCounts:
    weights = model_weights(layout)
    main = [w for w in weights if not w.mtp and w.is_parameter]
    routed = sum(w.numel for w in main if w.expert)
    active = sum(w.numel for w in main if not w.expert)
    if routed:
        active += routed * layout.num_experts_per_tok // layout.num_experts
    tensors = [t for w in weights for t in stored_tensors(w, layout)]
    return ParameterCounts(
        total=sum(w.numel for w in main), active=active,
        mtp=sum(w.numel for w in weights if w.mtp and w.is_parameter),
        replicated_bytes=sum(t.nbytes for t in tensors if not t.weight.expert),
        expert_bytes=sum(t.nbytes for t in tensors if t.weight.expert))
