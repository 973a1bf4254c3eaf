"""Decode attention over the paged KV cache on CPU, by a small C++ kernel that reads pages in place.

Why: on CPU the SDPA path first gathers every decode row's pages into a dense buffer (one copy of the
whole context per layer), then SDPA reads it again; for the 64-row bf16 decode step of issue 16 the two
took 5.2 of 12.8 ms. The kernel (npu/kernels/paged_attention.cpp) walks each row's block table instead,
converts K and V rows to float32 once for all query heads of a kv head (GQA), and prefetches the next
page while it reads one: vLLM's CPU backend does the same in its compiled paged-attention op.

How it is built: with the host's C++ compiler (g++ -O3 -march=native -fopenmp), once per source, compiler
and CPU, into a cache directory (APPLIANCE_KERNEL_CACHE, else $XDG_CACHE_HOME/appliance/kernels, else
~/.cache/appliance/kernels), written to a temporary name and renamed, so concurrent starts are safe.
`make install` builds it ahead (`python -m npu.paged_attention_cpu`), so a start never waits for the
compiler; without the cached library a start compiles it (about 1 s). It runs on the OpenMP pool torch
uses: it links libgomp.so.1, which resolves to the copy torch has loaded (one pool; two pools on two
cores slow every op, see docs/ARCHITECTURE.md).

Where it applies (paged_decode_attention): CPU runners with float32 or bfloat16 activations and pools,
when a compiler is found and the build succeeds; APPLIANCE_CPU_ATTENTION=sdpa turns it off. Anywhere else
the runner's gather + SDPA path runs, and says why in the log. tests/npu/test_paged_attention_cpu.py
checks the kernel against SDPA on scattered pages of mixed lengths, and the runner against transformers.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("npu.paged_attention_cpu")

SOURCE = Path(__file__).with_name("kernels") / "paged_attention.cpp"
FLAGS = ("-std=c++17", "-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-shared", "-fPIC")
SWITCH = "APPLIANCE_CPU_ATTENTION"        # "sdpa": use the gather + SDPA path
ENTRY_POINTS = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}

_loaded: dict[str, ctypes.CDLL | str] = {}   # library path -> the loaded library, or why it could not load


def cache_dir() -> Path:
    if os.environ.get("APPLIANCE_KERNEL_CACHE"):
        return Path(os.environ["APPLIANCE_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "appliance" / "kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native builds for them), so a cache shared by two hosts stays right."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path(compiler: str) -> Path:
    """Where the build for this source, compiler and CPU lives in the cache."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), compiler, version, " ".join(FLAGS), _cpu_flags()]).encode())
    return cache_dir() / f"paged_attention-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """The compiled library's path, compiling it first when the cache has none. Raises RuntimeError naming
    what is missing or what the compiler said."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    path = library_path(compiler)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {SOURCE}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the CPU paged-attention kernel: %s", path)
    return path


def load() -> ctypes.CDLL:
    """The kernel library, built if needed; raises RuntimeError with the reason when it cannot be had."""
    path = str(build())
    got = _loaded.get(path)
    if got is None:
        try:
            got = ctypes.CDLL(path)
            for name in ENTRY_POINTS.values():
                getattr(got, name).restype = None
        except (OSError, AttributeError) as e:
            got = f"cannot load {path}: {e}"
        _loaded[path] = got
    if isinstance(got, str):
        raise RuntimeError(got)
    return got


class PagedDecodeAttention:
    """Attention of one-token rows over one layer's pool, each row over its own pages and length."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int):
        self.fn = getattr(lib, ENTRY_POINTS[dtype])
        self.dtype = dtype
        self.num_heads, self.num_kv_heads, self.head_dim, self.block_size = num_heads, num_kv_heads, head_dim, block_size
        self.scale = ctypes.c_float(head_dim ** -0.5)

    def __call__(self, query: torch.Tensor, planes: torch.Tensor, pages: torch.Tensor,
                 lengths: torch.Tensor) -> torch.Tensor:
        """query [rows, heads, head_dim]; planes: one layer's pool as [2 x pages, block_size, kv_heads x head_dim]
        (page p's K plane at 2p, its V plane at 2p + 1); pages [rows, width] int64 page ids, padded anywhere past
        a row's length; lengths [rows] int64, tokens each row attends to. Returns [rows, heads, head_dim].

        Everything the kernel would index with is checked first (two reductions, a few microseconds): a bad
        page id or length is a ValueError here, never a read outside the pool."""
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
        shortest, longest = (int(v) for v in torch.aminmax(lengths))
        low, high = (int(v) for v in torch.aminmax(pages[:, :-(-longest // self.block_size)]))
        if shortest < 1 or longest > width * self.block_size or low < 0 or 2 * high + 1 >= planes.shape[0]:
            raise ValueError(f"paged decode attention: lengths in [{shortest}, {longest}] over {width} pages of "
                             f"{self.block_size}, page ids in [{low}, {high}] for a pool of {planes.shape[0] // 2} pages")
        query, pages, lengths = query.contiguous(), pages.contiguous(), lengths.contiguous()
        out = torch.empty_like(query)
        threads = torch.get_num_threads()
        scratch = torch.empty(threads, self.num_heads * longest, dtype=torch.float32)   # each thread's scores
        self.fn(ctypes.c_void_p(query.data_ptr()), ctypes.c_void_p(planes.data_ptr()), ctypes.c_void_p(pages.data_ptr()),
                ctypes.c_void_p(lengths.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                ctypes.c_void_p(scratch.data_ptr()), ctypes.c_int64(rows), ctypes.c_int64(width),
                ctypes.c_int64(self.num_heads), ctypes.c_int64(self.num_kv_heads), ctypes.c_int64(self.head_dim),
                ctypes.c_int64(self.block_size), ctypes.c_int64(longest), self.scale, ctypes.c_int(threads))
        return out


def paged_decode_attention(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                           head_dim: int, block_size: int) -> PagedDecodeAttention | None:
    """The kernel where it applies to a runner, else None (and why, logged)."""
    if device.type != "cpu":
        return None
    if os.environ.get(SWITCH, "").lower() == "sdpa":
        log.info("CPU paged attention off (%s=sdpa): decode rows use gather + SDPA", SWITCH)
        return None
    if dtype not in ENTRY_POINTS:
        log.info("CPU paged attention off: it takes float32 or bfloat16, not %s; decode rows use gather + SDPA", dtype)
        return None
    try:
        lib = load()
    except RuntimeError as e:
        log.warning("CPU paged attention off, decode rows use gather + SDPA (slower): %s", e)
        return None
    return PagedDecodeAttention(lib, dtype, num_heads, num_kv_heads, head_dim, block_size)


if __name__ == "__main__":        # `make install` runs this: build the kernel ahead of the first start
    try:
        print(f"CPU paged-attention kernel: {build()}")
    except RuntimeError as e:
        print(f"CPU paged-attention kernel not built ({e}); CPU runners will use gather + SDPA", file=sys.stderr)
