"""Projections on AVX-512 CPUs through the project's GEMM kernel (npu/kernels/gemm.cpp, its header: the layout, the
schedule and why): bfloat16 where the CPU has AVX512-BF16 and no AMX, float32 where npu.linear chooses it.

A weight is packed once, at load, into the kernel's layout (the weight's own size where its rows are a multiple of
16, and for bfloat16 its columns even: zeros pad the rest) and only that copy is kept. Each output row depends on
its input row alone, whatever else is in the batch: the sums run over k in one order for every row count.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from npu.cpu_kernels import SUFFIX, SWITCH, entry, load, ptr

log = logging.getLogger("npu.gemm_cpu")
_said_unavailable: list[str] = []       # the reason the library could not be had, logged once per process


def kernel_library(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> ctypes.CDLL | None:
    """The kernel library where it has the GEMM for `dtype` (float32: built for AVX-512; bfloat16: AVX512-BF16),
    else None: not a CPU, the kernels off (APPLIANCE_CPU_KERNELS=0), no build (logged once), or no such CPU."""
    if device.type != "cpu" or dtype not in SUFFIX or os.environ.get(SWITCH, "1") == "0":
        return None
    try:
        lib = load()
    except RuntimeError as e:
        if not _said_unavailable:
            _said_unavailable.append(str(e))
            log.warning("the GEMM kernel is unavailable, projections take oneDNN's GEMM: %s", e)
        return None
    available = entry(lib, "gemm_available", dtype)
    available.restype = ctypes.c_int
    return lib if available() else None


@dataclass(frozen=True)
class PackedWeight:
    """A float32 or bfloat16 weight [out_features, in_features] in the kernel's layout; calling it computes x W^T."""

    packed: torch.Tensor            # 1-D, the weight's dtype, gemm_packed_size values
    out_features: int
    in_features: int
    gemm: Any                       # the library's gemm_<f32|bf16>

    @staticmethod
    def of(weight: torch.Tensor, lib: ctypes.CDLL) -> PackedWeight:
        n, k = weight.shape
        size_of = entry(lib, "gemm_packed_size", weight.dtype)
        size_of.restype = ctypes.c_int64
        weight = weight.contiguous()
        packed = torch.empty(size_of(ctypes.c_int64(n), ctypes.c_int64(k)), dtype=weight.dtype)
        entry(lib, "gemm_pack", weight.dtype)(ptr(weight), ctypes.c_int64(n), ctypes.c_int64(k), ptr(packed),
                                              ctypes.c_int(torch.get_num_threads()))
        return PackedWeight(packed, n, k, entry(lib, "gemm", weight.dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] in the weight's dtype -> [rows, out_features], contiguous."""
        if x.dtype != self.packed.dtype or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != self.in_features:
            raise TypeError(f"the GEMM kernel takes a CPU {self.packed.dtype} [rows, {self.in_features}] input, not "
                            f"{x.device.type} {x.dtype} {list(x.shape)}")
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty((rows, self.out_features), dtype=self.packed.dtype)
        if rows:
            self.gemm(
                ptr(x), ctypes.c_int64(rows), ctypes.c_int64(self.in_features), ctypes.c_int64(x.stride(0)),
                ptr(self.packed), ctypes.c_int64(self.out_features), ptr(out), ctypes.c_int(torch.get_num_threads()))
        return out
