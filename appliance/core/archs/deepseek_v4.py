"""Rules of arch deepseek_v4: one latent KV head, two compress ratios (CSA smallest, HCA largest), and the
seven cache groups with the layers, tokens per row and widths the runner's math reads."""

from __future__ import annotations

from typing import Any

from appliance.core.archs.hf_config import HfConfigError, HfLayout, dtype_of, plain_rope_theta, read
from appliance.core.config import ModelSpec
from appliance.core.errors import ConfigIssue

STATE_GROUPS = ("hca_state", "csa_state", "csa_inner_state")
HF_ARCHITECTURES = ("DeepseekV4ForCausalLM",)

# config.json keys of a deepseek_v4 checkpoint -> the layout keys they must agree with (the tiny checkpoints
# write the layout under its own names).
CONFIG_KEYS = {k: k for k in (
    "hidden_size", "num_layers", "num_mtp_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
    "intermediate_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "sliding_window", "compress_ratios",
    "index_head_dim", "index_num_heads", "index_topk", "q_lora_rank", "num_experts", "num_experts_per_tok",
    "num_shared_experts", "moe_intermediate_size")}


# transformers' DeepseekV4Config key -> (layout key, the default DeepseekV4Config assumes when the key is absent).
HF_KEYS = {
    "vocab_size": ("vocab_size", 129280), "hidden_size": ("hidden_size", 4096),
    "num_hidden_layers": ("num_layers", 43), "num_attention_heads": ("num_heads", 64),
    "num_key_value_heads": ("num_kv_heads", 1), "head_dim": ("head_dim", 512), "q_lora_rank": ("q_lora_rank", 1024),
    "moe_intermediate_size": ("moe_intermediate_size", 2048), "n_routed_experts": ("num_experts", 256),
    "num_experts_per_tok": ("num_experts_per_tok", 6), "n_shared_experts": ("num_shared_experts", 1),
    "rms_norm_eps": ("rms_norm_eps", 1e-6), "tie_word_embeddings": ("tie_word_embeddings", False),
    "sliding_window": ("sliding_window", 128), "index_n_heads": ("index_num_heads", 64),
    "index_head_dim": ("index_head_dim", 128), "index_topk": ("index_topk", 512),
    "num_nextn_predict_layers": ("num_mtp_layers", 1),
}
HF_LAYER_TYPES = {"sliding_attention": None, "compressed_sparse_attention": "compressed_sparse_attention",
                  "heavily_compressed_attention": "heavily_compressed_attention"}
HF_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
SERVING_DEFAULTS = {"block_size": 128, "tokens_in_flight": 256}   # two pipelined 128-token prefill tiles
MAX_MODEL_LEN_CAP = 16384                                          # full-history groups are sized up to this
STATE_ROWS_PER_PAGE = 8                                            # compressor-state pages hold min(8, ratio) rows


def _hf_compress_ratios(cfg: dict[str, Any], num_layers: int, num_mtp: int) -> tuple[str, list[int]]:
    """(config.json key, one ratio per main then MTP layer) from layer_types + compress_rates, or the legacy
    per-layer compress_ratios list; MTP layers keep only the sliding window (ratio 0) unless listed."""
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
    """model.layout from a transformers DeepseekV4Config config.json, as far as today's layout fields reach."""
    from_file = {key: (file_key, read(cfg, file_key, default)) for file_key, (key, default) in HF_KEYS.items()}
    # transformers maps intermediate_size to moe_intermediate_size (the shared expert's width).
    from_file["intermediate_size"] = from_file["moe_intermediate_size"]
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("main"), dict):      # nested per rope type (main / compress)
        main = rope["main"]
        if main.get("rope_type", "default") != "default":
            raise HfConfigError("rope_parameters.main.rope_type", f"{main['rope_type']!r} is not supported")
        from_file["rope_theta"] = ("rope_parameters.main.rope_theta", float(main.get("rope_theta", 10000.0)))
    else:
        from_file["rope_theta"] = plain_rope_theta({k: v for k, v in cfg.items() if k != "rope_scaling"}, 10000.0)
    from_file["compress_ratios"] = _hf_compress_ratios(cfg, from_file["num_layers"][1], from_file["num_mtp_layers"][1])
    from_file["dtype"] = dtype_of(cfg)
    cap = min(int(read(cfg, "max_position_embeddings", 1048576)), MAX_MODEL_LEN_CAP)
    return HfLayout(from_file, {**SERVING_DEFAULTS, "max_model_len_cap": cap})


def cache_groups_for(layout: dict[str, Any]) -> list[dict[str, Any]]:
    """The seven groups of DESIGN.md section 4 from a finished layout (conf/model/dsv4.yaml's for the Flash layout)."""
    ratios = [r for r in layout["compress_ratios"][: layout["num_layers"]] if r]
    if len(set(ratios)) != 2:
        raise HfConfigError("layer_types", f"needs exactly two compress ratios (CSA, HCA), has {sorted(set(ratios))}")
    csa, hca = min(ratios), max(ratios)
    block, d, di, dtype = layout["block_size"], layout["head_dim"], layout["index_head_dim"], layout["dtype"]

    def compressed(name: str, ratio: int, row: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "layers": {"compress_ratio": ratio}, "rows_per_block": block // ratio,
                "tokens_per_row": ratio, "row": row, "history": "full"}

    def state(name: str, ratio: int, width: int) -> dict[str, Any]:
        return {"name": name, "layers": {"compress_ratio": ratio}, "rows_per_block": min(STATE_ROWS_PER_PAGE, ratio),
                "row": {"dtype": "float32", "width": width}, "history": "ring", "ring_span": "compress_ratio",
                "ring_aligned": True}

    return [
        {"name": "ori", "layers": "all", "rows_per_block": block, "row": {"dtype": dtype, "width": d},
         "history": "ring", "ring_span": "sliding_window"},
        compressed(f"cmp_c{hca}", hca, {"dtype": dtype, "width": d}),
        compressed(f"cmp_c{csa}", csa, {"dtype": dtype, "width": d}),
        compressed("idx", csa, {"dtype": "int8", "width": di, "extra_bytes": 4}),
        state("hca_state", hca, 2 * d),
        state("csa_state", csa, 4 * d),
        state("csa_inner_state", csa, 4 * di),
    ]


def compress_ratios(model: ModelSpec) -> tuple[int, int] | None:
    """(CSA ratio, HCA ratio) of the main layers, or None when there are not exactly two nonzero ratios."""
    nonzero = sorted({r for r in model.main_layer_ratios if r})
    return (nonzero[0], nonzero[1]) if len(nonzero) == 2 else None


def group_roles(model: ModelSpec, csa: int, hca: int) -> dict[str, tuple[tuple[int, ...], int, int]]:
    """Cache group name -> (layers, tokens per row, least row width) the runner needs."""
    lay, ratios = model.layout, model.main_layer_ratios
    d, di = lay.head_dim, lay.index_head_dim or 0
    layers_of = lambda r: tuple(i for i, x in enumerate(ratios) if x == r)  # noqa: E731
    return {
        "ori": (tuple(range(len(ratios))), 1, d),
        f"cmp_c{hca}": (layers_of(hca), hca, d),
        f"cmp_c{csa}": (layers_of(csa), csa, d),
        "idx": (layers_of(csa), csa, di),
        "hca_state": (layers_of(hca), 1, 2 * d),
        "csa_state": (layers_of(csa), 1, 2 * d),
        "csa_inner_state": (layers_of(csa), 1, 2 * di),
    }


def validate(model: ModelSpec) -> list[ConfigIssue]:
    lay = model.layout
    issues = []
    if lay.num_kv_heads != 1:
        issues.append(ConfigIssue("model.layout.num_kv_heads", lay.num_kv_heads,
                                  "arch deepseek_v4 keeps one latent KV row per token (MQA): must be 1"))
    for key in ("sliding_window", "index_head_dim", "index_num_heads", "index_topk"):
        if getattr(lay, key) is None:
            issues.append(ConfigIssue(f"model.layout.{key}", None, "arch deepseek_v4 needs it"))
    if lay.tokens_in_flight <= 0:
        issues.append(ConfigIssue("model.layout.tokens_in_flight", lay.tokens_in_flight,
                                  "arch deepseek_v4 bounds a step's chunk by it: must be > 0"))
    ratios = compress_ratios(model)
    if ratios is None:
        issues.append(ConfigIssue("model.layout.compress_ratios", list(lay.compress_ratios or ()),
                                  "arch deepseek_v4 needs exactly two nonzero ratios (CSA = smallest, HCA = largest)"))
    if issues:
        return issues
    index = {g.name: i for i, g in enumerate(model.cache_groups)}
    for name, (layers, tokens_per_row, width) in group_roles(model, *ratios).items():
        if name not in index:
            issues.append(ConfigIssue("model.cache_groups", sorted(index),
                                      f"arch deepseek_v4 needs cache group {name!r}"))
            continue
        spec, p = model.cache_groups[index[name]], f"model.cache_groups[{index[name]}]"
        if spec.layer_ids != layers:
            issues.append(ConfigIssue(f"{p}.layers", list(spec.layer_ids), f"group {name!r} must cover layers "
                                                                          f"{list(layers)}"))
        if spec.tokens_per_row != tokens_per_row:
            issues.append(ConfigIssue(f"{p}.tokens_per_row", spec.tokens_per_row,
                                      f"group {name!r} must have tokens_per_row {tokens_per_row}"))
        if spec.row_width < width:
            issues.append(ConfigIssue(f"{p}.row.width", spec.row_width, f"group {name!r} needs rows of at least "
                                                                        f"{width} values"))
        if not spec.row_dtype.startswith(("float", "bfloat")) and spec.row_extra_bytes != 4:
            issues.append(ConfigIssue(f"{p}.row.extra_bytes", spec.row_extra_bytes,
                                      f"integer rows of group {name!r} need 4 extra bytes for their fp32 scale"))
    return issues
