"""bfloat16 projections on CPUs with AVX512-BF16 and no AMX, through npu/kernels/gemm.cpp (its header: the layout,
the schedule and why not oneDNN there).

A weight is packed once, at load, into the kernel's layout (the same bytes as the weight where its rows are a
multiple of 16 and its columns even: zeros pad the rest) and only that copy is kept. Each output row depends on
its input row alone, whatever else is in the batch: the sums run over k in one order for every row count.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from npu.cpu_kernels import kernels_for, ptr


def kernel_library(device: torch.device) -> ctypes.CDLL | None:
    """The kernel library where it has the bfloat16 GEMM (built for a CPU with AVX512-BF16), else None."""
    lib = kernels_for(device, torch.bfloat16, "bfloat16 projections (oneDNN instead)")
    if lib is None:
        return None
    lib.gemm_bf16_available.restype = ctypes.c_int
    return lib if lib.gemm_bf16_available() else None


def amx_present(lib: ctypes.CDLL) -> bool:
    """Whether this CPU's tile unit is built for and granted (then oneDNN's AMX GEMM is the faster bfloat16 path)."""
    lib.paged_decode_amx.restype = ctypes.c_int
    return bool(lib.paged_decode_amx())


@dataclass(frozen=True)
class PackedBf16:
    """A bfloat16 weight [out_features, in_features] in the kernel's layout; calling it computes x W^T."""

    packed: torch.Tensor            # 1-D bfloat16, gemm_bf16_packed_size values
    out_features: int
    in_features: int
    lib: ctypes.CDLL

    @staticmethod
    def of(weight: torch.Tensor, lib: ctypes.CDLL) -> PackedBf16:
        n, k = weight.shape
        lib.gemm_bf16_packed_size.restype = ctypes.c_int64
        size = lib.gemm_bf16_packed_size(ctypes.c_int64(n), ctypes.c_int64(k))
        weight = weight.contiguous()
        packed = torch.empty(size, dtype=torch.bfloat16)
        lib.gemm_pack_bf16(ptr(weight), ctypes.c_int64(n), ctypes.c_int64(k), ptr(packed),
                           ctypes.c_int(torch.get_num_threads()))
        return PackedBf16(packed, n, k, lib)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] bfloat16 -> [rows, out_features], contiguous."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty((rows, self.out_features), dtype=torch.bfloat16)
        if rows:
            self.lib.gemm_bf16(ptr(x), ctypes.c_int64(rows), ctypes.c_int64(self.in_features),
                               ctypes.c_int64(x.stride(0)), ptr(self.packed), ctypes.c_int64(self.out_features),
                               ptr(out), ctypes.c_int(torch.get_num_threads()))
        return out
