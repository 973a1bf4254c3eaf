"""Decode attention over the paged KV cache on CPU, by a C++ kernel that reads pages in place.

Why: on CPU the SDPA path first gathers every decode row's pages into a dense buffer (one copy of the
whole context per layer), then SDPA reads it again; for the 64-row bf16 decode step of issue 16 the two
took 5.2 of 12.8 ms. The kernel (npu/kernels/paged_attention.cpp, built by npu.cpu_kernels) walks each
row's block table instead, as vLLM's CPU backend does in its compiled paged-attention op. With AVX-512 and
head_dim 64 or 128 it reads each row's pages once, 16 keys at a time, with an online softmax (bfloat16 dot
products by _mm512_dpbf16_ps where the CPU has them), requesting the next page's lines a few at a time while
it computes on this one: a decode step meets every layer's pages cold, and that overlap took a 64-row bf16
layer call of the 6 x 768 model from 1.26 to 0.74-0.79 ms on an AMD EPYC (the kernel's header has the
figures). Elsewhere a two-pass loop runs (scores, then P.V, a page widened to float32 once for all query heads
of a kv head); each thread keeps its scores in a torch tensor this wrapper allocates, so the startup profile
(npu.cpu_memory) sees that memory too.

In bfloat16 on a CPU with AMX (amx_applies: head_dim 64 or 128, up to 16 query heads per kv head, block_size a
multiple of 16) a second path runs instead: each task is one row's kv head, its scores K.Q^T computed on the tile
unit with K read straight from the pages, the softmax one vector per key (no reductions across a vector), and
P.V on tiles. On the 6 x 768 bf16 model at batch 64 x 193 tokens it took 0.39 against 0.73 ms per layer call,
and the decode step 11.1 against 13.4 ms (interleaved, BENCHMARKS "Prefill and decode attention on AMX").

Where it applies (paged_decode_attention): CPU runners with float32 or bfloat16 activations and pools,
when the kernels are built (npu.cpu_kernels says why not, and APPLIANCE_CPU_KERNELS=0 turns them off).
Anywhere else the runner's gather + SDPA path runs. tests/npu/test_paged_attention_cpu.py checks the kernel
against attention over gathered pages, and the runner's two paths against each other.
"""

from __future__ import annotations

import ctypes

import torch

from npu.cpu_kernels import amx_granted, entry, kernels_for, ptr
from npu.kv_pairs import pairs_refused


class PagedDecodeAttention:
    """Attention of one-token rows over one layer's pool, each row over its own pages and length."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, tiles: bool | None = None, pairs: bool = False):
        """tiles: the AMX path (bfloat16 only); None picks it wherever it applies (amx_applies). pairs: the pool is
        in the kv-pairs layout (npu.kv_pairs; bfloat16 by AVX512-BF16, never on tiles)."""
        self.dtype = dtype
        self.num_heads, self.num_kv_heads, self.head_dim, self.block_size = num_heads, num_kv_heads, head_dim, block_size
        self.scale = ctypes.c_float(head_dim ** -0.5)
        self.pairs = pairs
        if pairs:
            refused = "it never runs on tiles" if tiles else pairs_refused(lib, dtype, head_dim, block_size)
            if refused:
                raise ValueError(f"paged decode attention over the kv-pairs layout: {refused}")
            self.tiles, self.fn = False, lib.paged_decode_attention_pairs_bf16
        else:
            applies, why = amx_applies(lib, dtype, num_heads, num_kv_heads, head_dim, block_size)
            if tiles and not applies:
                raise ValueError(f"paged decode attention on AMX tiles: {why}")
            self.tiles = applies if tiles is None else tiles
            self.fn = lib.paged_decode_attention_amx_bf16 if self.tiles else entry(lib, "paged_decode_attention", dtype)
        self.fn.restype = None

    def __call__(self, query: torch.Tensor, planes: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor,
                 checked_longest: int | None = None) -> torch.Tensor:
        """query [rows, heads, head_dim]; planes: one layer's pool as [2 x pages, block_size, kv_heads x head_dim]
        (page p's K plane at 2p, its V plane at 2p + 1; in the kv-pairs layout where this kernel was made for it);
        pages [rows, width] int64 page ids, padded anywhere past a row's length; lengths [rows] int64, tokens each
        row attends to. Returns [rows, heads, head_dim].

        Everything the kernel would index with is checked first (two reductions, a few microseconds): a bad
        page id or length is a ValueError here, never a read outside the pool. A caller that has range-checked
        this step's page ids and lengths itself passes the longest length as `checked_longest` and skips that
        (the Qwen3 runner checks once per step in StepLayout.build, then calls once per layer)."""
        rows, width = pages.shape
        if (query.dtype != self.dtype or planes.dtype != self.dtype or not planes.is_contiguous()
                or planes.shape[1:] != (self.block_size, self.num_kv_heads * self.head_dim)
                or pages.dtype != torch.int64 or lengths.dtype != torch.int64 or lengths.shape != (rows,)
                or query.shape != (rows, self.num_heads, self.head_dim)):
            raise ValueError(f"paged decode attention: query {tuple(query.shape)} {query.dtype}, planes "
                             f"{tuple(planes.shape)} {planes.dtype}, pages {tuple(pages.shape)} {pages.dtype}, "
                             f"lengths {tuple(lengths.shape)} {lengths.dtype} do not fit a {self.dtype} kernel "
                             f"of {self.num_heads} heads x {self.head_dim}, {self.num_kv_heads} kv heads, "
                             f"block_size {self.block_size}")
        if rows == 0:
            return torch.empty_like(query)
        longest = checked_longest
        if longest is None:
            shortest, longest = (int(v) for v in torch.aminmax(lengths))
            low, high = (int(v) for v in torch.aminmax(pages[:, :-(-longest // self.block_size)]))
            if shortest < 1 or longest > width * self.block_size or low < 0 or 2 * high + 1 >= planes.shape[0]:
                raise ValueError(f"paged decode attention: lengths in [{shortest}, {longest}] over {width} pages of "
                                 f"{self.block_size}, page ids in [{low}, {high}] for a pool of "
                                 f"{planes.shape[0] // 2} pages")
        query, pages, lengths = query.contiguous(), pages.contiguous(), lengths.contiguous()
        out = torch.empty_like(query)
        threads = torch.get_num_threads()
        per_thread = -(-longest // 32) * 32 * 16 if self.tiles else self.num_heads * longest
        scratch = torch.empty(threads, per_thread, dtype=torch.float32)   # each thread's scores
        self.fn(ptr(query), ptr(planes), ptr(pages), ptr(lengths), ptr(out), ptr(scratch), ctypes.c_int64(rows),
                ctypes.c_int64(width), ctypes.c_int64(self.num_heads), ctypes.c_int64(self.num_kv_heads),
                ctypes.c_int64(self.head_dim), ctypes.c_int64(self.block_size), ctypes.c_int64(longest), self.scale,
                ctypes.c_int(threads))
        return out


def amx_applies(lib: ctypes.CDLL, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int) -> tuple[bool, str]:
    """Whether the AMX decode path serves this shape on this CPU, and why not."""
    if dtype != torch.bfloat16:
        return False, f"it takes bfloat16, not {dtype}"
    if not amx_granted(lib):
        return False, "this CPU or kernel build has no AMX tile unit, or Linux refused it"
    if head_dim not in (64, 128) or num_heads // num_kv_heads > 16 or block_size % 16:
        return False, (f"it takes head_dim 64 or 128, up to 16 query heads per kv head and "
                       f"block_size a multiple of 16, not {head_dim}, {num_heads // num_kv_heads}, {block_size}")
    return True, "AMX tiles"


def paged_decode_attention(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                           head_dim: int, block_size: int, pairs: bool = False) -> PagedDecodeAttention | None:
    """The kernel where it applies to a runner, else None (npu.cpu_kernels logs why). pairs: over a pool in the
    kv-pairs layout (npu.kv_pairs)."""
    lib = kernels_for(device, dtype, "decode attention (gather + SDPA)")
    return None if lib is None else PagedDecodeAttention(lib, dtype, num_heads, num_kv_heads, head_dim, block_size,
                                                         pairs=pairs)
