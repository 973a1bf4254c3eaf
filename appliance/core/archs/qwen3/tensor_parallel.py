"""What one tensor-parallel rank of a Qwen3 model holds: its slice of every parameter and of the kv group."""

from __future__ import annotations

import dataclasses
import math

from appliance.core.archs.qwen3.layout import Qwen3Layout
from appliance.core.config import ModelSpec
from appliance.core.kv_cache_spec import DTYPE_BYTES, CacheGroupSpec
from appliance.core.parallel import RankPlace, TensorSlice

# Every parameter of a checkpoint (Hugging Face names) at its full shape, and the dimension tensor parallel
# divides it along (None: every rank holds all of it). Column-parallel q/k/v and gate/up (their output rows
# split: each rank computes its heads and its slice of the MLP), row-parallel o/down (their input columns
# split: each rank's partial product is summed by an all-reduce), a vocab-parallel head (its rows split: each
# rank computes a slice of the logits, gathered once per step); the embedding and the norms are replicated.
# The runner loads, the estimate counts and the KV pools hold what this table says.

def parameters(layout: Qwen3Layout) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, full shape, dimension divided over tensor-parallel ranks or None) of every parameter."""
    lay = layout
    h, hd, inter = lay.hidden_size, lay.head_dim, lay.intermediate_size
    q, kv = lay.num_heads * hd, lay.num_kv_heads * hd
    out: list[tuple[str, tuple[int, ...], int | None]] = [
        ("model.embed_tokens.weight", (lay.vocab_size, h), None), ("model.norm.weight", (h,), None)]
    if not lay.tie_word_embeddings:
        out.append(("lm_head.weight", (lay.vocab_size, h), 0))
    for i in range(lay.num_layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,), None),
            (p + "self_attn.q_proj.weight", (q, h), 0),
            (p + "self_attn.k_proj.weight", (kv, h), 0),
            (p + "self_attn.v_proj.weight", (kv, h), 0),
            (p + "self_attn.o_proj.weight", (h, q), 1),
            (p + "self_attn.q_norm.weight", (hd,), None),
            (p + "self_attn.k_norm.weight", (hd,), None),
            (p + "post_attention_layernorm.weight", (h,), None),
            (p + "mlp.gate_proj.weight", (inter, h), 0),
            (p + "mlp.up_proj.weight", (inter, h), 0),
            (p + "mlp.down_proj.weight", (h, inter), 1),
        ]
    return out


def held_slices(layout: Qwen3Layout, place: RankPlace) -> dict[str, TensorSlice | None]:
    """What `place` holds of each parameter: its slice of the divided ones (heads, MLP columns, vocab rows)."""
    return {name: None if dim is None or place.tensor == 1 else place.tensor_slice(dim, shape[dim])
            for name, shape, dim in parameters(layout)}


def rank_weight_bytes(layout: Qwen3Layout, place: RankPlace) -> int:
    """Checkpoint bytes `place` loads: the parameters table, each divided one at its slice."""
    shapes = {name: shape for name, shape, _ in parameters(layout)}
    return DTYPE_BYTES[layout.dtype] * sum(
        math.prod(shapes[name] if s is None else s.shape_of(shapes[name]))
        for name, s in held_slices(layout, place).items())


def rank_cache_groups(model: ModelSpec[Qwen3Layout], place: RankPlace) -> tuple[CacheGroupSpec, ...]:
    """The kv group as one rank stores it: only its kv heads, so its rows (and page bytes) are 1/tensor wide."""
    return tuple(dataclasses.replace(g, row_width=g.row_width // place.tensor) for g in model.cache_groups)
