"""How a Hugging Face Qwen3 config.json maps onto model.layout, and the cache group a finished layout needs."""

from __future__ import annotations

from typing import Any

from appliance.core.archs.hf_config import HfConfigError, HfLayout, dtype_of, plain_rope_theta, read
from appliance.core.archs.qwen3.layout import KV

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
