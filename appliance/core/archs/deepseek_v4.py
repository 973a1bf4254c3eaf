"""Rules of arch deepseek_v4: one latent KV head, two compress ratios (CSA smallest, HCA largest), and the
seven cache groups with the layers, tokens per row and widths the runner's math reads."""

from __future__ import annotations

from appliance.core.config import ModelSpec
from appliance.core.errors import ConfigIssue

STATE_GROUPS = ("hca_state", "csa_state", "csa_inner_state")

# config.json keys of a deepseek_v4 checkpoint -> the layout keys they must agree with (the tiny checkpoints
# write the layout under its own names).
CONFIG_KEYS = {k: k for k in (
    "hidden_size", "num_layers", "num_mtp_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
    "intermediate_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "sliding_window", "compress_ratios",
    "index_head_dim", "index_num_heads", "index_topk", "q_lora_rank", "num_experts", "num_experts_per_tok",
    "num_shared_experts", "moe_intermediate_size")}


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
