"""Projections (y = x W^T) on the fastest matmul path torch offers for the device, dtype, CPU and batch size.

- bfloat16 on CPU: oneDNN on a weight reordered once at load into oneDNN's blocked layout
  (torch.ops.mkldnn._reorder_linear_weight and _linear_pointwise, what inductor's weight freezing emits for
  bf16). F.linear reorders the weight on every call; the packed call is 1.5-2.5x faster at every row count
  (Sapphire Rapids, one thread, the 32000 x 512 head: 1 row 2.1 -> 1.4 ms, 64 rows 5.8 -> 1.9 ms, 512 rows
  19.6 -> 15.6 ms; AMD EPYC with avx512_bf16, two threads, the 32000 x 768 head: 1 row 2.4 -> 0.95 ms, 64 rows
  9.2 -> 7.6 ms). Its values equal F.linear's up to 32 rows and differ by bf16 rounding above (another
  blocking of the sums). Only the packed copy is kept: a bf16 weight is not held twice.
- float32 on CPU: oneDNN's packed fp32 GEMM, the bf16 path's two ops on a float32 weight, on every CPU maker
  (cpu_fp32_gemm; APPLIANCE_CPU_FP32_GEMM=mkl|onednn|torch|kernel overrides). Measured at two threads, min of 30 calls:
  - AMD EPYC (avx512_bf16): F.linear and MKL's packed GEMM are 1.1-1.8x slower than oneDNN at 1 and 64-512
    rows and 2-6x at 2-16 rows (a 2048 x 768 projection at 4 rows 302 against 79 us; the 32000 x 768 head at
    64 rows 31 against 15 ms): MKL takes its generic code on AMD. (Measured before bench/bench_cpu_gemm.py; its
    MKL column is the one to trust, as _mkl_linear runs F.linear unless told the call's own row count.)
  - Intel Xeon (Emerald Rapids, AMX; bench/bench_cpu_gemm.py): oneDNN is up to 2.1x faster than F.linear at
    4-32 rows (4096 x 768 at 8 rows 345 against 691 us) and 5-10% at 64-512, but 4-25% slower at one row. MKL's
    packed GEMM is faster still, by 10-40% at 1-128 rows (249 us there), but its packed copy is 1.6-4.4x the
    weight on these shapes (a fixed part of about 8 MB) and the plain weight stays beside it: packing every
    float32 weight of the 6 x 768 benchmark model with MKL held 2.7x its weights' memory for about 7% more tokens
    per second (workload 936 / 836 against 883 / 774 tok/s, alternating runs). `mkl` therefore packs only where
    the copy is at most PACKED_MAX_GROWTH times the weight (the 32000 x 768 head) and leaves the layers to
    F.linear, which made it slower than oneDNN overall (decode at batch 8: 277-314 against 503 tok/s).
  oneDNN's packed copy is the weight's size, and only it is kept. `mkl` keeps the plain weight and adds MKL's packed
  copy where it is at most PACKED_MAX_GROWTH times the weight's size, used at 2-256 rows; `torch` is F.linear.
- bfloat16 on a CPU with AVX512-BF16 and no AMX (an AMD EPYC Zen 4, an Intel Cooper Lake): the project's own
  kernel instead (npu.gemm_cpu, npu/kernels/gemm.cpp; cpu_bf16_gemm, APPLIANCE_CPU_BF16_GEMM=kernel|onednn|torch
  overrides). oneDNN read a decode step's weights from DRAM at about half the memory's rate: every projection of
  a 12 x 1024 model in turn, 2 threads, AMD EPYC, kernel against oneDNN 1.32x at 1 row, 1.37x at 8, 1.16x at 32,
  1.06x at 64, level from 512 rows. Its output rows depend on their input rows alone, by construction (oneDNN's
  did not above 32 rows on the Intel Xeon). With AMX oneDNN's tile GEMM stays: several times the vector rate.
  The same kernel runs float32 by FMA where APPLIANCE_CPU_FP32_GEMM=kernel asks (1.3-1.6x at 1-8 rows, 1.06x at
  32-64, 0.96x at 512 on the AMD EPYC; not the default).
- anywhere else (accelerators, other dtypes): F.linear.
Packed copies are counted by tensors(), so the startup profile sees their memory.

Row buckets (onednn_rows): oneDNN builds a primitive per (weight shape, row count) on its first call (0.2-5 ms:
1 to 2,048 rows of the 4 x 512 model's bf16 projections) and keeps up to 1,024 in an LRU cache, each holding
about 600-700 KB of host memory. A server's steps take any row count up to max_num_batched_tokens, so with exact
counts every new step size paid the builds and, once the shapes x counts passed 1,024, every miss rebuilt. So a
packed call runs at the next bucket: every count up to 32, then 16 buckets per doubling (33-64 by 2, 65-128 by 4,
..., 1025-2048 by 64), at most 6.25% extra rows, 128 buckets per shape up to 2,048 rows (160 up to 8,192); the
extra rows are zeros and their outputs are dropped, so the kept rows are an exact call's at that bucket. Measured
on an Intel Xeon (Emerald Rapids), 2 threads (bench/bench_onednn_rows.py): 800 random row counts in 1-600 through
the 4 x 512 layer shapes took 7.3 s per pass with exact counts, every pass (1,740 primitives, +973 MiB RSS), and
0.9 s bucketed after a 1.5 s first pass (364 primitives, +253 MiB); 96 requests of random lengths through the
6 x 768 model spent 1.9 s in projections on their first pass bucketed against 2.1 s exact, and the same on the
third. Buckets cost their extra rows and a copy of the input where a count falls between two.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from appliance.core.errors import EnvironmentSettingError
from npu.cpu_kernels import amx_granted
from npu.gemm_cpu import PackedWeight, kernel_library

log = logging.getLogger("npu.linear")

MKL_ROWS = range(2, 257)               # float32 rows where MKL's packed GEMM beats F.linear
MKL_PACK_ROWS = 64                     # the batch size MKL packs the weight for (any row count runs on it)
# MKL's packed copy has a fixed part of about 8 MB whatever the weight's size (a 64 x 128 weight packs into
# 7.9 MB): a weight is packed only where the copy is at most this many times its size (the 32000 x 512 head:
# 1.36x; the benchmark model's layer weights, 0.4-1.6M values, would be 2.3-6x and stay unpacked).
PACKED_MAX_GROWTH = 1.5
ONEDNN_PACK_ROWS = 64                  # the batch size oneDNN lays the weight out for (any row count runs)
FP32_GEMM_SWITCH = "APPLIANCE_CPU_FP32_GEMM"
Fp32Gemm = Literal["mkl", "onednn", "torch", "kernel"]
BF16_GEMM_SWITCH = "APPLIANCE_CPU_BF16_GEMM"
Bf16Gemm = Literal["kernel", "onednn", "torch"]


EXACT_ROWS = 32                        # row counts up to this run as they are; above, 16 buckets per doubling


def onednn_rows(rows: int) -> int:
    """The row count a packed oneDNN call runs at for `rows` rows (module docstring: row buckets)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << max(0, (rows - 1).bit_length() - 5)
    return -(-rows // step) * step


@functools.cache
def cpu_fp32_gemm() -> Fp32Gemm:
    """The float32 CPU GEMM this process takes: $APPLIANCE_CPU_FP32_GEMM when set, else oneDNN (the fastest on
    AMD, and on Intel within 10-40% of MKL for about a third of MKL's memory; module docstring), falling back to
    torch (F.linear) where the library is not in this torch build."""
    chosen = os.environ.get(FP32_GEMM_SWITCH) or "onednn"
    if chosen not in ("mkl", "onednn", "torch", "kernel"):
        raise EnvironmentSettingError(f"{FP32_GEMM_SWITCH}={chosen!r}: expected mkl, onednn, torch or kernel (unset "
                                      f"it for the measured default)")
    if chosen == "kernel":
        if kernel_library(torch.device("cpu"), torch.float32) is not None:
            return "kernel"
        chosen = "onednn"
    if chosen == "mkl" and not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
        return "torch"
    if chosen == "onednn" and not (torch.backends.mkldnn.is_available()
                                   and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "torch"
    return chosen  # type: ignore[return-value]


def _onednn_bf16() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def cpu_bf16_gemm() -> Bf16Gemm:
    """The bfloat16 CPU GEMM this process takes: $APPLIANCE_CPU_BF16_GEMM when set, else the project's kernel on a
    CPU with AVX512-BF16 and no AMX (module docstring), else oneDNN's packed GEMM where it runs bfloat16, else torch
    (F.linear). A choice this CPU or build cannot run falls back the same way (`kernel` needs AVX512-BF16 and the
    kernel library: APPLIANCE_CPU_KERNELS=0 turns it off)."""
    chosen = os.environ.get(BF16_GEMM_SWITCH)
    if chosen not in (None, "kernel", "onednn", "torch"):
        raise EnvironmentSettingError(f"{BF16_GEMM_SWITCH}={chosen!r}: expected kernel, onednn or torch (unset it "
                                      f"for the measured default)")
    if chosen in (None, "kernel"):
        lib = kernel_library(torch.device("cpu"))
        if lib is not None and (chosen == "kernel" or not amx_granted(lib)):
            log.info("bfloat16 projections: the project's GEMM kernel (%s)",
                     "asked for" if chosen else "AVX512-BF16 without AMX")
            return "kernel"
        chosen = None
    if chosen in (None, "onednn"):
        return "onednn" if _onednn_bf16() else "torch"
    return "torch"


def _cpu_bf16(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2


def _cpu_fp32(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def _mkl_packs(weight: torch.Tensor) -> bool:
    return _cpu_fp32(weight) and cpu_fp32_gemm() == "mkl"


def _onednn_packs(weight: torch.Tensor) -> bool:
    if _cpu_fp32(weight):
        return cpu_fp32_gemm() == "onednn"
    return _cpu_bf16(weight) and cpu_bf16_gemm() == "onednn"


@dataclass(frozen=True)
class Projection:
    """A weight [out, in] as the fastest path for its device and dtype wants it, made once when weights are
    installed: only oneDNN's packed copy (CPU bfloat16 and float32; then `weight` is None), or only the project's
    kernel's packed copy (where cpu_bf16_gemm or cpu_fp32_gemm chose it), or the plain weight (F.linear) with MKL's
    packed copy where APPLIANCE_CPU_FP32_GEMM=mkl chose it, or the plain weight alone."""

    weight: torch.Tensor | None
    mkl_packed: torch.Tensor | None = None
    onednn_packed: torch.Tensor | None = None
    kernel_packed: PackedWeight | None = None

    @staticmethod
    def of(weight: torch.Tensor) -> Projection:
        if (_cpu_bf16(weight) and cpu_bf16_gemm() == "kernel") or (_cpu_fp32(weight) and cpu_fp32_gemm() == "kernel"):
            lib = kernel_library(weight.device, weight.dtype)
            assert lib is not None, "the kernel was chosen, so its library loaded"
            return Projection(None, kernel_packed=PackedWeight.of(weight, lib))
        if _onednn_packs(weight):
            return Projection(None, onednn_packed=torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_PACK_ROWS))
        if _mkl_packs(weight):
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_PACK_ROWS)
            if packed.numel() <= PACKED_MAX_GROWTH * weight.numel():
                return Projection(weight, mkl_packed=packed)
        return Projection(weight)

    def tensors(self) -> list[torch.Tensor]:
        """What it holds in memory (packed copies included), for the startup profile's accounting."""
        kernel = None if self.kernel_packed is None else self.kernel_packed.packed
        return [t for t in (self.weight, self.mkl_packed, self.onednn_packed, kernel) if t is not None]

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's [out_features, in_features], whichever copy holds it."""
        if self.kernel_packed is not None:
            return self.kernel_packed.out_features, self.kernel_packed.in_features
        held = self.tensors()[0]
        return held.shape[0], held.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out], contiguous."""
        if self.kernel_packed is not None:
            return self.kernel_packed(x)
        if self.onednn_packed is not None:
            rows = x.shape[0]
            bucket = onednn_rows(rows)
            if bucket == rows:
                return torch.ops.mkldnn._linear_pointwise(x, self.onednn_packed, None, "none", [], "")
            padded = x.new_empty((bucket, x.shape[1]))
            padded[:rows].copy_(x)
            padded[rows:].zero_()
            return torch.ops.mkldnn._linear_pointwise(padded, self.onednn_packed, None, "none", [], "")[:rows]
        if self.mkl_packed is not None and x.shape[0] in MKL_ROWS:
            return torch.ops.mkl._mkl_linear(x, self.mkl_packed, self.weight, None, x.shape[0])
        assert self.weight is not None, "a projection holds its weight unless oneDNN packed it"
        return F.linear(x, self.weight)
