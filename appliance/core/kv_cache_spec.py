"""Cache-group specs: what one page of each KV-cache group holds and how many pages a sequence needs.

Each group is a frozen dataclass that knows its own page_size_bytes and max_blocks_per_seq (after
vLLM v1's kv_cache_interface). The planner and the KvCacheManager read these specs, never model code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

# Element sizes of the torch dtype names a row may use. Kept here so that planning and validation
# never import torch; tests check every entry against torch itself.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "double": 8,
    "float32": 4, "float": 4,
    "float16": 2, "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,                   # ue8m0 block scales of quantized checkpoints
    "float4_e2m1fn_x2": 1,                 # two FP4 (e2m1) values per byte
    "int64": 8, "long": 8,
    "int32": 4, "int": 4,
    "int16": 2, "short": 2,
    "int8": 1, "uint8": 1,
    "bool": 1,
}

RING = "ring"
FULL = "full"


# A cache group's layers as a model YAML selects them: "all", {compress_ratio: R}, or a list of layer ids.
LayerSelector = Union[str, dict[str, int], tuple[int, ...]]


@dataclass(frozen=True, kw_only=True)
class RowSettings:
    dtype: str
    width: int                             # elements per row
    extra_bytes: int = 0                   # e.g. a per-row fp32 scale


@dataclass(frozen=True, kw_only=True)
class CacheGroupSettings:
    """A cache group as a model YAML declares it (model.cache_groups[i]); appliance.core.cache_groups derives
    its CacheGroupSpec from the layout and max_model_len."""

    name: str
    layers: LayerSelector = "all"          # "all" | {compress_ratio: R} | [layer ids]
    rows_per_block: int                    # rows one page stores, per layer
    tokens_per_row: int = 1                # tokens summarised by one row (compression ratio for compressed KV)
    row: RowSettings
    history: str                           # ring | full
    ring_span: str | None = None           # ring groups: a span the layout names (sliding_window) | compress_ratio
    ring_aligned: bool = False             # ring starts on page boundaries (compressor states)


@dataclass(frozen=True)
class CacheGroupSpec:
    """One KV-cache group: a pool of pages, each holding `rows_per_block` rows for every layer in it."""

    name: str
    layer_ids: tuple[int, ...]
    rows_per_block: int
    tokens_per_row: int
    row_dtype: str
    row_width: int
    row_extra_bytes: int
    history: str               # ring: slots reused (logical block L -> slot L mod max_blocks_per_seq); full: append-only
    max_blocks_per_seq: int
    ring_span_tokens: int = 0  # ring groups: the window (sliding_window) or compress ratio the ring serves
    ring_aligned: bool = False # ring groups: the span restarts on page boundaries (compressor states)

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def row_bytes(self) -> int:
        return self.row_width * DTYPE_BYTES[self.row_dtype] + self.row_extra_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.num_layers * self.rows_per_block * self.row_bytes

    @property
    def tokens_per_page(self) -> int:
        return self.rows_per_block * self.tokens_per_row

    @property
    def is_ring(self) -> bool:
        return self.history == RING

    @property
    def max_memory_usage_bytes(self) -> int:
        """Bytes one sequence at max_model_len can hold in this group."""
        return self.max_blocks_per_seq * self.page_size_bytes

    def ring_slot(self, logical_block: int) -> int:
        """Slot (index into the sequence's block list) of a logical block."""
        return logical_block % self.max_blocks_per_seq if self.is_ring else logical_block

    @property
    def ring_history_tokens(self) -> int:
        """Tokens before the next one that a ring must still hold (a window of W reaches W - 1 back)."""
        return self.ring_span_tokens if self.ring_aligned else self.ring_span_tokens - 1

    def live_logical_pages(self, num_tokens: int) -> range:
        """Logical pages whose contents are needed to continue after `num_tokens` computed tokens.

        Full history: every page so far. Ring: only the tail covering ring_history_tokens; a prefix-cache
        hit for a ring group needs exactly these pages.
        """
        end = math.ceil(num_tokens / self.tokens_per_page)
        if not self.is_ring:
            return range(0, end)
        return range(max(0, num_tokens - self.ring_history_tokens) // self.tokens_per_page, end)


def full_history_blocks(max_model_len: int, block_size: int) -> int:
    """Pages of an append-only group at max_model_len: one per block_size tokens."""
    return math.ceil(max_model_len / block_size)


def ring_blocks(span_tokens: int, tokens_in_flight: int, tokens_per_page: int, aligned: bool) -> int:
    """Pages a ring must keep so that `span_tokens` of history plus the tokens in flight fit.

    A sliding window of W tokens ends at the current token, so it reaches W - 1 tokens back; such a
    span can start anywhere inside a page, hence one extra page. Compressor states restart on
    multiples of their ratio, which are page boundaries (aligned), so they need no extra page.
    """
    if aligned:
        return math.ceil((span_tokens + tokens_in_flight) / tokens_per_page)
    return math.ceil((span_tokens - 1 + tokens_in_flight) / tokens_per_page) + 1


def bytes_per_slot(specs: Sequence[CacheGroupSpec]) -> int:
    """One capacity slot: every group's max_blocks_per_seq pages (one sequence at max_model_len)."""
    return sum(s.max_memory_usage_bytes for s in specs)


def scratch_bytes(specs: Sequence[CacheGroupSpec], decode_batch: int) -> int:
    """One page per group for each padding row of a decode batch."""
    return decode_batch * sum(s.page_size_bytes for s in specs)
