"""The hyper-connections' Sinkhorn normalization as one Triton kernel on a GPU (npu.deepseek_v4.hyper.sinkhorn's
math, to the bit).

Why: each hc_pre makes its hc x hc mixing matrices doubly stochastic with 2 x iters - 1 normalizations. In torch
each is two launches (a sum, a divide) on a few kilobytes, so with the released 20 iterations an hc_pre launches 80
kernels that do almost nothing (with its padding and copies; bench/count_device_ops.py): about 960 per decode step
of the 6-layer model, 6,900 of the 43-layer one, each costing microseconds of launch time (issue 33: a decode step
eager is launches, not arithmetic).
Here one launch does all of them: each program holds BLOCK tokens' matrices in registers ([BLOCK, n, n], float32),
normalizes them iters times and stores them once.

The same numbers as hyper.sinkhorn, bit for bit: every row (column) sum adds its n entries one after the other
and eps last, as the released math and the CPU reduction do (each entry is picked out of the tile by a masked sum,
which adds only zeros to it), and each division rounds to nearest (div_rn; Triton's `/` on a GPU is an
approximate division). tests/npu/test_sinkhorn_triton.py checks that in Triton's interpreter against
hyper.sinkhorn.

Where it applies (sinkhorn_for): a CUDA device with Triton importable and hc a power of two (the released
hc_mult is 4); elsewhere hyper.sinkhorn runs. It is a torch custom op (a known output for FakeTensorMode, CUDA
graph capture and torch.compile), as npu.paged_attention_triton's kernel is.
"""

from __future__ import annotations

from typing import Callable

import torch

from npu.deepseek_v4.hyper import sinkhorn
from npu.triton_runtime import INTERPRETED, triton

BLOCK = 64          # tokens per program

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _divide(x, s, EXACT: tl.constexpr):
        if EXACT:
            return tl.math.div_rn(x, s)
        return x / s                     # the interpreter: numpy's division, already correctly rounded

    @triton.jit(do_not_specialize=["num"])     # the step's token count: no new variant for a new count mid-serving
    def _sinkhorn(comb_ptr, out_ptr, num, eps, ITERS: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr,
                  EXACT: tl.constexpr):
        tok = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        rows = tl.arange(0, N)[None, :, None]
        cols = tl.arange(0, N)[None, None, :]
        offs = tok[:, None, None] * (N * N) + rows * N + cols
        mask = (tok[:, None, None] < num) & (rows < N) & (cols < N)
        m = tl.load(comb_ptr + offs, mask=mask, other=1.0)             # [BLOCK, N, N]
        # columns first: each column's entries in row order, eps last
        s = tl.sum(tl.where(rows == 0, m, 0.0), axis=1)
        for i in tl.static_range(1, N):
            s = s + tl.sum(tl.where(rows == i, m, 0.0), axis=1)
        m = _divide(m, (s + eps)[:, None, :], EXACT)
        for _ in tl.static_range(ITERS - 1):
            s = tl.sum(tl.where(cols == 0, m, 0.0), axis=2)          # rows: each row's entries in column order
            for j in tl.static_range(1, N):
                s = s + tl.sum(tl.where(cols == j, m, 0.0), axis=2)
            m = _divide(m, (s + eps)[:, :, None], EXACT)
            s = tl.sum(tl.where(rows == 0, m, 0.0), axis=1)
            for i in tl.static_range(1, N):
                s = s + tl.sum(tl.where(rows == i, m, 0.0), axis=1)
            m = _divide(m, (s + eps)[:, None, :], EXACT)
        tl.store(out_ptr + offs, m, mask=mask)


@torch.library.custom_op("appliance::sinkhorn", mutates_args=())
def sinkhorn_op(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [tokens, n, n] float32 positive -> doubly stochastic, as hyper.sinkhorn (one launch)."""
    comb = comb.contiguous()
    out = torch.empty_like(comb)
    num, n, _ = comb.shape
    if num:
        _sinkhorn[(triton.cdiv(num, BLOCK),)](comb, out, num, eps, ITERS=iters, N=n, BLOCK=BLOCK,
                                             EXACT=not INTERPRETED)
    return out


@sinkhorn_op.register_fake
def _sinkhorn_shape(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return torch.empty_like(comb)


def triton_sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """hyper.sinkhorn's signature, through the kernel (iters >= 1, float32, hc a power of two)."""
    return sinkhorn_op(comb, iters, eps)


def sinkhorn_for(device: torch.device, hc: int) -> Callable[[torch.Tensor, int, float], torch.Tensor]:
    """The kernel on a CUDA device where Triton runs and hc is a power of two, else hyper.sinkhorn."""
    if triton is not None and device.type == "cuda" and hc > 0 and hc & (hc - 1) == 0:
        return triton_sinkhorn
    return sinkhorn
