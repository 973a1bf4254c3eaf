"""DeepSeek V4's lightning-indexer scores as one Triton kernel on a GPU: the compressed index rows read in place (float8
or int8 with their inline scale, or plain floats), no [queries, heads, rows] tensor in memory.

Why: Attention._index reads every compressed index row a query group may rank (PoolIO.read: an index, the bytes
viewed as values and as their scale, a product, a `where`), then computes sum_h w_h relu(q_h . k) / sqrt(d) as an
einsum into [S, Q, heads, rows] float32, three passes over it and a sum over the heads, then masks and pads: about a
dozen launches per CSA layer, and a tensor 64 heads deep (for a 4,096-token prefill chunk ranking 16k rows, 17 GB).
Here a program takes one query token and a block of rows: it loads the rows it may see (page and row through the
step plan's tables), dequantizes them, scores them against all the token's heads at once in float32 and writes one
score per row, -inf for rows the token does not see and for the padding up to the ranking width. The top-k and its
tie rule stay in Attention._index.

The same formula as _index's torch ops up to the order of additions: rows dequantized as PoolIO.read does (the value
in float32 times its float32 scale), each head's dot product relu'd and scaled by 1 / sqrt(d), times the head's
weight, summed over the heads. A score made of zero terms (every head's relu 0: how two rows tie) is exactly 0 in
both, so the ties _index breaks as transformers does stay ties.

Where it applies: where the attention kernel does (a GPU runner with Triton: Attention.in_place); the index pool's
rows either 1-byte values (float8 e4m3 or int8) with a float32 scale after them, or plain float rows.
tests/npu/test_dsv4_indexer_triton.py runs it in Triton's interpreter against the torch ops.
"""

from __future__ import annotations

import torch

from npu.triton_runtime import e4m3_values, triton

ROW_BLOCK = 32      # compressed rows per program

PLAIN, FLOAT8, INT8 = 0, 1, 2      # how a pool row holds its values (VALUES)


if triton is not None:
    import triton.language as tl

    # the kernel's view of the three (a jitted function reads a module global only as a tl.constexpr)
    PLAIN_ROWS, FLOAT8_ROWS = tl.constexpr(PLAIN), tl.constexpr(FLOAT8)

    # The query count, the rows ranked and the tables' strides change from step to step: not specialized (Triton would
    # compile a variant per divisibility class the first time one appears mid-serving).
    @triton.jit(do_not_specialize=["queries_per_seq", "num_rows", "width", "ps", "pk", "ms", "mq", "mk"])
    def _index_scores(q_ptr, w_ptr, pool_ptr, page_stride, row_stride, page_ptr, row_ptr, ps, pk, mask_ptr, ms, mq, mk,
                      out_ptr, queries_per_seq, num_rows, width, heads, scale,
                      DIM: tl.constexpr, HEADS: tl.constexpr, ROWS: tl.constexpr, VALUES: tl.constexpr,
                      SCALE_AT: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        seq = token // queries_per_seq
        query = token % queries_per_seq
        h = tl.arange(0, HEADS)
        live = h < heads
        dims = tl.arange(0, DIM)
        q = tl.load(q_ptr + (token * heads + h[:, None]) * DIM + dims[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)                                               # [HEADS, DIM]
        w = tl.load(w_ptr + token * heads + h, mask=live, other=0.0).to(tl.float32)
        inside = rows < num_rows
        page = tl.load(page_ptr + seq * ps + rows * pk, mask=inside, other=0).to(tl.int64)
        row = tl.load(row_ptr + seq * ps + rows * pk, mask=inside, other=0).to(tl.int64)
        seen = inside & (tl.load(mask_ptr + seq * ms + query * mq + rows * mk, mask=inside, other=0) != 0)
        at = pool_ptr + page * page_stride + row * row_stride                              # each row's first byte
        if VALUES == PLAIN_ROWS:
            k = tl.load(at[:, None] + dims[None, :], mask=seen[:, None], other=0.0).to(tl.float32)
        else:
            raw = tl.load(at[:, None] + dims[None, :], mask=seen[:, None], other=0)         # [ROWS, DIM] bytes
            if VALUES == FLOAT8_ROWS:
                values = e4m3_values(raw.to(tl.int32))           # no float8 type: an A100 has none
            else:
                values = raw.to(tl.int8, bitcast=True).to(tl.float32)
            row_scale = tl.load((at + SCALE_AT).to(tl.pointer_type(tl.float32)), mask=seen, other=0.0)
            k = values * row_scale[:, None]
        dots = tl.dot(q, tl.trans(k), input_precision="ieee")                               # [HEADS, ROWS]
        score = tl.sum(tl.maximum(dots, 0.0) * scale * w[:, None], axis=0)
        score = tl.where(seen, score, float("-inf"))
        tl.store(out_ptr + token * width + rows, score, mask=rows < width)


def index_scores(q: torch.Tensor, head_w: torch.Tensor, pool: torch.Tensor, page: torch.Tensor, row: torch.Tensor,
                 visible: torch.Tensor, width: int, values: int, scale_at: int = 0) -> torch.Tensor:
    """q [S, Q, heads, d] and head_w [S, Q, heads] of a query group, over the compressed index rows of one layer's
    pool [pages, rows, row bytes or values] at (page, row) [S, K], each query seeing those `visible` [S, Q, K] marks:
    scores [S, Q, width] float32 (width >= K; -inf where a query sees no row). values: PLAIN (the pool's float values),
    FLOAT8 or INT8 (the pool's bytes hold d values, then at byte scale_at the row's float32 scale)."""
    S, Q, H, d = q.shape
    K = page.shape[1]
    return index_scores_op(q.reshape(S * Q, H, d).contiguous(), head_w.reshape(S * Q, H).contiguous(), pool, page,
                           row, visible, Q, K, width, values, scale_at).view(S, Q, width)


@torch.library.custom_op("appliance::dsv4_index_scores", mutates_args=())
def index_scores_op(q: torch.Tensor, head_w: torch.Tensor, pool: torch.Tensor, page: torch.Tensor, row: torch.Tensor,
                    visible: torch.Tensor, queries_per_seq: int, num_rows: int, width: int, values: int,
                    scale_at: int) -> torch.Tensor:
    """The kernel as a torch op: q [S x Q, heads, d], head_w [S x Q, heads] -> [S x Q, width] float32."""
    tokens, heads, d = q.shape
    out = torch.empty(tokens, width, dtype=torch.float32, device=q.device)
    if tokens == 0 or width == 0:
        return out
    assert page.stride() == row.stride() and pool.stride(-1) == 1, "row tables share strides; a row's values are dense"
    data = pool if values == PLAIN else pool.view(torch.uint8)
    _index_scores[(tokens, triton.cdiv(width, ROW_BLOCK))](
        q, head_w, data, data.stride(0), data.stride(1), page, row, page.stride(0), page.stride(1),
        visible.view(torch.uint8), *visible.stride(), out, queries_per_seq, num_rows, width, heads, d ** -0.5,
        DIM=d, HEADS=max(16, triton.next_power_of_2(heads)), ROWS=ROW_BLOCK, VALUES=values, SCALE_AT=scale_at)
    return out


@index_scores_op.register_fake
def _index_scores_shape(q, head_w, pool, page, row, visible, queries_per_seq, num_rows, width, values, scale_at):
    return q.new_empty(q.shape[0], width, dtype=torch.float32)


def pool_values(pool: torch.Tensor, scaled: bool) -> int | None:
    """How the kernel reads an index pool's rows (PLAIN, FLOAT8, INT8), or None where it cannot."""
    if not scaled:
        return PLAIN if pool.dtype in (torch.float32, torch.bfloat16, torch.float16) else None
    return {torch.float8_e4m3fn: FLOAT8, torch.int8: INT8}.get(pool.dtype)
