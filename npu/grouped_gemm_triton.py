"""Grouped GEMM with the weights read as stored (plain, FP8 with block scales, FP4 with per-32 scales), on a GPU by a
Triton kernel: out[r] = rows[r] @ W[g]^T for every row r of group g.

Why: DeepSeek V4's routed experts are FP4 (and its linears FP8). Before this, each step dequantized every layer's
whole expert stack to the compute dtype and ran torch._grouped_mm on the copy: for 256 experts of 2048 x 4096 that
is 6.4 G values per layer written and read again in bf16 (2 + 2 B each) where the weights as stored are 0.53 B
per value, and only the experts some token picked are needed at all. Here each program reads its group's weight
tile as stored, dequantizes it in registers and feeds the matrix unit: a decode step reads the picked experts once,
in FP4, and nothing the size of the stack is ever made.

Layout (what the callers hold; npu.quant.QuantizedWeight):
- rows [P, K] sorted by group; ends int32 [G], the end of each group's rows (torch._grouped_mm's offsets);
- plain weights [G, N, K] in the rows' dtype;
- FP8: e4m3 values [G, N, K], one ue8m0 scale per [block, block] tile: scales [G, ceil(N / block), ceil(K / block)];
- FP4: e2m1 codes two per byte, the low nibble first: [G, N, K / 2], one ue8m0 scale per 32 values of a row:
  scales [G, N, K / 32].
A ue8m0 byte e is 2 ** (e - 127); the scales were checked at load (no 0xFF). Values decode from their bits with
the formats' definitions, so the kernel has one meaning on every device and in Triton's interpreter.

Tiles: each group's rows are cut into BLOCK_M-row tiles, laid out group after group; group_tiles computes, on the
device in one launch, each tile's (group, first row, end row), with no host sync (where the groups' sizes are known
on the host, a quantized linear's one group or wo_a's equal row blocks, uniform_tiles makes the same table there,
uploaded once per row count; and the three GEMMs of a swiglu share one table). The grid is a static bound, cdiv(P, BLOCK_M) +
min(G, P) tiles x cdiv(N, BLOCK_N) column blocks, so a step of P rows always launches the same grid (CUDA graph
capture); tiles past the last exit at once and a group with no rows costs nothing. Each program accumulates
[BLOCK_M, BLOCK_N] in float32 over K in BLOCK_K steps and stores in the rows' dtype, as torch._grouped_mm does.

Where it applies (triton_grouped_gemm): a CUDA device with Triton importable, float16 / bfloat16 / float32 rows;
tests run it under TRITON_INTERPRET=1 on the CPU (tests/npu/test_grouped_gemm_triton.py) against dequantize +
matmul per group; make device-check on a GPU.
"""

from __future__ import annotations

import functools

import torch

from npu.quant import QuantizedWeight
from npu.triton_runtime import INTERPRETED, e4m3_values, triton

if triton is not None:
    import triton.language as tl

    # num_tiles follows the step's row count: not specialized, so a new count never compiles a new variant while
    # serving (N, K and the scales' shape are the weight's, fixed from the first call).
    @triton.jit(do_not_specialize=["num_tiles"])
    def _grouped_gemm(x_ptr, w_ptr, s_ptr, tiles_ptr, out_ptr, num_tiles, N, K, scale_rows, scale_cols,
                      FORMAT: tl.constexpr, SCALE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                      UPCAST: tl.constexpr):
        tile = tl.program_id(0)
        group = tl.load(tiles_ptr + tile)
        if group >= 0:
            row0 = tl.load(tiles_ptr + num_tiles + tile)
            row_end = tl.load(tiles_ptr + 2 * num_tiles + tile)
            rows = row0 + tl.arange(0, BLOCK_M)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            live_rows, live_cols = rows < row_end, cols < N
            g = group.to(tl.int64)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                live_k = ks < K
                a = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
                            mask=live_rows[:, None] & live_k[None, :], other=0.0)
                w_mask = live_cols[:, None] & live_k[None, :]
                if FORMAT == 0:                                              # plain: [G, N, K] in the rows' dtype
                    w = tl.load(w_ptr + g * N * K + cols[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
                elif FORMAT == 1:                                            # FP8 e4m3 bytes [G, N, K]
                    bits = tl.load(w_ptr + g * N * K + cols[:, None] * K + ks[None, :], mask=w_mask, other=0)
                    w = e4m3_values(bits.to(tl.int32))
                    s = tl.load(s_ptr + g * scale_rows * scale_cols + (cols[:, None] // SCALE_BLOCK) * scale_cols
                                + ks[None, :] // SCALE_BLOCK, mask=w_mask, other=127)
                    w = w * tl.exp2(s.to(tl.float32) - 127.0)
                else:                                                        # FP4 e2m1 pairs [G, N, K / 2]
                    half = K // 2
                    pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                    packed = tl.load(w_ptr + g * N * half + cols[:, None] * half + pairs[None, :],
                                     mask=live_cols[:, None] & (pairs[None, :] < half), other=0).to(tl.int32)
                    codes = tl.join(packed & 15, packed >> 4).reshape(BLOCK_N, BLOCK_K)   # low nibble first
                    exponent = (codes >> 1) & 3
                    mantissa = (codes & 1).to(tl.float32)
                    magnitude = tl.where(exponent == 0, mantissa * 0.5,
                                         (2.0 + mantissa) * tl.exp2((exponent - 2).to(tl.float32)))
                    w = tl.where((codes & 8) != 0, -magnitude, magnitude)
                    s = tl.load(s_ptr + g * N * scale_cols + cols[:, None] * scale_cols + ks[None, :] // 32,
                                mask=w_mask, other=127)
                    w = w * tl.exp2(s.to(tl.float32) - 127.0)
                if UPCAST:
                    a, w = a.to(tl.float32), w.to(tl.float32)
                else:
                    w = w.to(a.dtype)
                acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=live_rows[:, None] & live_cols[None, :])


FORMATS = {"plain": 0, "fp8": 1, "fp4": 2}
BLOCK_N, BLOCK_K = 64, 64


def block_m(rows: int, groups: int) -> int:
    """Rows per tile: 16 (the matrix unit's least) while groups hold a few rows each (decode: 6 pairs per token over
    256 experts), 64 once they hold many (prefill), so a weight tile is read once per 64 rows."""
    return 16 if rows < 16 * groups else 64


if triton is not None:
    @triton.jit(do_not_specialize=["groups", "num_tiles"])
    def _group_tiles(ends_ptr, out_ptr, groups, num_tiles, ROWS_PER_TILE: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_T: tl.constexpr):
        """group_tiles_torch in one program: the groups' tile counts and their running sum in registers, then for
        each tile its group (how many groups end at or before it: searchsorted right) and that group's first row,
        picked by masked sums (registers cannot be gathered)."""
        gs = tl.arange(0, BLOCK_G)
        live_g = gs < groups
        ends = tl.load(ends_ptr + gs, mask=live_g, other=0).to(tl.int64)
        starts = tl.load(ends_ptr + gs - 1, mask=live_g & (gs > 0), other=0).to(tl.int64)
        tiles = tl.where(live_g, (ends - starts + ROWS_PER_TILE - 1) // ROWS_PER_TILE, 0)
        tile_ends = tl.cumsum(tiles, 0)
        tile_starts = tile_ends - tiles
        last = gs == groups - 1                 # past the last tile: the last group's numbers (group_tiles clamps)
        last_end = tl.sum(tl.where(last, ends, 0), 0)
        last_start = tl.sum(tl.where(last, starts, 0), 0)
        last_tile = tl.sum(tl.where(last, tile_starts, 0), 0)
        for t0 in range(0, num_tiles, BLOCK_T):
            index = t0 + tl.arange(0, BLOCK_T)
            before = (tile_ends[None, :] <= index[:, None]) & live_g[None, :]
            group = tl.sum(before.to(tl.int64), 1)
            live = group < groups
            pick = gs[None, :] == group[:, None]
            start = tl.where(live, tl.sum(tl.where(pick, starts[None, :], 0), 1), last_start)
            first_tile = tl.where(live, tl.sum(tl.where(pick, tile_starts[None, :], 0), 1), last_tile)
            end = tl.where(live, tl.sum(tl.where(pick, ends[None, :], 0), 1), last_end)
            kept = index < num_tiles
            tl.store(out_ptr + index, tl.where(live, group, -1).to(tl.int32), mask=kept)
            tl.store(out_ptr + num_tiles + index, (start + (index - first_tile) * ROWS_PER_TILE).to(tl.int32),
                     mask=kept)
            tl.store(out_ptr + 2 * num_tiles + index, end.to(tl.int32), mask=kept)


def num_tiles(groups: int, num_rows: int, rows_per_tile: int) -> int:
    """The tile table's static length: every group's partial last tile at most, so no step's counts can overflow it."""
    return -(-num_rows // rows_per_tile) + min(groups, num_rows)


@torch.library.custom_op("appliance::group_tiles", mutates_args=())
def group_tiles(ends: torch.Tensor, num_rows: int, rows_per_tile: int) -> torch.Tensor:
    """int32 [3, T]: for each of the T = cdiv(num_rows, rows_per_tile) + min(G, num_rows) tiles its group (-1 past the
    last tile), first row and end row; computed on the device from the groups' ends, with no host sync. One Triton
    launch (_group_tiles) where the kernel runs, else group_tiles_torch (a dozen small ops)."""
    if not grouped_gemm_applies(ends.device, torch.float32):
        return group_tiles_torch(ends, num_rows, rows_per_tile)
    groups = ends.numel()
    total = num_tiles(groups, num_rows, rows_per_tile)
    out = torch.empty(3, total, dtype=torch.int32, device=ends.device)
    if total:
        _group_tiles[(1,)](ends.contiguous(), out, groups, total, ROWS_PER_TILE=rows_per_tile,
                           BLOCK_G=triton.next_power_of_2(max(groups, 2)), BLOCK_T=64)
    return out


@group_tiles.register_fake
def _group_tiles_shape(ends: torch.Tensor, num_rows: int, rows_per_tile: int) -> torch.Tensor:
    return torch.empty(3, num_tiles(ends.numel(), num_rows, rows_per_tile), dtype=torch.int32, device=ends.device)


def group_tiles_torch(ends: torch.Tensor, num_rows: int, rows_per_tile: int) -> torch.Tensor:
    """group_tiles in torch ops (the reference the kernel is tested against, and where Triton does not run)."""
    ends = ends.to(torch.int64)
    groups = ends.numel()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + rows_per_tile - 1) // rows_per_tile
    tile_ends = torch.cumsum(tiles, 0)
    index = torch.arange(num_tiles(groups, num_rows, rows_per_tile), device=ends.device)
    group = torch.searchsorted(tile_ends, index, right=True)
    live = group < groups
    g = group.clamp(max=groups - 1)
    first = starts[g] + (index - (tile_ends[g] - tiles[g])) * rows_per_tile
    return torch.stack([torch.where(live, group, -1), first, ends[g]]).to(torch.int32)


@functools.lru_cache(maxsize=1024)
def uniform_tiles(groups: int, rows_per_group: int, rows_per_tile: int, device: torch.device) -> torch.Tensor:
    """group_tiles for `groups` groups of rows_per_group rows each (one FP8 linear: one group; wo_a: its o_groups row
    blocks), made on the host, where all of it is known, and uploaded once per shape: a decode step's quantized
    linears then spend no launch on their tile table. The same table
    group_tiles makes, padding tiles included (tests/npu/test_grouped_gemm_triton.py); read-only to its users."""
    ends = [(g + 1) * rows_per_group for g in range(groups)]
    per_group = -(-rows_per_group // rows_per_tile)
    table = [(g, g * rows_per_group + t * rows_per_tile, ends[g]) for g in range(groups) for t in range(per_group)]
    total = groups * rows_per_group
    last = groups - 1
    for index in range(len(table), -(-total // rows_per_tile) + min(groups, total)):   # past the last: group -1
        table.append((-1, last * rows_per_group + (index - last * per_group) * rows_per_tile, ends[last]))
    host = torch.tensor(table, dtype=torch.int32).reshape(-1, 3).t().contiguous()
    return host.to(device, non_blocking=True)


@torch.library.custom_op("appliance::grouped_gemm", mutates_args=())
def grouped_gemm_op(rows: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, tiles: torch.Tensor,
                    out_features: int, fmt: str, scale_block: int, per_tile: int) -> torch.Tensor:
    """The kernel as a torch op (FakeTensorMode, graph capture and torch.compile see an op with a known output):
    rows [P, K] sorted by group, values / scale as stored (module docstring; scale empty for plain weights), tiles
    from group_tiles(ends, P, per_tile) -> [P, out_features] in the rows' dtype."""
    num_rows, k = rows.shape
    out = rows.new_empty(num_rows, out_features)
    if num_rows == 0:
        return out
    stored = values if fmt == "plain" else values.view(torch.uint8)
    scales = scale.view(torch.uint8) if scale.numel() else stored
    grid = (tiles.shape[1], triton.cdiv(out_features, BLOCK_N))
    _grouped_gemm[grid](
        rows.contiguous(), stored.contiguous(), scales.contiguous(), tiles, out, tiles.shape[1], out_features, k,
        scale.shape[-2] if scale.dim() >= 2 else 1, scale.shape[-1] if scale.dim() >= 1 else 1,
        FORMAT=FORMATS[fmt], SCALE_BLOCK=max(1, scale_block), BLOCK_M=per_tile, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if rows.dtype == torch.float32 else "tf32",      # float32: exact sums, as F.linear
        UPCAST=INTERPRETED and rows.dtype != torch.float32)     # the interpreter's tl.dot reads bf16 as raw bits
    return out


@grouped_gemm_op.register_fake
def _grouped_gemm_shape(rows: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, tiles: torch.Tensor,
                        out_features: int, fmt: str, scale_block: int, per_tile: int) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], out_features)


def weight_format(weight: torch.Tensor | QuantizedWeight) -> str:
    """'plain', 'fp8' or 'fp4': how the kernel reads this weight."""
    if not isinstance(weight, QuantizedWeight):
        return "plain"
    return "fp4" if weight.values.dtype == torch.float4_e2m1fn_x2 else "fp8"


def triton_grouped_gemm(rows: torch.Tensor, weight: torch.Tensor | QuantizedWeight, ends: torch.Tensor,
                        tiles: torch.Tensor | None = None) -> torch.Tensor:
    """rows [P, K] sorted by group @ weight[g]^T per group (weight [G, N, K] as held: plain or quantized, never
    dequantized whole); ends int32 [G]. -> [P, N] in the rows' dtype. tiles: grouped_tiles(ends, P) when the caller
    has it already (GEMMs over the same rows share one table), else made here."""
    per_tile = block_m(rows.shape[0], ends.numel())
    if tiles is None:
        tiles = group_tiles(ends, rows.shape[0], per_tile)      # outside the op: the device guard sees it sync-free
    return tiled_gemm(rows, weight, tiles, per_tile)


def grouped_tiles(ends: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The tile table triton_grouped_gemm makes for num_rows rows in the groups ending at `ends` (on the device)."""
    return group_tiles(ends, num_rows, block_m(num_rows, ends.numel()))


def tiled_gemm(rows: torch.Tensor, weight: torch.Tensor | QuantizedWeight, tiles: torch.Tensor,
               per_tile: int) -> torch.Tensor:
    """The kernel over a tile table of per_tile-row tiles (group_tiles' or uniform_tiles')."""
    fmt = weight_format(weight)
    if isinstance(weight, QuantizedWeight):
        values, scale, block = weight.values, weight.scale, weight.block
    else:
        values, scale, block = weight, rows.new_empty(0), 0
    out_features = values.shape[-2]
    if rows.shape[-1] != (values.shape[-1] * 2 if fmt == "fp4" else values.shape[-1]):
        raise ValueError(f"grouped GEMM: rows have {rows.shape[-1]} columns, the weight {tuple(values.shape)} ({fmt})")
    return grouped_gemm_op(rows, values, scale, tiles, out_features, fmt, block, per_tile)


def grouped_gemm_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernel runs here: a CUDA device (or any under TRITON_INTERPRET=1) with Triton, and a
    float16 / bfloat16 / float32 compute dtype."""
    return (triton is not None and (device.type == "cuda" or INTERPRETED)
            and dtype in (torch.float16, torch.bfloat16, torch.float32))


def triton_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [..., K] @ W^T for one quantized matrix [N, K] read as stored (the kernel with one group) -> [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    stack = QuantizedWeight(weight.name, weight.values[None], weight.scale[None], weight.block)
    per_tile = block_m(rows.shape[0], 1)
    return tiled_gemm(rows, stack, uniform_tiles(1, rows.shape[0], per_tile, rows.device), per_tile
                      ).view(*x.shape[:-1], -1)


def triton_grouped_linear(x: torch.Tensor, blocks: QuantizedWeight) -> torch.Tensor:
    """x [n, G, in]: x[:, g] @ blocks[g]^T for each of the G row blocks of one matrix, read as stored
    (QuantizedWeight.row_blocks) -> [n, G, out]; DeepSeek V4's grouped output projection wo_a, in one launch."""
    n, groups, width = x.shape
    rows = x.transpose(0, 1).reshape(groups * n, width)          # group after group, as the kernel takes rows
    per_tile = block_m(groups * n, groups)
    return tiled_gemm(rows, blocks, uniform_tiles(groups, n, per_tile, x.device), per_tile
                      ).view(groups, n, -1).transpose(0, 1)
