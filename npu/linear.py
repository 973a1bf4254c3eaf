"""Projections (y = x W^T) on the fastest matmul path torch offers for the device, dtype and batch size.

Measured inside Qwen3Runner steps (decode at 192 tokens of context, the benchmark model, torch 2.13, on the
2-core Sapphire Rapids host):
- bfloat16 on CPU: oneDNN's AMX kernels on a weight reordered once at load into oneDNN's blocked layout
  (torch.ops.mkldnn._reorder_linear_weight and _linear_pointwise, what inductor's weight freezing emits for
  bf16). F.linear reorders the weight on every call; the packed call is 1.5-2.5x faster at every row count
  (one thread, the 32000 x 512 head: 1 row 2.1 -> 1.4 ms, 64 rows 5.8 -> 1.9 ms, 512 rows 19.6 -> 15.6 ms;
  a 512 x 3072 projection at 64 rows 0.39 -> 0.20 ms). Its values equal F.linear's up to 32 rows and
  differ by bf16 rounding above (another blocking of the sums). Only the packed copy is kept: a bf16
  weight is not held twice.
- float32 on CPU: MKL's packed GEMM (torch.ops.mkl._mkl_linear, inductor's fp32 weight freezing) for 2-256
  rows; of the benchmark model only the 32000 x 512 head is packed (see PACKED_MAX_GROWTH): a step at 8
  rows 23-26 -> 19 ms, at 32 rows 34-36 -> 30 ms, at 64 rows 50-54 -> 48-49 ms (one thread, under load).
  Its values equal F.linear's (bit for bit from 64 rows on, within float32 rounding below). One row reads
  the packed copy, which is larger than the weight: F.linear runs there, and above 256 rows, where both are
  the same GEMM. oneDNN's packed fp32 path is no faster than F.linear here.
- anywhere else (accelerators, other dtypes): F.linear.
Packed copies are counted by tensors(), so the startup profile sees their memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MKL_ROWS = range(2, 257)               # float32 rows where MKL's packed GEMM beats F.linear
MKL_PACK_ROWS = 64                     # the batch size MKL packs the weight for (any row count runs on it)
# MKL's packed copy has a fixed part of about 8 MB whatever the weight's size (a 64 x 128 weight packs into
# 7.9 MB): a weight is packed only where the copy is at most this many times its size (the 32000 x 512 head:
# 1.36x; the benchmark model's layer weights, 0.4-1.6M values, would be 2.3-6x and stay unpacked).
PACKED_MAX_GROWTH = 1.5
ONEDNN_PACK_ROWS = 64                  # the batch size oneDNN lays the bf16 weight out for (any row count runs)


def _mkl_packs(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"))


def _onednn_packs(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class Projection:
    """A weight [out, in] as the fastest path for its device and dtype wants it, made once when weights are
    installed: the plain weight (F.linear), plus MKL's packed copy (CPU float32), or only oneDNN's packed copy
    (CPU bfloat16; then `weight` is None)."""

    weight: torch.Tensor | None
    mkl_packed: torch.Tensor | None = None
    onednn_packed: torch.Tensor | None = None

    @staticmethod
    def of(weight: torch.Tensor) -> "Projection":
        if _onednn_packs(weight):
            return Projection(None, onednn_packed=torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_PACK_ROWS))
        if _mkl_packs(weight):
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_PACK_ROWS)
            if packed.numel() <= PACKED_MAX_GROWTH * weight.numel():
                return Projection(weight, mkl_packed=packed)
        return Projection(weight)

    def tensors(self) -> list[torch.Tensor]:
        """What it holds in memory (packed copies included), for the startup profile's accounting."""
        return [t for t in (self.weight, self.mkl_packed, self.onednn_packed) if t is not None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out], contiguous."""
        if self.onednn_packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn_packed, None, "none", [], "")
        if self.mkl_packed is not None and x.shape[0] in MKL_ROWS:
            return torch.ops.mkl._mkl_linear(x, self.mkl_packed, self.weight, None, x.shape[0])
        assert self.weight is not None, "a projection holds its weight unless oneDNN packed it"
        return F.linear(x, self.weight)
