"""Rules of arch deepseek_v4 (DeepSeek-V4 as released): one latent KV head, two compress ratios, and the seven
cache groups with the layers, tokens per row and widths the runner's math reads. Every issue names its key path."""

from __future__ import annotations

from appliance.core.archs.deepseek_v4.layout import EXPERT_DTYPES, SCORING_FUNCS, DeepseekV4Layout, compress_ratios
from appliance.core.checks import Checker
from appliance.core.config import ModelSpec
from appliance.core.errors import ConfigIssue
from appliance.core.kv_cache_spec import DTYPE_BYTES, CacheGroupSpec


def group_roles(model: ModelSpec[DeepseekV4Layout], csa: int, hca: int) -> dict[str, tuple[tuple[int, ...], int, int]]:
    """Cache group name -> (layers, tokens per row, least row width) the runner needs. A compressor state row
    holds a token's kv and score (gate + position bias), each as wide as the compressor: head_dim for HCA,
    2 x head_dim for the overlapping CSA compressor and 2 x index_head_dim for the indexer's."""
    lay, ratios = model.layout, model.main_layer_ratios
    d, di = lay.head_dim, lay.index_head_dim
    layers_of = lambda r: tuple(i for i, x in enumerate(ratios) if x == r)  # noqa: E731
    return {
        "ori": (tuple(range(len(ratios))), 1, d),
        f"cmp_c{hca}": (layers_of(hca), hca, d),
        f"cmp_c{csa}": (layers_of(csa), csa, d),
        "idx": (layers_of(csa), csa, di),
        "hca_state": (layers_of(hca), 1, 2 * d),
        "csa_state": (layers_of(csa), 1, 4 * d),
        "csa_inner_state": (layers_of(csa), 1, 4 * di),
    }


def _layout_issues(lay: DeepseekV4Layout) -> list[ConfigIssue]:
    """The model as released needs these keys, with values its math can run."""
    issues = []

    def need(key: str, ok: bool, rule: str) -> None:
        if not ok:
            issues.append(ConfigIssue(f"model.layout.{key}", getattr(lay, key), rule))

    def positive(key: str) -> bool:
        value = getattr(lay, key)
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        need(key, ok, "arch deepseek_v4 needs it: a positive integer")
        return ok

    if lay.num_kv_heads != 1:
        need("num_kv_heads", False, "arch deepseek_v4 keeps one latent KV row per token (MQA): must be 1")
    need("tokens_in_flight", lay.tokens_in_flight > 0, "arch deepseek_v4 bounds a step's chunk by it: must be > 0")
    sizes = {k: positive(k) for k in ("q_lora_rank", "qk_rope_head_dim", "o_groups", "o_lora_rank", "num_experts",
                                      "num_experts_per_tok", "moe_intermediate_size", "hc_mult")}
    need("swiglu_limit", lay.swiglu_limit > 0,
         "arch deepseek_v4 clamps its experts' inputs: needs a limit > 0 (10.0 as released)")
    if sizes["qk_rope_head_dim"]:
        rope = lay.qk_rope_head_dim
        need("qk_rope_head_dim", rope % 2 == 0 and rope <= lay.head_dim and rope <= lay.index_head_dim,
             f"RoPE rotates pairs of the trailing channels of a head ({lay.head_dim}) and of an indexer head "
             f"({lay.index_head_dim}): must be even and fit both")
    if sizes["o_groups"]:
        need("o_groups", lay.num_heads * lay.head_dim % lay.o_groups == 0,
             f"must divide num_heads x head_dim ({lay.num_heads * lay.head_dim})")
    if sizes["num_experts"] and sizes["num_experts_per_tok"]:
        need("num_experts_per_tok", lay.num_experts_per_tok <= lay.num_experts,
             f"must be <= model.layout.num_experts ({lay.num_experts})")
    need("num_shared_experts", lay.num_shared_experts == 1, "arch deepseek_v4 has one shared expert per layer")
    need("num_hash_layers", 0 <= lay.num_hash_layers <= lay.num_layers,
         f"must be in [0, num_layers = {lay.num_layers}]")
    need("scoring_func", lay.scoring_func in SCORING_FUNCS, f"must be one of {list(SCORING_FUNCS)}")
    need("compress_rope_theta", lay.compress_rope_theta > 0,
         "arch deepseek_v4 needs the RoPE base of its compressed layers (> 0)")
    need("yarn_original_max_position_embeddings",
         (lay.yarn_factor is None) == (lay.yarn_original_max_position_embeddings is None),
         "YaRN needs both model.layout.yarn_factor and model.layout.yarn_original_max_position_embeddings")
    need("expert_dtype", lay.expert_dtype in (None, *EXPERT_DTYPES), f"must be null or one of {list(EXPERT_DTYPES)}")
    need("quant_block_size", lay.quant_block_size is None or lay.quant_block_size > 0, "must be null or > 0")
    if lay.expert_dtype == "fp8":
        need("quant_block_size", lay.quant_block_size is not None,
             "FP8 experts use the linears' block scales: set model.layout.quant_block_size")
    if lay.expert_dtype == "fp4" and sizes["moe_intermediate_size"]:
        need("expert_dtype", lay.hidden_size % 32 == 0 and lay.moe_intermediate_size % 32 == 0,
             f"FP4 experts keep one scale per 32 values of a row: hidden_size ({lay.hidden_size}) and "
             f"moe_intermediate_size ({lay.moe_intermediate_size}) must be multiples of 32")
    mtp_ratios = list(lay.compress_ratios[lay.num_layers:])
    need("compress_ratios", not any(mtp_ratios),
         f"MTP layers attend through the sliding window only (ratio 0), as released; got {mtp_ratios}")
    return issues


def layout_rules(lay: DeepseekV4Layout) -> list[ConfigIssue]:
    """The layout rules the cache groups derive from (checked before they are): window and indexer sizes, and
    one compress ratio per layer (main then MTP), each dividing the block size."""
    c = Checker()
    for key in ("sliding_window", "index_head_dim", "index_num_heads", "index_topk"):
        c.positive_int(f"model.layout.{key}", getattr(lay, key))
    c.non_negative("model.layout.num_mtp_layers", lay.num_mtp_layers)
    ratios = lay.compress_ratios
    expected = lay.num_layers + lay.num_mtp_layers
    c.check(len(ratios) == expected, "model.layout.compress_ratios", list(ratios),
            f"must have num_layers + num_mtp_layers = {expected} entries, has {len(ratios)} "
            f"(is a tiny layout mixed with a full one?)")
    bad_ratio_layers: dict[int, list[int]] = {}
    for i, r in enumerate(ratios):
        if c.check(r >= 0, f"model.layout.compress_ratios[{i}]", r, "must be an integer >= 0"):
            if r > 0 and lay.block_size > 0 and lay.block_size % r:
                bad_ratio_layers.setdefault(r, []).append(i)
    for r, layers in bad_ratio_layers.items():
        c.fail(f"model.layout.compress_ratios[{layers[0]}]", r,
               f"must divide model.layout.block_size ({lay.block_size}); layers with this ratio: {layers}")
    return c.issues


def _row_format_issues(spec: CacheGroupSpec, path: str, name: str) -> list[ConfigIssue]:
    """Rows the runner stores: floating values, or int8 / float8 values with an fp32 scale in 4 extra bytes."""
    dtype = spec.row_dtype
    one_byte = DTYPE_BYTES[dtype] == 1
    if one_byte and not (dtype == "int8" or dtype.startswith("float8_e")):
        return [ConfigIssue(f"{path}.row.dtype", dtype, f"group {name!r}: 1-byte rows are int8 or float8_e4m3fn "
                                                        f"(with an fp32 scale), or use a floating dtype")]
    if not one_byte and not dtype.startswith(("float", "bfloat")):
        return [ConfigIssue(f"{path}.row.dtype", dtype, f"group {name!r}: rows are floating, or int8 / "
                                                        f"float8_e4m3fn with an fp32 scale")]
    if one_byte and spec.row_extra_bytes != 4:
        return [ConfigIssue(f"{path}.row.extra_bytes", spec.row_extra_bytes,
                            f"{dtype} rows of group {name!r} need 4 extra bytes for their fp32 scale")]
    return []


def validate(model: ModelSpec[DeepseekV4Layout]) -> list[ConfigIssue]:
    lay = model.layout
    issues = _layout_issues(lay)
    ratios = compress_ratios(lay)
    if ratios is None:
        issues.append(ConfigIssue("model.layout.compress_ratios", list(lay.compress_ratios),
                                  "arch deepseek_v4 needs exactly two nonzero ratios (CSA = smallest, HCA = largest)"))
    if issues or ratios is None:
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
        issues += _row_format_issues(spec, p, name)
    return issues
