"""The hyper-connections' Sinkhorn normalization as one C++ call on a CPU (npu/kernels/sinkhorn.cpp: the bits of
npu.deepseek_v4.hyper.sinkhorn).

Why: on a CPU the torch version is 2 x iters - 1 sums and divisions of a few kilobytes each, 78 ops per hc_pre with
the released 20 iterations, each costing its dispatch rather than its arithmetic: 12-18% of a tiny DeepSeek V4 decode
step (the embedded default model; bench/bench_dsv4_parts.py --compare-sinkhorn). The kernel adds and divides in
hyper.sinkhorn's order, compiled without fast math, so tokens and logits do not change
(tests/npu/test_sinkhorn_cpu.py).
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch

from npu.cpu_kernels import entry, kernels_for, ptr

MAX_N = 16      # the kernel's largest hc (the released hc_mult is 4)


class CpuSinkhorn:
    """hyper.sinkhorn's signature, through the kernel: comb [tokens, n, n] float32 on the CPU, n <= MAX_N."""

    def __init__(self, lib: ctypes.CDLL):
        self.fn = entry(lib, "sinkhorn", torch.float32)

    def __call__(self, comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        comb = comb.contiguous()
        out = torch.empty_like(comb)
        num, n, _ = comb.shape
        self.fn(ptr(comb), ctypes.c_int64(num), ctypes.c_int64(n), ctypes.c_int64(iters), ctypes.c_float(eps),
                ptr(out), ctypes.c_int(torch.get_num_threads()))
        return out


def cpu_sinkhorn_for(device: torch.device, hc: int) -> Callable[[torch.Tensor, int, float], torch.Tensor] | None:
    """The kernel for a CPU runner whose kernel library loads (npu.cpu_kernels: APPLIANCE_CPU_KERNELS=0 turns it
    off), else None (hyper.sinkhorn's torch ops run)."""
    if device.type != "cpu" or not 1 <= hc <= MAX_N:
        return None
    lib = kernels_for(device, torch.float32, "the Sinkhorn normalization")
    return CpuSinkhorn(lib) if lib is not None else None
