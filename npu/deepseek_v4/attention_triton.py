"""DeepSeek V4's attention over its paged rows as one Triton kernel on a GPU: window, compressed and indexer-picked
rows read in place, one softmax with the sink logit, no dense copy and no [heads, queries, keys] scores in memory.

Why: Attention._attend reads each part of a query group's keys out of its pool into a dense tensor (PoolIO.read:
the sliding window's rows, HCA's compressed rows, the rows CSA's indexer picked for each query), then computes
[S, heads, Q, K] float32 scores per part, masks them, concatenates them with the sink, softmaxes and multiplies back:
about twenty launches per layer, and for a prefill chunk of Q tokens at 64 heads a scores tensor of 64 x Q x (Q +
window) floats (4.4 GB at Q = 4,096). Here a program takes one query token and a block of its heads, walks each
part's rows (page and row of each key, read through the step plan's tables; keys are the values: DeepSeek V4 keeps
one shared KV row per token), scores them in float32, keeps a running max and sum (online softmax, as FlashAttention)
that starts from the sink (its logit counts in the denominator, it has no value), and accumulates the same rows.

The same sums as _attend up to the order of additions: scores of the compute-dtype rows in float32 (PoolIO.read casts
the pool's rows to the compute dtype first, so does this), probabilities cast to the compute dtype before the
product with the rows, the output cast once. Rows whose mask is False are never loaded.

Where it applies (sparse_attention_for): a CUDA device with Triton importable (or any device under TRITON_INTERPRET=1,
for the tests), float16 / bfloat16 / float32 compute, a head_dim that is a power of two of at least 16, and pools of
plain values (a quantized pool with inline scales keeps PoolIO.read). tests/npu/test_dsv4_attention_triton.py runs it
in Triton's interpreter against Attention._attend over PoolIO.read's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npu.triton_runtime import INTERPRETED, triton

HEAD_BLOCK = 16     # query heads per program (tl.dot's smallest M)
KEY_BLOCK = 16      # keys per tile


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _part(acc, best, total, q, pool, page_stride, row_stride, page_ptr, row_ptr, ps, pq, pk, mask_ptr, ms, mq,
              mk, length, seq, query, scale, dims, KEYS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """One part's rows for one query: the online softmax carried through (acc, best, total)."""
        for start in range(0, length, KEYS):
            keys = start + tl.arange(0, KEYS)
            inside = keys < length
            at = seq * ps + query * pq + keys * pk
            page = tl.load(page_ptr + at, mask=inside, other=0).to(tl.int64)
            row = tl.load(row_ptr + at, mask=inside, other=0).to(tl.int64)
            seen = tl.load(mask_ptr + seq * ms + query * mq + keys * mk, mask=inside, other=0) != 0
            k = tl.load(pool + page[:, None] * page_stride + row[:, None] * row_stride + dims[None, :],
                        mask=seen[:, None], other=0.0).to(q.dtype)       # the compute dtype, as PoolIO.read
            if UPCAST:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale        # [HEADS, KEYS]
            scores = tl.where(seen[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))      # finite: the sink is in best from the start
            rescale = tl.exp(best - new_best)
            weights = tl.exp(scores - new_best[:, None])
            total = total * rescale + tl.sum(weights, axis=1)
            acc = acc * rescale[:, None] + tl.dot(weights.to(k.dtype), k, input_precision=PRECISION)
            best = new_best
        return acc, best, total

    # The query count, the parts' widths and their tables' strides change from step to step; Triton would compile a
    # variant for each of their divisibility classes the first time one appears mid-serving: not specialized.
    @triton.jit(do_not_specialize=["queries_per_seq", "a_ps", "a_pq", "a_pk", "a_ms", "a_mq", "a_mk", "a_len",
                                   "b_ps", "b_pq", "b_pk", "b_ms", "b_mq", "b_mk", "b_len"])
    def _sparse_attention(q_ptr, q_token_stride, q_head_stride, out_ptr, sink_ptr, queries_per_seq, heads, scale,
                          a_pool, a_page_stride, a_row_stride, a_page, a_row, a_ps, a_pq, a_pk, a_mask, a_ms, a_mq,
                          a_mk, a_len,
                          b_pool, b_page_stride, b_row_stride, b_page, b_row, b_ps, b_pq, b_pk, b_mask, b_ms, b_mq,
                          b_mk, b_len,
                          DIM: tl.constexpr, HEADS: tl.constexpr, KEYS: tl.constexpr, PRECISION: tl.constexpr,
                          UPCAST: tl.constexpr, TWO_PARTS: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        live = head < heads
        seq = token // queries_per_seq
        query = token % queries_per_seq
        dims = tl.arange(0, DIM)
        q = tl.load(q_ptr + token.to(tl.int64) * q_token_stride + head[:, None] * q_head_stride + dims[None, :],
                    mask=live[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        best = tl.load(sink_ptr + head, mask=live, other=0.0).to(tl.float32)     # the sink: exp(sink - best) = 1
        total = tl.full([HEADS], 1.0, tl.float32)
        acc = tl.zeros([HEADS, DIM], tl.float32)
        acc, best, total = _part(acc, best, total, q, a_pool, a_page_stride, a_row_stride, a_page, a_row, a_ps, a_pq,
                                 a_pk, a_mask, a_ms, a_mq, a_mk, a_len, seq, query, scale, dims, KEYS, PRECISION,
                                 UPCAST)
        if TWO_PARTS:
            acc, best, total = _part(acc, best, total, q, b_pool, b_page_stride, b_row_stride, b_page, b_row, b_ps,
                                     b_pq, b_pk, b_mask, b_ms, b_mq, b_mk, b_len, seq, query, scale, dims, KEYS,
                                     PRECISION, UPCAST)
        out = acc / total[:, None]
        tl.store(out_ptr + (token.to(tl.int64) * heads + head[:, None]) * DIM + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def _table_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(seq, query, key) strides of a [S, K] table shared by a sequence's queries (query stride 0) or a [S, Q, K] one."""
    return (t.stride(0), 0, t.stride(1)) if t.dim() == 2 else (t.stride(0), t.stride(1), t.stride(2))


@torch.library.custom_op("appliance::dsv4_sparse_attention", mutates_args=())
def sparse_attention_op(q: torch.Tensor, sink: torch.Tensor, queries_per_seq: int,
                        a_pool: torch.Tensor, a_page: torch.Tensor, a_row: torch.Tensor, a_mask: torch.Tensor,
                        b_pool: torch.Tensor | None, b_page: torch.Tensor | None, b_row: torch.Tensor | None,
                        b_mask: torch.Tensor | None) -> torch.Tensor:
    """q [S x Q, heads, head_dim] (head_dim contiguous) over one or two parts of rows: a part is one layer's pool
    [pages, rows, width >= head_dim], the page and row of each key ([S, K] shared by a sequence's queries or [S, Q, K]
    per query, the same strides for both) and a [S, Q, K] bool mask; sink [heads] float32. Returns [S x Q, heads,
    head_dim] in q's dtype."""
    tokens, heads, dim = q.shape
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    assert q.stride(2) == 1 and a_pool.stride(2) == 1 and (b_pool is None or b_pool.stride(2) == 1), \
        "a row's values are contiguous"
    parts = [(a_pool, a_page, a_row, a_mask)]
    if b_pool is not None:
        assert b_page is not None and b_row is not None and b_mask is not None, "a part is its pool, rows and mask"
        parts.append((b_pool, b_page, b_row, b_mask))
    args: list[object] = []
    for pool, page, row, mask in parts + parts[:1] * (2 - len(parts)):       # a missing part: never read
        assert page.stride() == row.stride(), "a part's page and row tables share their strides"
        args += [pool, pool.stride(0), pool.stride(1), page, row, *_table_strides(page), mask.view(torch.uint8),
                 *mask.stride(), page.shape[-1]]
    _sparse_attention[(tokens, triton.cdiv(heads, HEAD_BLOCK))](
        q, q.stride(0), q.stride(1), out, sink, queries_per_seq, heads, dim ** -0.5, *args,
        DIM=dim, HEADS=HEAD_BLOCK, KEYS=KEY_BLOCK, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=INTERPRETED and q.dtype == torch.bfloat16,      # the interpreter's tl.dot reads bf16 as raw bits
        TWO_PARTS=len(parts) == 2)
    return out


@sparse_attention_op.register_fake
def _sparse_attention_shape(q, sink, queries_per_seq, a_pool, a_page, a_row, a_mask, b_pool, b_page, b_row, b_mask):
    return torch.empty_like(q)


@dataclass(frozen=True)
class KeyRows:
    """One part of a query group's keys, not read: its layer's pool [pages, rows, width], the page and row of each key
    ([S, K] or [S, Q, K]) and which keys each query sees ([S, Q, K] bool)."""

    pool: torch.Tensor
    page: torch.Tensor
    row: torch.Tensor
    mask: torch.Tensor


def sparse_attention(q: torch.Tensor, sink: torch.Tensor, parts: list[KeyRows]) -> torch.Tensor:
    """q [S, Q, heads, head_dim] over one or two parts of rows, with the sink logit [heads]: [S, Q, heads, head_dim]."""
    S, Q, H, d = q.shape
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"DeepSeek V4 sparse attention takes one or two parts of keys, got {len(parts)}")
    a, b = parts[0], parts[1] if len(parts) == 2 else None
    out = sparse_attention_op(q.reshape(S * Q, H, d), sink.float(), Q, a.pool, a.page, a.row, a.mask,
                              *((b.pool, b.page, b.row, b.mask) if b is not None else (None,) * 4))
    return out.view(S, Q, H, d)


def sparse_attention_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs for a runner: a CUDA device (or Triton's interpreter) with Triton, a float compute
    dtype and a power-of-two head_dim of at least 16."""
    return (triton is not None and (device.type == "cuda" or INTERPRETED)
            and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0)
