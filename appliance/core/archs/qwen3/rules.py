"""Rules of arch qwen3: one full-history group `kv` over every layer, holding K and V of every kv head; tensor
parallel divides heads, kv heads and the MLP evenly."""

from __future__ import annotations

from appliance.core.archs.qwen3.layout import KV, Qwen3Layout
from appliance.core.config import ModelSpec, ParallelSettings
from appliance.core.errors import ConfigIssue


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


def parallel_issues(layout: Qwen3Layout, parallel: ParallelSettings) -> list[ConfigIssue]:
    """Tensor parallel splits heads, kv heads and the MLP evenly: the size must divide each."""
    tp, issues = parallel.tensor_parallel_size, []
    for key in ("num_heads", "num_kv_heads", "intermediate_size"):
        value = getattr(layout, key)
        if tp > 1 and isinstance(value, int) and value % tp:
            issues.append(ConfigIssue("parallel.tensor_parallel_size", tp,
                                      f"must divide model.layout.{key} ({value}): each rank holds an equal share"))
    return issues
