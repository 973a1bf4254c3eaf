"""The GPU's grouped GEMM over weights as stored (npu/grouped_gemm_triton.py), run in Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU): against each group's weight dequantized by
npu.quant and multiplied in float64, for plain, FP8 (block scales) and FP4 (per-32 scales) weights, groups with no
rows, one row and more rows than a tile, and K not a multiple of the kernel's K step; the tiles' bookkeeping on its
own; and the DeepSeek V4 runner's experts through it against transformers."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's interpreter")]
triton = pytest.importorskip("triton")

from npu.grouped_gemm_triton import group_tiles, triton_grouped_gemm  # noqa: E402
from npu.quant import QuantizedWeight, quantize_fp4, quantize_fp8  # noqa: E402


def stack(weights: list[torch.Tensor], fmt: str, block: int) -> torch.Tensor | QuantizedWeight:
    """Per-group weights [N, K] held as the runner holds a stack: plain, or quantized values and scales stacked."""
    if fmt == "plain":
        return torch.stack(weights)
    parts = [quantize_fp8(w, block) if fmt == "fp8" else quantize_fp4(w) for w in weights]
    values = torch.stack([v.view(torch.uint8) for v, _ in parts]).view(parts[0][0].dtype)
    scales = torch.stack([s.view(torch.uint8) for _, s in parts]).view(parts[0][1].dtype)
    return QuantizedWeight("experts", values, scales, block)


def reference(rows: torch.Tensor, weight: torch.Tensor | QuantizedWeight, sizes: list[int]) -> torch.Tensor:
    dense = weight.dequantize(torch.float64) if isinstance(weight, QuantizedWeight) else weight.double()
    out, start = [], 0
    for g, n in enumerate(sizes):
        out.append(rows[start:start + n].double() @ dense[g].T)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("fmt,block", [("plain", 0), ("fp8", 32), ("fp8", 128), ("fp4", 32)])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("sizes", [[3, 0, 1, 40, 0, 2], [0, 0, 17], [70, 0, 30]],
                         ids=["decode_tiles", "one_group_with_rows", "prefill_tiles"])     # 16- and 64-row tiles
def test_kernel_equals_each_group_dequantized_and_multiplied(fmt, block, dtype, tolerance, sizes):
    out_features, k = 72, 96 if fmt != "fp8" or block == 32 else 160        # neither a multiple of the 64 steps
    gen = torch.Generator().manual_seed(len(sizes) * 7 + block)
    weights = [torch.randn(out_features, k, generator=gen) * 0.3 for _ in sizes]
    held = stack([w.to(dtype) if fmt == "plain" else w for w in weights], fmt, block)
    rows = torch.randn(sum(sizes), k, generator=gen).to(dtype)
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    got = triton_grouped_gemm(rows, held, ends)
    want = reference(rows, held, sizes)
    assert got.dtype == dtype and got.shape == (sum(sizes), out_features)
    scale = want.abs().max()
    assert torch.allclose(got.double(), want, atol=tolerance * scale, rtol=tolerance), (got.double() - want).abs().max()


def test_tiles_cover_every_row_once_and_spare_tiles_are_marked():
    sizes = [0, 5, 16, 17, 0, 1, 40]
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    tiles = group_tiles(ends, sum(sizes), 16)
    assert tiles.shape[1] == -(-sum(sizes) // 16) + len(sizes)            # the static bound
    covered = []
    for group, first, end in tiles.T.tolist():
        if group < 0:
            continue
        lo, hi = int(ends[group] - sizes[group]), int(ends[group])
        assert lo <= first < end == hi and sizes[group] > 0
        covered += [(r, group) for r in range(first, min(first + 16, end))]
    want = [(r, g) for g, n in enumerate(sizes) for r in range(int(ends[g]) - n, int(ends[g]))]
    assert sorted(covered) == want
    live = [g for g in tiles[0].tolist() if g >= 0]
    assert live == sorted(live) and tiles[0, len(live):].eq(-1).all()     # spare tiles last, marked -1


def test_rows_that_do_not_fit_the_weight_are_refused():
    held = stack([torch.randn(8, 64)], "fp4", 32)
    with pytest.raises(ValueError, match=r"rows have 32 columns, the weight \(1, 8, 32\) \(fp4\)"):
        triton_grouped_gemm(torch.randn(4, 32), held, torch.tensor([4], dtype=torch.int32))
