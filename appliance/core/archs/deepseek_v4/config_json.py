"""How a DeepSeek V4 checkpoint's config.json maps onto model.layout.

config.json comes in two spellings, both read: the released one (`compress_ratios`, `num_hash_layers`,
`qk_rope_head_dim`, `rope_scaling`, `compress_rope_theta`, `quantization_config`, `expert_dtype`) and the one
transformers' DeepseekV4Config writes (`layer_types` + `compress_rates`, `mlp_layer_types`,
`partial_rotary_factor`, `rope_parameters.{main,compress}`).
"""

from __future__ import annotations

from typing import Any

from appliance.core.archs.deepseek_v4.layout import DeepseekV4Layout
from appliance.core.archs.hf_config import HfConfigError, HfLayout, check_layout_kinds, dtype_of, read

HF_ARCHITECTURES = ("DeepseekV4ForCausalLM",)
HF_MODEL_TYPES = ("deepseek_v4",)

# config.json key (nested keys dotted, as config_view flattens them) -> the layout key it must agree with.
CONFIG_KEYS = {
    "hidden_size": "hidden_size", "num_hidden_layers": "num_layers", "num_nextn_predict_layers": "num_mtp_layers",
    "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
    "vocab_size": "vocab_size", "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "tie_word_embeddings": "tie_word_embeddings", "sliding_window": "sliding_window",
    "compress_ratios": "main_layer_ratios", "index_head_dim": "index_head_dim", "index_n_heads": "index_num_heads",
    "index_topk": "index_topk", "q_lora_rank": "q_lora_rank", "qk_rope_head_dim": "qk_rope_head_dim",
    "o_groups": "o_groups", "o_lora_rank": "o_lora_rank", "compress_rope_theta": "compress_rope_theta",
    "rope_scaling.factor": "yarn_factor",
    "rope_scaling.original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "rope_scaling.beta_fast": "yarn_beta_fast", "rope_scaling.beta_slow": "yarn_beta_slow",
    "n_routed_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
    "n_shared_experts": "num_shared_experts", "moe_intermediate_size": "moe_intermediate_size",
    "num_hash_layers": "num_hash_layers", "scoring_func": "scoring_func",
    "routed_scaling_factor": "routed_scaling_factor", "swiglu_limit": "swiglu_limit", "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps",
    "quantization_config.weight_block_size": "quant_block_size", "expert_dtype": "expert_dtype",
}

# config.json keys whose only supported value is the released one (checked when present).
CONFIG_FIXED = {
    "hidden_act": "silu", "norm_topk_prob": True, "topk_method": "noaux_tc",
    "quantization_config.quant_method": "fp8", "quantization_config.fmt": "e4m3",
    "quantization_config.scale_fmt": "ue8m0",
}

YARN_DEFAULTS = {"factor": None, "original_max_position_embeddings": None, "beta_fast": 32, "beta_slow": 1}
HF_LAYER_TYPES = {"sliding_attention": None, "compressed_sparse_attention": "compressed_sparse_attention",
                  "heavily_compressed_attention": "heavily_compressed_attention"}
HF_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

# The optional keys: what transformers' DeepseekV4Config assumes when config.json leaves them out (config_view's
# keys); the HF_REQUIRED ones below have none.
HF_DEFAULTS = {
    "num_nextn_predict_layers": 1, "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "sliding_window": 128, "index_topk": 512,
    "compress_rope_theta": 160000.0, "rope_scaling.factor": None, "rope_scaling.original_max_position_embeddings": None,
    "rope_scaling.beta_fast": 32.0, "rope_scaling.beta_slow": 1.0,
    "n_shared_experts": 1, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "quantization_config.weight_block_size": None, "expert_dtype": None,
}
# config.json keys with no default: they set tensor shapes or the routing (transformers writes every one).
HF_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "vocab_size", "q_lora_rank",
               "qk_rope_head_dim", "o_groups", "o_lora_rank", "index_head_dim", "index_n_heads",
               "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "hc_mult")
# The kinds of the config.json keys read besides CONFIG_KEYS' top-level ones (those have model.layout's kinds).
HF_VALUE_KINDS = {"max_position_embeddings": int, "partial_rotary_factor": float, "layer_types": list[str],
                  "compress_rates": dict, "mlp_layer_types": list[str], "rope_scaling": dict,
                  "rope_parameters": dict, "quantization_config": dict, "dtype": str, "torch_dtype": str}
SERVING_DEFAULTS = {"block_size": 128, "tokens_in_flight": 256}   # two pipelined 128-token prefill tiles
MAX_MODEL_LEN_CAP = 16384                                          # full-history groups are sized up to this


def _rope_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """Thetas and YaRN from `rope_scaling` (released) or `rope_parameters.{main,compress}` (transformers)."""
    out: dict[str, Any] = {}
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main, scaling = params.get("main") or {}, params["compress"]
        if "rope_theta" in main:
            out["rope_theta"] = main["rope_theta"]
        if "rope_theta" in scaling:
            out["compress_rope_theta"] = scaling["rope_theta"]
    elif "rope_scaling" in cfg:
        scaling = cfg["rope_scaling"]
    else:
        return out
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "yarn":
        out.update({f"rope_scaling.{k}": scaling.get(k, default) for k, default in YARN_DEFAULTS.items()})
    else:
        out["rope_scaling.factor"] = None
    return out


def config_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json as the flat view CONFIG_KEYS and CONFIG_FIXED read, whichever spelling it uses."""
    view = {k: v for k, v in cfg.items() if not isinstance(v, dict) and k not in ("rope_scaling", "rope_parameters")}
    try:
        view["compress_ratios"] = hf_compress_ratios(cfg, cfg.get("num_hidden_layers"), 0)[1]
    except HfConfigError:
        pass                               # neither layer_types nor compress_ratios: nothing to check
    if "num_hash_layers" not in cfg and isinstance(cfg.get("mlp_layer_types"), list):
        types = cfg["mlp_layer_types"]
        view["num_hash_layers"] = next((i for i, t in enumerate(types) if t != "hash_moe"), len(types))
    if "qk_rope_head_dim" not in cfg and cfg.get("partial_rotary_factor") and cfg.get("head_dim"):
        rope_dim = cfg["head_dim"] * cfg["partial_rotary_factor"]
        if not float(rope_dim).is_integer():
            raise HfConfigError("partial_rotary_factor", f"{cfg['partial_rotary_factor']!r} x head_dim "
                                                         f"{cfg['head_dim']} is not a whole number of channels")
        view["qk_rope_head_dim"] = int(rope_dim)
    view.update(_rope_view(cfg))
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict):
        block = quant.get("weight_block_size")
        square = isinstance(block, list) and len(block) == 2 and block[0] == block[1]
        view["quantization_config.weight_block_size"] = block[0] if square and block is not None else block
        for key in ("quant_method", "fmt", "scale_fmt"):
            if key in quant:
                view[f"quantization_config.{key}"] = quant[key]
        if "expert_dtype" not in cfg and "expert_dtype" in quant:
            view["expert_dtype"] = quant["expert_dtype"]
    else:
        view["quantization_config.weight_block_size"] = None
    return view


def hf_compress_ratios(cfg: dict[str, Any], num_layers: int | None, num_mtp: int) -> tuple[str, list[int]]:
    """(config.json key, one ratio per main then MTP layer) from layer_types + compress_rates (transformers'
    defaults 4 and 128 for the ones it leaves out), or the released per-layer compress_ratios list (which may
    run past the main layers); MTP layers keep only the sliding window (ratio 0) unless listed."""
    legacy = cfg.get("compress_ratios")
    if cfg.get("layer_types") is not None:
        rates = {**HF_COMPRESS_RATES, **(cfg.get("compress_rates") or {})}
        bad = [t for t in cfg["layer_types"] if t not in HF_LAYER_TYPES]
        if bad:
            raise HfConfigError("layer_types", f"unknown layer types {bad}; known: {sorted(HF_LAYER_TYPES)}")
        main = [rates[t] if HF_LAYER_TYPES[t] else 0 for t in cfg["layer_types"]]
        key, tail = "layer_types", []
    elif legacy is not None:
        main, tail, key = list(legacy[:num_layers]), list(legacy[num_layers:]), "compress_ratios"
    else:
        raise HfConfigError("layer_types", "config.json needs layer_types (or the legacy compress_ratios)")
    if len(main) != num_layers:
        raise HfConfigError(key, f"has {len(main)} layers, num_hidden_layers is {num_layers}")
    return key, main + (tail + [0] * num_mtp)[:num_mtp]


def layout_from_hf_config(cfg: dict[str, Any]) -> HfLayout:
    """model.layout from a DeepSeek V4 config.json (released or transformers' spelling, read through config_view;
    a key it leaves out takes transformers' DeepseekV4Config default)."""
    view = config_view(cfg)
    from_file: dict[str, tuple[str, Any]] = {
        key: (file_key, read(view, file_key, ...) if file_key in HF_REQUIRED
              else view.get(file_key, HF_DEFAULTS.get(file_key)))
        for file_key, key in CONFIG_KEYS.items() if key != "main_layer_ratios"}
    check_layout_kinds(HfLayout(from_file), DeepseekV4Layout)
    num_layers, num_mtp = from_file["num_layers"][1], from_file["num_mtp_layers"][1]
    from_file["compress_ratios"] = hf_compress_ratios(cfg, num_layers, num_mtp)
    from_file["dtype"] = dtype_of(cfg)
    cap = min(int(read(cfg, "max_position_embeddings", 1048576)), MAX_MODEL_LEN_CAP)
    return HfLayout(from_file, {**SERVING_DEFAULTS, "max_model_len_cap": cap})
