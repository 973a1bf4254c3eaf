"""Rules of arch qwen3: one full-history group `kv` over every layer, holding K and V of every kv head."""

from __future__ import annotations

from typing import Any

from appliance.core.archs.hf_config import HfConfigError, HfLayout, dtype_of, plain_rope_theta, read
from appliance.core.config import ModelSpec
from appliance.core.errors import ConfigIssue

KV = "kv"
HF_ARCHITECTURES = ("Qwen3ForCausalLM",)

# config.json keys of a Hugging Face Qwen3 checkpoint -> the layout keys they must agree with.
CONFIG_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "tie_word_embeddings": "tie_word_embeddings",
}


# What transformers' Qwen3Config assumes for a key config.json leaves out.
HF_DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
               "num_attention_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
               "max_position_embeddings": 32768}
DEFAULT_BLOCK_SIZE = 16


def layout_from_hf_config(cfg: dict[str, Any]) -> HfLayout:
    """model.layout from a Hugging Face Qwen3 config.json (plain RoPE, no sliding window)."""
    if cfg.get("use_sliding_window"):
        raise HfConfigError("use_sliding_window", "true is not supported (every layer attends to the full history)")
    from_file = {key: (file_key, read(cfg, file_key, HF_DEFAULTS.get(file_key)))
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


def validate(model: ModelSpec) -> list[ConfigIssue]:
    lay, groups = model.layout, model.cache_groups
    if len(groups) != 1 or groups[0].name != KV:
        return [ConfigIssue("model.cache_groups", [g.name for g in groups],
                            f"arch qwen3 needs exactly one cache group, named {KV!r}")]
    spec, p = groups[0], "model.cache_groups[0]"
    issues = []
    if lay.intermediate_size is None:
        issues.append(ConfigIssue("model.layout.intermediate_size", None, "arch qwen3 needs its dense MLP width"))
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
