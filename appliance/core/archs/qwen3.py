"""Rules of arch qwen3: one full-history group `kv` over every layer, holding K and V of every kv head."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from appliance.core.archs.hf_config import HfConfigError, HfLayout, dtype_of, plain_rope_theta, read
from appliance.core.config import Layout, ModelSpec, ParallelSettings
from appliance.core.errors import ConfigIssue
from appliance.core.kv_cache_spec import DTYPE_BYTES, CacheGroupSpec
from appliance.core.parallel import RankPlace, TensorSlice

KV = "kv"


@dataclass(frozen=True, kw_only=True)
class Qwen3Layout(Layout):
    """Qwen3: plain attention over every layer, then a dense MLP."""

    intermediate_size: int                 # dense MLP width

HF_ARCHITECTURES = ("Qwen3ForCausalLM",)
HF_MODEL_TYPES = ("qwen3",)

# config.json keys of a Hugging Face Qwen3 checkpoint -> the layout keys they must agree with.
CONFIG_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "tie_word_embeddings": "tie_word_embeddings",
}


# The optional keys: what transformers' Qwen3Config assumes when config.json leaves them out. Every other
# CONFIG_KEYS key sets a shape and is required (transformers always writes it; a guessed 4096 would only fail
# later, at the first tensor). num_key_value_heads defaults to num_attention_heads, rope_theta to 10000.
HF_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 32768}

# The kinds of the config.json keys read besides CONFIG_KEYS (those have model.layout's kinds).
HF_VALUE_KINDS = {"max_position_embeddings": int, "use_sliding_window": bool, "rope_scaling": dict,
                  "rope_parameters": dict, "dtype": str, "torch_dtype": str}
DEFAULT_BLOCK_SIZE = 16


def layout_from_hf_config(cfg: dict[str, Any]) -> HfLayout:
    """model.layout from a Hugging Face Qwen3 config.json (plain RoPE, no sliding window)."""
    if cfg.get("use_sliding_window"):
        raise HfConfigError("use_sliding_window", "true is not supported (every layer attends to the full history)")
    from_file = {key: (file_key, read(cfg, file_key, HF_DEFAULTS.get(file_key, ...)))
                 for file_key, key in CONFIG_KEYS.items() if file_key not in ("rope_theta", "num_key_value_heads")}
    from_file["num_kv_heads"] = ("num_key_value_heads", read(cfg, "num_key_value_heads", from_file["num_heads"][1]))
    from_file["rope_theta"] = plain_rope_theta(cfg, 10000.0)
    from_file["max_model_len_cap"] = ("max_position_embeddings",
                                      read(cfg, "max_position_embeddings", HF_DEFAULTS["max_position_embeddings"]))
    from_file["dtype"] = dtype_of(cfg)
    return HfLayout(from_file, {"block_size": DEFAULT_BLOCK_SIZE})


def cache_groups_for(layout: dict[str, Any]) -> list[dict[str, Any]]:
    """The one group qwen3 needs: K and V of every kv head of every layer, one row per token, full history."""
    return [{"name": KV, "layers": "all", "rows_per_block": layout["block_size"], "history": "full",
             "row": {"dtype": layout["dtype"], "width": 2 * layout["num_kv_heads"] * layout["head_dim"]}}]


def layout_rules(lay: Qwen3Layout) -> list[ConfigIssue]:
    if lay.intermediate_size > 0:
        return []
    return [ConfigIssue("model.layout.intermediate_size", lay.intermediate_size, "must be a positive integer")]


def validate(model: ModelSpec[Qwen3Layout]) -> list[ConfigIssue]:
    lay, groups = model.layout, model.cache_groups
    if len(groups) != 1 or groups[0].name != KV:
        return [ConfigIssue("model.cache_groups", [g.name for g in groups],
                            f"arch qwen3 needs exactly one cache group, named {KV!r}")]
    spec, p = groups[0], "model.cache_groups[0]"
    issues = []
    if spec.layer_ids != tuple(range(lay.num_layers)):
        issues.append(ConfigIssue(f"{p}.layers", list(spec.layer_ids), "arch qwen3 keeps K/V of every layer: 'all'"))
    if spec.history != "full":
        issues.append(ConfigIssue(f"{p}.history", spec.history, "arch qwen3 keeps the full history: 'full'"))
    if spec.tokens_per_row != 1:
        issues.append(ConfigIssue(f"{p}.tokens_per_row", spec.tokens_per_row, "arch qwen3 stores one row per token"))
    if spec.rows_per_block != lay.block_size:
        issues.append(ConfigIssue(f"{p}.rows_per_block", spec.rows_per_block,
                                  f"must equal model.layout.block_size ({lay.block_size})"))
    width = 2 * lay.num_kv_heads * lay.head_dim
    if spec.row_width != width:
        issues.append(ConfigIssue(f"{p}.row.width", spec.row_width,
                                  f"must be 2 x num_kv_heads x head_dim = {width} (K then V of every kv head)"))
    if spec.row_extra_bytes:
        issues.append(ConfigIssue(f"{p}.row.extra_bytes", spec.row_extra_bytes, "arch qwen3 rows have no extra bytes"))
    if not spec.row_dtype.startswith(("float", "bfloat")):
        issues.append(ConfigIssue(f"{p}.row.dtype", spec.row_dtype, "arch qwen3 stores K/V in a floating dtype"))
    return issues


# -- tensor parallel ------------------------------------------------------------------------------------
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


def parallel_issues(layout: Qwen3Layout, parallel: ParallelSettings) -> list[ConfigIssue]:
    """Tensor parallel splits heads, kv heads and the MLP evenly: the size must divide each."""
    tp, issues = parallel.tensor_parallel_size, []
    for key in ("num_heads", "num_kv_heads", "intermediate_size"):
        value = getattr(layout, key)
        if tp > 1 and isinstance(value, int) and value % tp:
            issues.append(ConfigIssue("parallel.tensor_parallel_size", tp,
                                      f"must divide model.layout.{key} ({value}): each rank holds an equal share"))
    return issues
