"""Projections (y = x W^T) on the fastest matmul path torch offers for the device, dtype and batch size.

Measured inside Qwen3Runner steps (decode at 192 tokens of context, the benchmark model, one thread, torch
2.13, on the 2-core Sapphire Rapids host; medians of interleaved steps, the host under load):
- float32 on CPU: MKL's packed GEMM (the weight reordered once at load: torch.ops.mkl._mkl_linear, what
  inductor's weight freezing emits) for 2-256 rows; of the benchmark model only the 32000 x 512 head is packed
  (see PACKED_MAX_GROWTH): a step at 8 rows 23-26 -> 19 ms, at 32 rows 34-36 -> 30 ms, at 64 rows 50-54 ->
  48-49 ms (the head alone at 64 rows, isolated: 18 -> 14 ms). Its values equal F.linear's (bit for bit
  from 64 rows on, within float32 rounding below). One row reads the packed copy, which is larger than the
  weight: F.linear runs there, and above 256 rows, where both are the same GEMM.
- bfloat16 on CPU: oneDNN's AMX kernels run W @ X^T faster than X @ W^T for a few rows (a step at 8 rows
  14 -> 10.5 ms, at 16 rows 14 -> 11.5 ms, at 32 rows 5% less); from 64 rows on X @ W^T is faster. The
  product is transposed back (a view; `contiguous=True` copies it).
- anywhere else (accelerators, other dtypes): F.linear.
The packed copy costs memory (the 32000 x 512 head: 89 MB next to its 65 MB), counted by tensors(), and only
weights whose copy is at most PACKED_MAX_GROWTH x their size are packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PACKED_ROWS = range(2, 257)            # float32 rows where MKL's packed GEMM beats F.linear
TRANSPOSED_MAX_ROWS = 32               # bfloat16 rows up to which W @ X^T beats X @ W^T
MKL_PACK_ROWS = 64                     # the batch size MKL packs the weight for (any row count runs on it)
# MKL's packed copy has a fixed part of about 8 MB whatever the weight's size (a 64 x 128 weight packs into
# 7.9 MB): a weight is packed only where the copy is at most this many times its size (the 32000 x 512 head:
# 1.36x; the benchmark model's layer weights, 0.4-1.6M values, would be 2.3-6x and stay unpacked).
PACKED_MAX_GROWTH = 1.5


def _mkl_packs(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"))


@dataclass(frozen=True)
class Projection:
    """A weight [out, in] and, on CPU in float32, its MKL-packed copy, made once when weights are installed."""

    weight: torch.Tensor
    packed: torch.Tensor | None = None

    @staticmethod
    def of(weight: torch.Tensor) -> "Projection":
        if _mkl_packs(weight):
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_PACK_ROWS)
            if packed.numel() <= PACKED_MAX_GROWTH * weight.numel():
                return Projection(weight, packed)
        return Projection(weight)

    def tensors(self) -> list[torch.Tensor]:
        """What it holds in memory (the packed copy included), for the startup profile's accounting."""
        return [self.weight] if self.packed is None else [self.weight, self.packed]

    def __call__(self, x: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
        """x [rows, in] -> [rows, out]; with contiguous=False possibly a transposed view."""
        rows = x.shape[0]
        if x.device.type == "cpu":
            if self.packed is not None and rows in PACKED_ROWS:
                return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, None, rows)
            if x.dtype == torch.bfloat16 and rows <= TRANSPOSED_MAX_ROWS:
                out = torch.mm(self.weight, x.t()).t()
                return out.contiguous() if contiguous else out
        return F.linear(x, self.weight)
