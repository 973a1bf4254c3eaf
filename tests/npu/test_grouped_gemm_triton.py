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

from npu.grouped_gemm_triton import (  # noqa: E402
    group_tiles,
    group_tiles_torch,
    triton_grouped_gemm,
    triton_grouped_linear,
    uniform_tiles,
)
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


@pytest.mark.parametrize("fmt,rows,block", [("fp8", 64, 32), ("fp8", 16, 32), ("fp4", 24, 32)],
                         ids=["fp8_blocks_in_groups", "fp8_groups_in_a_block", "fp4"])
def test_one_matrix_as_its_row_blocks_projects_each_group_with_its_block(fmt, rows, block):
    """DeepSeek V4's wo_a: one quantized matrix [G * r, in] whose row block g projects group g of the input, read
    as stored as G groups of the kernel: equal to x[:, g] @ W[g r:(g + 1) r]^T with W dequantized whole, whether
    the FP8 scale blocks hold several row blocks or a row block several scale blocks."""
    groups, n, width = 4, 5, 96
    gen = torch.Generator().manual_seed(rows)
    dense = torch.randn(groups * rows, width, generator=gen) * 0.3
    values, scale = quantize_fp8(dense, block) if fmt == "fp8" else quantize_fp4(dense)
    weight = QuantizedWeight("wo_a", values, scale, block)
    blocks = weight.row_blocks(groups)
    assert blocks is not None and blocks.values.shape[:2] == (groups, rows)
    assert blocks.values.data_ptr() == weight.values.data_ptr()          # a view: the values are not copied
    assert torch.equal(blocks.dequantize(torch.float32), weight.dequantize(torch.float32).view(groups, rows, width))
    x = torch.randn(n, groups, width, generator=gen)
    got = triton_grouped_linear(x, blocks)
    want = torch.einsum("ngi,gri->ngr", x.double(), weight.dequantize(torch.float64).view(groups, rows, width))
    assert got.shape == (n, groups, rows)
    assert torch.allclose(got.double(), want, atol=1e-5 * want.abs().max(), rtol=1e-5)


def test_row_blocks_that_straddle_a_scale_block_are_refused():
    """48-row blocks under 32-row FP8 scale blocks: a scale block would cover two row blocks' rows, so the matrix
    is not a stack the kernel can read (the runner dequantizes it instead); a row count the groups do not divide is
    an error."""
    values, scale = quantize_fp8(torch.randn(4 * 48, 64), 32)
    weight = QuantizedWeight("wo_a", values, scale, 32)
    assert weight.row_blocks(4) is None
    with pytest.raises(ValueError, match="not 5 blocks of rows"):
        weight.row_blocks(5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rows_per_tile", [16, 64])
def test_the_one_launch_tile_table_is_the_torch_ops_table(seed, rows_per_tile):
    """group_tiles' kernel (one program: the running sum of tile counts in registers) against the torch ops, every
    entry: 1 to 300 groups (DeepSeek V4 has 256 experts), empty groups, a step with no rows, tables past 64 tiles (its
    loop over 64-tile blocks) and the spare tiles past the last, which point at the last group."""
    gen = torch.Generator().manual_seed(seed)
    groups = [1, 3, 17, 256, 300, 64][seed]
    sizes = torch.randint(0, 40, (groups,), generator=gen) * (torch.rand(groups, generator=gen) < 0.6)
    if seed == 5:
        sizes.zero_()
    ends = sizes.cumsum(0).to(torch.int32)
    want = group_tiles_torch(ends, int(sizes.sum()), rows_per_tile)
    got = group_tiles(ends, int(sizes.sum()), rows_per_tile)
    assert got.dtype == torch.int32 and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("groups", [1, 2, 8])
@pytest.mark.parametrize("rows_per_group", [0, 1, 15, 16, 17, 64, 100])
@pytest.mark.parametrize("rows_per_tile", [16, 64])
def test_uniform_tiles_made_on_the_host_are_the_device_table(groups, rows_per_group, rows_per_tile):
    """uniform_tiles (a quantized linear: one group; wo_a: its row blocks) is group_tiles' table, spare tiles too."""
    ends = torch.arange(1, groups + 1, dtype=torch.int32) * rows_per_group
    made = uniform_tiles(groups, rows_per_group, rows_per_tile, torch.device("cpu"))
    assert made.dtype == torch.int32
    assert torch.equal(made, group_tiles(ends, groups * rows_per_group, rows_per_tile))
    assert uniform_tiles(groups, rows_per_group, rows_per_tile, torch.device("cpu")) is made     # uploaded once


def test_the_swiglu_of_quantized_experts_makes_one_tile_table_for_its_three_gemms(monkeypatch):
    from npu.deepseek_v4 import moe
    gen = torch.Generator().manual_seed(3)
    num, inter, hidden, sizes = 3, 64, 96, [5, 0, 12]
    w1, w3 = (stack([torch.randn(inter, hidden, generator=gen) * 0.3 for _ in range(num)], "fp4", 32)
              for _ in range(2))
    w2 = stack([torch.randn(hidden, inter, generator=gen) * 0.3 for _ in range(num)], "fp4", 32)
    rows = torch.randn(sum(sizes), hidden, generator=gen)
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    made = []
    real = moe.grouped_tiles
    monkeypatch.setattr(moe, "grouped_tiles", lambda e, n: made.append(n) or real(e, n))
    gemm = moe.expert_gemm(torch.device("cpu"), torch.float32)
    out = moe.grouped_swiglu(rows, ends, w1, w3, w2, None, gemm)
    assert made == [sum(sizes)]                                   # w1, w3 and w2 over one table
    dense = [w.dequantize(torch.float32) for w in (w1, w3, w2)]
    want = moe.grouped_swiglu(rows, ends, *dense, None, moe.masked_grouped_gemm)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    moe.grouped_swiglu(rows, ends.clone(), w1, w3, w2, None, gemm)     # another step's ends: a new table
    moe.grouped_swiglu(rows[:16], torch.tensor([4, 4, 16], dtype=torch.int32), w1, w3, w2, None, gemm)
    assert made == [17, 17, 16]
