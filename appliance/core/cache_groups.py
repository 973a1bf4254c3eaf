"""Cache groups derived from the model YAML's declarations (CacheGroupSettings) and the typed layout: which layers
each group covers and how many pages a sequence needs (CacheGroupSpec, appliance.core.kv_cache_spec).

Domain logic on typed values, so the composer only converts YAML and any caller (tests, tools) derives the same
specs; every fault is a ConfigIssue naming its key path (model.cache_groups[i]...).
"""

from __future__ import annotations

from typing import Any

from appliance.core.checks import Checker
from appliance.core.config import Layout
from appliance.core.kv_cache_spec import (
    FULL,
    RING,
    CacheGroupSettings,
    CacheGroupSpec,
    LayerSelector,
    full_history_blocks,
    ring_blocks,
)

GROUPS_PATH = "model.cache_groups"


def select_layers(c: Checker, path: str, selector: LayerSelector, num_layers: int,
                  ratios: tuple[int, ...]) -> tuple[int, ...] | None:
    """The layer ids a selector names ("all", {compress_ratio: R}, [ids]); None (and an issue) when it names none."""
    if selector == "all":
        return tuple(range(num_layers))
    if isinstance(selector, dict):
        if set(selector) != {"compress_ratio"}:
            c.fail(path, selector, "a layer selector dict has exactly one key, compress_ratio")
            return None
        ratio = selector["compress_ratio"]
        chosen = tuple(i for i, r in enumerate(ratios) if r == ratio and ratio != 0)
        if not chosen:
            c.fail(f"{path}.compress_ratio", ratio,
                   f"no main layer has this compress ratio (the layout has {sorted(set(r for r in ratios if r))})")
            return None
        return chosen
    if isinstance(selector, (list, tuple)):
        ids = list(selector)
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < num_layers]
        if bad:
            c.fail(path, ids, f"layer ids must be in [0, {num_layers}); bad: {bad}")
            return None
        if not c.check(len(set(ids)) == len(ids) and bool(ids), path, ids, "layer ids must be non-empty and unique"):
            return None
        return tuple(sorted(ids))
    c.fail(path, selector, "must be 'all', {compress_ratio: R} or a list of layer ids")
    return None


def ring_span_tokens(c: Checker, path: str, group: CacheGroupSettings, layout: Layout) -> int | None:
    """The tokens a ring group's span covers: a span the layout names (sliding_window), or the compress ratio of
    the group's layers."""
    spans = layout.ring_spans()
    if group.ring_span == "compress_ratio":
        layers: Any = group.layers
        if c.check(isinstance(layers, dict) and "compress_ratio" in layers, f"{path}.ring_span", group.ring_span,
                   "ring_span=compress_ratio needs a layers selector {compress_ratio: R}"):
            return int(layers["compress_ratio"])
        return None
    if group.ring_span in spans:
        return spans[group.ring_span]
    named = " or ".join([*spans, "compress_ratio"])
    c.fail(f"{path}.ring_span", group.ring_span, f"a ring group needs ring_span: {named} (a span the layout "
                                                 f"names, or the compress ratio of the group's layers)")
    return None


def derive_cache_groups(c: Checker, groups: tuple[CacheGroupSettings, ...], layout: Layout,
                        max_model_len: int) -> tuple[CacheGroupSpec, ...]:
    """Every declared group's spec (issues into `c`); a full-history group's pages cover max_model_len (one page
    when max_model_len is not positive: the composer reports that itself)."""
    if not c.check(len(groups) > 0, GROUPS_PATH, [], "a model needs at least one cache group"):
        return ()
    ratios = layout.main_layer_ratios
    seen: set[str] = set()
    specs: list[CacheGroupSpec] = []
    for gi, group in enumerate(groups):
        p = f"{GROUPS_PATH}[{gi}]"
        c.check(group.name not in seen, f"{p}.name", group.name, "duplicate cache group name")
        seen.add(group.name)
        ok = c.one_of(f"{p}.history", group.history, (RING, FULL))
        ok &= c.positive_int(f"{p}.rows_per_block", group.rows_per_block)
        ok &= c.positive_int(f"{p}.tokens_per_row", group.tokens_per_row)
        ok &= c.positive_int(f"{p}.row.width", group.row.width)
        ok &= c.non_negative(f"{p}.row.extra_bytes", group.row.extra_bytes)
        ok &= c.dtype(f"{p}.row.dtype", group.row.dtype)
        layer_ids = select_layers(c, f"{p}.layers", group.layers, layout.num_layers, ratios)
        if not ok or layer_ids is None:
            continue
        if not c.check(layout.block_size % group.tokens_per_row == 0, f"{p}.tokens_per_row", group.tokens_per_row,
                       f"must divide model.layout.block_size ({layout.block_size})"):
            continue
        tokens_per_page = group.rows_per_block * group.tokens_per_row
        span, aligned = 0, False
        if group.history == FULL:
            if not c.check(tokens_per_page == layout.block_size, f"{p}.rows_per_block", group.rows_per_block,
                           f"a full-history page must cover one block: rows_per_block x tokens_per_row "
                           f"({tokens_per_page}) must equal model.layout.block_size ({layout.block_size})"):
                continue
            max_blocks = full_history_blocks(max_model_len, layout.block_size) if max_model_len > 0 else 1
        else:
            found = ring_span_tokens(c, p, group, layout)
            if found is None:
                continue
            span, aligned = found, group.ring_aligned
            max_blocks = ring_blocks(span, layout.tokens_in_flight, tokens_per_page, aligned)
        specs.append(CacheGroupSpec(
            name=group.name, layer_ids=layer_ids, rows_per_block=group.rows_per_block,
            tokens_per_row=group.tokens_per_row, row_dtype=group.row.dtype, row_width=group.row.width,
            row_extra_bytes=group.row.extra_bytes, history=group.history, max_blocks_per_seq=max_blocks,
            ring_span_tokens=span, ring_aligned=aligned,
        ))
    return tuple(specs)
