"""Where a DeepSeek V4 cached page stops depending on the prompt's tokens alone: the indexer's tied scores."""

from __future__ import annotations

from appliance.core.archs.deepseek_v4.layout import DeepseekV4Layout, csa_ratio
from appliance.core.prefix_reuse import LengthDependentKv

TIE_PRONE_INDEX_HEADS = 16     # fewer indexer heads: all-zero scores, the only exact ties, are common


def length_dependent_kv(layout: DeepseekV4Layout) -> LengthDependentKv | None:
    """From the indexer's first top-k choice on, tied scores break by the prompt's length (core/prefix_reuse.py)."""
    csa = csa_ratio(layout)
    if not csa:
        return None
    heads = layout.index_num_heads
    relation = "<" if heads < TIE_PRONE_INDEX_HEADS else ">="
    return LengthDependentKv(
        (layout.index_topk + 1) * csa - 1, heads < TIE_PRONE_INDEX_HEADS,
        f"model.layout.index_num_heads={heads} {relation} {TIE_PRONE_INDEX_HEADS}: tied indexer scores are "
        f"{'likely' if relation == '<' else 'rare'}")
