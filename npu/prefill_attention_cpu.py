"""Causal attention of prefill chunks on CPU, by a flash-attention kernel: chunks from position 0 over their own
keys, and chunks after cached tokens (later chunks of long prompts, prefix-cache hits) over their pages in place.

Why: torch's CPU SDPA (its flash kernel) runs causal attention at about 310 GFLOP/s in bfloat16 and 125 in float32
on the Xeon of BENCHMARKS (4 x 512 prompts, 8 heads of 64): a quarter of a 4 x 512 bf16 prefill step, and what left
the appliance's prefill behind vLLM's (whose CPU backend has its own AMX kernel); a chunk after cached tokens also
needed its pages gathered into a dense copy first. On an AMD EPYC (Zen 4: AVX512-BF16, no AMX) SDPA's bfloat16
GEMMs go through MKL, which there widens them to float32 SGEMM: a third of a 4 x 512 bf16 prefill step. The kernel
(npu/kernels/prefill_attention.cpp) packs each sequence's keys once (from the activations, or from the pages),
computes the scores and P.V on the AMX tile unit or with AVX512-BF16 dot products in bfloat16 and in AVX-512
register blocks in float32, online softmax in float32 over 32-key blocks, all sequences of a call in one task list
(16 query rows of one head each, longest first).

Where it applies (causal_prefill_attention): a CPU runner with the kernels built, in bfloat16 where the CPU has
AMX (and Linux grants it) or else AVX512-BF16, in float32 where it has AVX-512, head_dim a multiple of 32 (bf16)
or 64 (fp32) up to 256. Anywhere else the runner's SDPA path runs (the kernel's portable path exists for the
tests: it is slower than SDPA). tests/npu/test_prefill_attention_cpu.py checks every path the CPU has against
float64 attention.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from npu.cpu_kernels import entry, kernels_for, ptr
from npu.kv_pairs import pairs_refused

log = logging.getLogger("npu.prefill_attention_cpu")

PORTABLE, AVX512, AMX, AVX512_BF16 = 0, 1, 2, 3   # the kernel's paths (prefill_attention.cpp `Path`)
BLOCK = 32                            # the kernel pads each sequence's keys to a multiple of this
MAX_HEAD_DIM = 256


def available_paths(lib: ctypes.CDLL) -> set[int]:
    """The fast paths this build has and this process may use (AMX: granted by Linux on the kernel's request)."""
    lib.prefill_attention_paths.restype = ctypes.c_int
    bits = lib.prefill_attention_paths()
    return {PORTABLE} | {path for bit, path in ((1, AVX512), (2, AMX), (4, AVX512_BF16)) if bits & bit}


class CausalPrefillAttention:
    """Causal attention of prefill chunks: packed sequences over their own keys (__call__), or chunks at the end of
    contexts held in a paged pool (paged)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                 path: int):
        self.lib, self.paths = lib, available_paths(lib)
        if path not in self.paths:
            raise ValueError(f"prefill attention path {path} is not available on this CPU / build")
        refused = path_refuses(path, dtype, head_dim)
        if refused or num_heads % num_kv_heads:
            raise ValueError(f"prefill attention path {path}: {refused or 'heads not a multiple of kv heads'} "
                             f"({num_heads} heads / {num_kv_heads} kv heads)")
        self.fn = entry(lib, "causal_prefill_attention", dtype)
        self.paged_fn = entry(lib, "paged_prefill_attention", dtype)
        self.pairs_fn = lib.paged_prefill_attention_pairs_bf16       # pools in the kv-pairs layout (npu.kv_pairs)
        self.pairs_fn.restype = None
        self.dtype, self.path = dtype, path
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = ctypes.c_float(head_dim ** -0.5)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """q [rows, heads x head_dim], k and v [rows, kv_heads x head_dim]: row views (k and v with one row
        stride, each row's elements contiguous, as column slices of the layer's qkv); the rows are the sequences
        one after another, `lengths` of them. Returns [rows, heads, head_dim]."""
        rows = q.shape[0]
        nh, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if (q.dtype != self.dtype or k.dtype != self.dtype or v.dtype != self.dtype
                or q.shape != (rows, nh * hd) or k.shape != (rows, kvh * hd) or v.shape != (rows, kvh * hd)
                or q.stride(1) != 1 or k.stride(1) != 1 or v.stride(1) != 1 or k.stride(0) != v.stride(0)
                or sum(lengths) != rows or min(lengths, default=1) < 1):
            raise ValueError(f"causal prefill attention: q {tuple(q.shape)} {q.stride()}, k {tuple(k.shape)} "
                             f"{k.stride()}, v {tuple(v.shape)} {v.stride()} ({q.dtype}), lengths summing to "
                             f"{sum(lengths)} do not fit a {self.dtype} kernel of {nh} heads x {hd}, {kvh} kv heads")
        out = torch.empty(rows, nh, hd, dtype=self.dtype)
        if rows == 0:
            return out
        starts = torch.tensor([0, *lengths], dtype=torch.int64).cumsum_(0)
        padded = sum(-(-n // BLOCK) * BLOCK for n in lengths)
        scratch = torch.empty(padded * kvh * hd * 4, dtype=torch.uint8)   # packed keys (and values): the kernel's
        self.fn(ptr(q), ptr(k), ptr(v), ptr(starts), ctypes.c_int64(len(lengths)), ptr(out), ptr(scratch),
                ctypes.c_int64(nh), ctypes.c_int64(kvh), ctypes.c_int64(hd), ctypes.c_int64(q.stride(0)),
                ctypes.c_int64(k.stride(0)), self.scale, ctypes.c_int(torch.get_num_threads()), ctypes.c_int(self.path))
        return out


    def paged(self, q: torch.Tensor, planes: torch.Tensor, pages: torch.Tensor, context: int, length: int,
              checked: bool = False, pairs: bool = False) -> torch.Tensor:
        """Chunks after cached tokens: q [count x length, heads x head_dim] row views (each row's elements
        contiguous), chunk c's rows c x length.. attending to the first `context` tokens of its pages (the chunk's
        own last, already written to the pool); planes: one layer's pool as [2 x pages, block_size, kv_heads x
        head_dim] (K plane 2p, V plane 2p + 1); pages [count, width] int64. Returns [count x length, heads,
        head_dim]. Page ids are range-checked unless the caller did (`checked`: the runner's StepLayout.build).
        pairs: the planes are in the kv-pairs layout (npu.kv_pairs), read by the AVX512-BF16 path whatever this
        object's path (the layout is only made where the kernels have it)."""
        count, width = pages.shape
        nh, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        block_size = planes.shape[1]
        if (q.dtype != self.dtype or planes.dtype != self.dtype or pages.dtype != torch.int64
                or q.shape != (count * length, nh * hd) or q.stride(1) != 1 or not planes.is_contiguous()
                or planes.shape[2] != kvh * hd or not length <= context <= width * block_size or length < 1):
            raise ValueError(f"paged prefill attention: q {tuple(q.shape)} {q.dtype}, planes {tuple(planes.shape)} "
                             f"{planes.dtype}, pages {tuple(pages.shape)} {pages.dtype}, {count} chunks of {length} "
                             f"rows over {context} tokens do not fit a {self.dtype} kernel of {nh} heads x {hd}, "
                             f"{kvh} kv heads")
        refused = pairs_refused(self.lib, self.dtype, hd, block_size) if pairs else None
        if refused:
            raise ValueError(f"paged prefill attention over the kv-pairs layout: {refused}")
        if not checked:
            low, high = (int(v) for v in torch.aminmax(pages[:, :-(-context // block_size)]))
            if low < 0 or 2 * high + 1 >= planes.shape[0]:
                raise ValueError(f"paged prefill attention: page ids in [{low}, {high}] for a pool of "
                                 f"{planes.shape[0] // 2} pages")
        pages = pages.contiguous()
        out = torch.empty(count * length, nh, hd, dtype=self.dtype)
        starts = torch.arange(count + 1, dtype=torch.int64) * length
        kv_lengths = torch.full((count,), context, dtype=torch.int64)
        unit = 4 + planes.element_size()                      # packed K (float32 or bf16 pairs) and V rows
        scratch = torch.empty(count * -(-context // BLOCK) * BLOCK * kvh * hd * unit, dtype=torch.uint8)
        args = (ptr(q), ptr(starts), ptr(planes), ptr(pages), ctypes.c_int64(width), ctypes.c_int64(block_size),
                ptr(kv_lengths), ctypes.c_int64(count), ptr(out), ptr(scratch), ctypes.c_int64(nh), ctypes.c_int64(kvh),
                ctypes.c_int64(hd), ctypes.c_int64(q.stride(0)), self.scale, ctypes.c_int(torch.get_num_threads()))
        if pairs:
            self.pairs_fn(*args)
        else:
            self.paged_fn(*args, ctypes.c_int(self.path))
        return out


# What each path takes: dtypes, and head_dim a multiple of this (up to MAX_HEAD_DIM: the kernel's buffers).
TAKES = {PORTABLE: ((torch.float32, torch.bfloat16), 1), AVX512: ((torch.float32,), 64), AMX: ((torch.bfloat16,), 32),
         AVX512_BF16: ((torch.bfloat16,), 32)}
# The paths that beat SDPA, per dtype, best first (bfloat16 without AMX: AMD Zen 4, and Intel with AMX refused)
FAST = {torch.bfloat16: ((AMX, "AMX bfloat16 tiles"), (AVX512_BF16, "AVX512-BF16 dot products")),
        torch.float32: ((AVX512, "AVX-512 float32"),)}
UNIT = {AVX512: "AVX-512", AMX: "the AMX tile unit", AVX512_BF16: "AVX512-BF16"}


def path_refuses(path: int, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why `path` cannot run this dtype and head size, or None."""
    dtypes, multiple = TAKES[path]
    if dtype not in dtypes or not 0 < head_dim <= MAX_HEAD_DIM or head_dim % multiple:
        return (f"it takes {' or '.join(map(str, dtypes))} and head_dim a multiple of {multiple} up to "
                f"{MAX_HEAD_DIM}, not {dtype} x {head_dim}")
    return None


def fast_path(dtype: torch.dtype, head_dim: int, paths: set[int]) -> tuple[int | None, str]:
    """The best path that beats SDPA for this dtype and head size on this CPU, or None and why not."""
    if dtype not in FAST:
        return None, f"no kernel for {dtype}"
    why = []
    for path, name in FAST[dtype]:
        if path not in paths:
            why.append(f"{name} needs {UNIT[path]} (this CPU or kernel build has none"
                       + (", or Linux refused it)" if path == AMX else ")"))
            continue
        refused = path_refuses(path, dtype, head_dim)
        if refused is None:
            return path, name
        why.append(f"{name}: {refused}")
    return None, "; ".join(why)


def causal_prefill_attention(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                             head_dim: int) -> CausalPrefillAttention | None:
    """The kernel where it beats SDPA for a runner, else None (and why, logged)."""
    lib = kernels_for(device, dtype, "prefill attention (SDPA)")
    if lib is None:
        return None
    path, why = fast_path(dtype, head_dim, available_paths(lib))
    if path is None:
        log.info("prefill attention on SDPA: %s", why)
        return None
    log.info("prefill attention from position 0: the CPU kernel, %s", why)
    return CausalPrefillAttention(lib, dtype, num_heads, num_kv_heads, head_dim, path)
