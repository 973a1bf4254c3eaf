"""DeepSeek V4's cache groups derived from a layout: the seven groups of a checkpoint served by directory, the MTP
window group speculation adds, and how many pages of a compressor-state ring one step touches."""

from __future__ import annotations

import dataclasses
from typing import Any

from appliance.core.archs.deepseek_v4.layout import MTP_WINDOW_GROUP, DeepseekV4Layout
from appliance.core.archs.hf_config import HfConfigError
from appliance.core.kv_cache_spec import CacheGroupSpec, ring_blocks

STATE_ROWS_PER_PAGE = 8       # compressor-state pages hold min(8, ratio) rows


def cache_groups_for(layout: dict[str, Any]) -> list[dict[str, Any]]:
    """The seven groups of DESIGN.md section 4 from a finished layout: conf/model/dsv4.yaml's for the Flash layout,
    except `idx`, whose rows keep the indexer keys in the layout dtype as transformers does (dsv4.yaml stores them
    as fp8 + an fp32 scale, as served releases do): a checkpoint served by directory gives transformers' tokens."""
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
        compressed("idx", csa, {"dtype": dtype, "width": di}),      # float keys, as transformers keeps them
        state("hca_state", hca, 2 * d),
        state("csa_state", csa, 4 * d),
        state("csa_inner_state", csa, 4 * di),
    ]


def state_span_pages(start: int, num_tokens: int, ratio: int, tokens_per_page: int, overlap: bool) -> int:
    """Logical pages of a compressor-state ring that one step of `num_tokens` tokens from `start` touches.

    The step writes the state rows of its own tokens and reads, for every window it completes, that
    window's rows and, with overlap, the previous window's too: window i (tokens [i r, (i + 1) r)) completes
    at token (i + 1) r - 1, so the first window it completes is start // r and the earliest row it reads is
    (start // r - overlap) r. A ring of fewer slots than this would have reused a slot the step still reads.
    """
    first_window = start // ratio
    ends = (start + num_tokens) // ratio > first_window          # the step completes at least one window
    earliest = (first_window - (1 if overlap else 0)) * ratio if ends else start
    earliest = max(earliest, 0)
    return (start + num_tokens - 1) // tokens_per_page - earliest // tokens_per_page + 1


def mtp_window_group(ori: CacheGroupSpec, layout: DeepseekV4Layout, draft_tokens: int) -> CacheGroupSpec:
    """The MTP layers' sliding-window rows (speculative.method=mtp): a ring like `ori` over the MTP layers, which
    attend through the window only. A group of its own, so that speculation off keeps `ori` as released. Its span
    reaches draft_tokens + 1 tokens further back than the window: a step writes the MTP rows of the tokens the
    previous one accepted, the first of them up to draft_tokens + 1 positions before the first token it computes
    (npu/deepseek_v4/mtp.py)."""
    mtp_layers = tuple(range(layout.num_layers, layout.num_layers + layout.num_mtp_layers))
    span = ori.ring_span_tokens + draft_tokens + 1
    return dataclasses.replace(ori, name=MTP_WINDOW_GROUP, layer_ids=mtp_layers, ring_span_tokens=span,
                               max_blocks_per_seq=ring_blocks(span, layout.tokens_in_flight, ori.tokens_per_page,
                                                              False))
