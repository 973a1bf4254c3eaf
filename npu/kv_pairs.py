"""The kv-pairs layout of a bfloat16 KV pool on a CPU: each page keeps its K as dimension pairs across its keys and its
V as key pairs across its dimensions, the order the AVX512-BF16 attention kernels compute in, so they read pages as
they lie instead of reordering every page on every read.

Why: `_mm512_dpbf16_ps` multiplies pairs of bfloat16. The decode kernel's scores want 16 keys' dimension pair w in
one vector, and its P.V wants dimension d of two keys in one word; in the rows layout (a token's K row, then the next
token's) each 16-key block was transposed (K) and interleaved (V) per kv head on every decode step, although a token
is written once and read by every later step. Moving that to the write, in a 12 x 1024 bf16 model's decode steps (64
rows x 192-222 tokens, 16 / 4 heads x 64, 2 threads, AMD EPYC Zen 4; two runners taking steps in turn in one process,
bench/ab_kv_layout.py): 0.68-0.96 -> 0.65-0.74 ms per layer call over three runs, the step 1-2.5% shorter (1.27 ->
0.78 ms when the kernel still requested its next page into L1; BENCHMARKS "The decode attention on the AMD EPYC").

The layout: the pool's shape, size and pages are the rows layout's ([layers, pages, block_size, 2 x kv_heads x
head_dim]; one layer's planes [2 x pages, block_size, kv_heads x head_dim], page p's K plane at 2p and its V plane
at 2p + 1); only the order of a plane's elements differs (npu/kernels/kv_pairs.cpp has the word maps, to_rows and
to_pairs here the same as torch views). Everything that reads the pool's values reads it in this layout: the paged
decode kernel (npu.paged_attention_cpu, pairs=True) and the paged prefill kernel (npu.prefill_attention_cpu,
pairs=True); zeroing, page tables and the prefix cache handle whole pages and do not see it.

Where it applies (kv_pairs_writer): a CPU runner in bfloat16, the kernels built for a CPU with AVX512-BF16, head_dim
64 or 128, block_size a multiple of 16, and no AMX (there the decode kernel's tile path reads K rows as they lie, and
runs faster than this). APPLIANCE_CPU_KV_LAYOUT=rows keeps the rows layout; =pairs asks for this one with AMX too.
The runner takes it only where both attention kernels run (it has no gather path for it).
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Literal, cast

import torch

from appliance.core.errors import EnvironmentSettingError
from npu.cpu_kernels import amx_granted, kernels_for, ptr

log = logging.getLogger("npu.kv_pairs")

LAYOUT_SWITCH = "APPLIANCE_CPU_KV_LAYOUT"
KVLayout = Literal["pairs", "rows"]
HEAD_DIMS = (64, 128)          # what the decode kernel's pairs path is compiled for


def asked_layout() -> KVLayout | None:
    """$APPLIANCE_CPU_KV_LAYOUT, checked: None when unset (the measured default)."""
    chosen = os.environ.get(LAYOUT_SWITCH) or None
    if chosen not in (None, "pairs", "rows"):
        raise EnvironmentSettingError(f"{LAYOUT_SWITCH}={chosen!r}: expected pairs or rows (unset it for the "
                                      f"measured default)")
    return cast(KVLayout | None, chosen)


def pairs_refused(lib: ctypes.CDLL, dtype: torch.dtype, head_dim: int, block_size: int) -> str | None:
    """Why the kernels cannot write or read this pool in the kv-pairs layout, or None: the one check the writer and
    both attention kernels make."""
    lib.kv_pairs_layout.restype = ctypes.c_int
    return ("the kernels are built without AVX512-BF16" if not lib.kv_pairs_layout()
            else f"it holds bfloat16, not {dtype}" if dtype != torch.bfloat16
            else f"head_dim {head_dim} is not 64 or 128" if head_dim not in HEAD_DIMS
            else f"block_size {block_size} is not a multiple of 16" if block_size % 16
            else None)


class KVPairsWriter:
    """Writes a step's K and V rows into a pool in the kv-pairs layout (what rows.index_put_ does in the rows one)."""

    def __init__(self, lib: ctypes.CDLL, num_kv_heads: int, head_dim: int, block_size: int):
        refused = pairs_refused(lib, torch.bfloat16, head_dim, block_size)
        if refused:
            raise ValueError(f"kv-pairs layout: {refused}")
        self.num_kv_heads, self.head_dim, self.block_size = num_kv_heads, head_dim, block_size
        self.fn = lib.kv_pairs_write_bf16
        self.fn.restype = None

    def __call__(self, pool: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor, checked: bool = False) -> None:
        """pool: contiguous bfloat16, any shape whose rows are kv_heads x head_dim; rows [tokens, 2] int64: each
        token's K row and V row in the pool seen as [rows, kv_heads x head_dim] (K rows in even planes of
        block_size rows, V rows in odd ones); kv [tokens, 2 x kv_heads x head_dim] bfloat16, K then V, rows at
        any stride. `checked`: the caller has range-checked the rows (the runner's come from checked page ids)."""
        half = self.num_kv_heads * self.head_dim
        tokens = rows.shape[0]
        if (pool.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16 or not pool.is_contiguous()
                or rows.dtype != torch.int64 or rows.shape != (tokens, 2) or kv.shape != (tokens, 2 * half)
                or kv.stride(1) != 1 or pool.numel() % (2 * self.block_size * half)):
            raise ValueError(f"kv-pairs write: pool {tuple(pool.shape)} {pool.dtype}, rows {tuple(rows.shape)} "
                             f"{rows.dtype}, kv {tuple(kv.shape)} {kv.dtype} stride {kv.stride()} do not fit "
                             f"{self.num_kv_heads} kv heads x {self.head_dim}, block_size {self.block_size}")
        if tokens == 0:
            return
        if not checked:
            low, high = (int(v) for v in torch.aminmax(rows))
            planes = pool.numel() // (self.block_size * half)
            if low < 0 or high >= pool.numel() // half or (rows // self.block_size % 2 != torch.arange(2)).any():
                raise ValueError(f"kv-pairs write: rows in [{low}, {high}] for a pool of {planes} planes of "
                                 f"{self.block_size} rows (K rows in even planes, V rows in odd ones)")
        rows = rows.contiguous()
        self.fn(ptr(pool), ptr(rows), ptr(kv), ctypes.c_int64(tokens), ctypes.c_int64(kv.stride(0)),
                ctypes.c_int64(self.num_kv_heads), ctypes.c_int64(self.head_dim), ctypes.c_int64(self.block_size),
                ctypes.c_int(torch.get_num_threads()))


def kv_pairs_writer(device: torch.device, dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                    block_size: int) -> KVPairsWriter | None:
    """The writer where the kv-pairs layout applies to a runner's pool (module docstring), else None (logged)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    asked = asked_layout()
    if asked == "rows":
        log.info("KV pool in the rows layout (%s=rows)", LAYOUT_SWITCH)
        return None
    lib = kernels_for(device, dtype, "KV pool in the rows layout")
    if lib is None:
        return None
    why = (pairs_refused(lib, dtype, head_dim, block_size)
           or ("the decode kernel's AMX tiles read the rows layout" if asked is None and amx_granted(lib) else None))
    if why is not None:
        log.info("KV pool in the rows layout: %s", why)
        return None
    log.info("KV pool in the kv-pairs layout (%s)", "asked for" if asked else "AVX512-BF16 without AMX")
    return KVPairsWriter(lib, num_kv_heads, head_dim, block_size)


def to_rows(planes: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """A copy of kv-pairs planes [2 x pages, block_size, kv_heads x head_dim] in the rows layout (same shape)."""
    pages, block = planes.shape[0] // 2, planes.shape[1]
    both = planes.view(pages, 2, num_kv_heads, block * head_dim)
    k = both[:, 0].view(pages, num_kv_heads, head_dim // 2, block, 2).permute(0, 3, 1, 2, 4)
    v = both[:, 1].view(pages, num_kv_heads, block // 2, head_dim, 2).permute(0, 2, 4, 1, 3)
    return torch.stack((k.reshape(pages, block, -1), v.reshape(pages, block, -1)), 1).view(planes.shape)


def to_pairs(planes: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """A copy of rows-layout planes [2 x pages, block_size, kv_heads x head_dim] in the kv-pairs layout."""
    pages, block = planes.shape[0] // 2, planes.shape[1]
    both = planes.view(pages, 2, block, num_kv_heads, head_dim)
    k = both[:, 0].view(pages, block, num_kv_heads, head_dim // 2, 2).permute(0, 2, 3, 1, 4)
    v = both[:, 1].view(pages, block // 2, 2, num_kv_heads, head_dim).permute(0, 3, 1, 4, 2)
    return torch.stack((k.reshape(pages, -1), v.reshape(pages, -1)), 1).view(planes.shape)
