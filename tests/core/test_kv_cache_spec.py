"""CacheGroupSpec.live_logical_pages from first principles: the pages holding the tokens a group must keep after
n computed tokens (every token for a full history; the last ring_history_tokens for a ring), computed here by
listing those tokens, for every n and for one-token as well as multi-token pages."""

import pytest

from appliance.core.kv_cache_spec import CacheGroupSpec


def spec(history, rows, span=0, aligned=False):
    return CacheGroupSpec(name=history, layer_ids=(0,), rows_per_block=rows, tokens_per_row=1, row_dtype="float32",
                          row_width=8, row_extra_bytes=0, history=history, max_blocks_per_seq=64,
                          ring_span_tokens=span, ring_aligned=aligned)


def pages_holding(tokens: range, tokens_per_page: int) -> range:
    pages = sorted({t // tokens_per_page for t in tokens})
    return range(pages[0], pages[-1] + 1) if pages else range(0)


@pytest.mark.parametrize("rows", [1, 4])
def test_a_full_history_keeps_every_page_so_far(rows):
    s = spec("full", rows)
    for n in range(0, 40):
        assert s.live_logical_pages(n) == pages_holding(range(n), rows), n


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("aligned", [False, True])
def test_a_ring_keeps_the_pages_of_its_last_history_tokens(rows, aligned):
    """A window of 4 reaches 3 tokens back; an aligned span (a compressor's run) keeps all 4."""
    s = spec("ring", rows, span=4, aligned=aligned)
    keep = 4 if aligned else 3
    for n in range(0, 40):
        assert s.live_logical_pages(n) == pages_holding(range(max(0, n - keep), n), rows), n
