"""Decode attention over the paged KV cache on a GPU, by a Triton kernel that reads pages in place.

Why: the gather + SDPA path copies every decode row's pages into a dense buffer per layer, and SDPA's shapes
change with the longest context every step (a new kernel choice, for cuDNN a new plan, each step); this kernel
walks each row's block table instead, with one fixed grid per batch size, so a decode step has the same
launches every step (what CUDA graph capture needs, npu/graphs.py).

One program per (row, kv head): it loads the row's query heads of that kv head (GQA: GROUP queries share the
kv head's K and V), then for each page up to the row's length loads the page's K plane [block, head_dim] straight
from the pool, scores it (float32), keeps a running max and sum (online softmax, as FlashAttention and vLLM's
paged attention do), and accumulates the page's V plane; padding past a row's length is never read. The pool is
npu/qwen3/runner.py's: one layer as [2 x pages, block, kv_heads x head_dim], page p's K plane at 2p, its V plane at 2p + 1.

Where it applies (triton_decode_attention): a CUDA device with Triton importable, float16 / bfloat16 / float32,
a block size and head_dim that are powers of two of at least 16 (tl.arange, tl.dot). Tests run it under TRITON_INTERPRET=1 on the CPU
(tests/npu/test_paged_attention_triton.py) against attention over gathered pages; make device-check on a GPU.
"""

from __future__ import annotations

import logging

import torch

from npu.triton_runtime import INTERPRETED, triton

log = logging.getLogger("npu.paged_attention_triton")

if triton is not None:
    import triton.language as tl

    # table_width changes with the longest context of an eager step; Triton would compile a variant for each of its
    # divisibility classes (a multiple of 16, 1, other) the first time one appears mid-serving: not specialized.
    @triton.jit(do_not_specialize=["table_width"])
    def _paged_decode(q_ptr, pool_ptr, table_ptr, lengths_ptr, out_ptr, table_width, scale,
                      KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
                      UPCAST: tl.constexpr):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        heads = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        slots = tl.arange(0, BLOCK)
        live = heads < GROUP
        q_rows = row * KV_HEADS * GROUP + kvh * GROUP + heads          # query head rows of this kv head
        q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + dims[None, :], mask=live[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        length = tl.load(lengths_ptr + row)
        plane = BLOCK * KV_HEADS * HEAD_DIM                               # elements of one K or V plane
        col = kvh * HEAD_DIM + dims
        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for p in range(0, tl.cdiv(length, BLOCK)):
            page = tl.load(table_ptr + row * table_width + p).to(tl.int64)
            valid = slots + p * BLOCK < length
            k_ptrs = pool_ptr + (2 * page) * plane + slots[:, None] * (KV_HEADS * HEAD_DIM) + col[None, :]
            k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)                         # [BLOCK, HEAD_DIM]
            if UPCAST:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale          # [GROUP_PAD, BLOCK]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            rescale = tl.exp(best - new_best)
            weights = tl.exp(scores - new_best[:, None])
            total = total * rescale + tl.sum(weights, axis=1)
            v = tl.load(k_ptrs + plane, mask=valid[:, None], other=0.0)                 # the page's V plane
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
            best = new_best
        out = acc / total[:, None]
        tl.store(out_ptr + q_rows[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=live[:, None])


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@torch.library.custom_op("appliance::paged_decode_attention", mutates_args=())
def paged_decode_op(query: torch.Tensor, planes: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor,
                    num_kv_heads: int, block_size: int) -> torch.Tensor:
    """The kernel as a torch op (so FakeTensorMode, CUDA graph capture and torch.compile see an op with a known
    output, not a raw launch): query [rows, heads, head_dim] -> [rows, heads, head_dim]."""
    rows, heads, head_dim = query.shape
    out = torch.empty_like(query)
    if rows == 0:
        return out
    group = heads // num_kv_heads
    _paged_decode[(rows, num_kv_heads)](
        query.contiguous(), planes, pages.contiguous(), lengths.contiguous(), out, pages.shape[1], head_dim ** -0.5,
        KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK=block_size, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",   # float32: exact, as SDPA
        UPCAST=INTERPRETED and query.dtype == torch.bfloat16)   # the interpreter's tl.dot reads bf16 as raw bits
    return out


@paged_decode_op.register_fake
def _paged_decode_shape(query: torch.Tensor, planes: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor,
                        num_kv_heads: int, block_size: int) -> torch.Tensor:
    return torch.empty_like(query)


class TritonDecodeAttention:
    """Attention of one-token rows over one layer's pool, each row over its own pages and length (the interface of
    npu.paged_attention_cpu.PagedDecodeAttention)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.num_heads, self.num_kv_heads, self.head_dim, self.block_size = num_heads, num_kv_heads, head_dim, block_size

    def __call__(self, query: torch.Tensor, planes: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor,
                 checked_longest: int | None = None) -> torch.Tensor:
        """query [rows, heads, head_dim]; planes [2 x pages, block_size, kv_heads x head_dim]; pages [rows, width]
        page ids (any integer dtype); lengths [rows], tokens each row attends to (>= 1). Returns [rows, heads,
        head_dim]. No host sync: the caller checked the page ids and lengths on the host (Qwen3Runner's layout)."""
        return paged_decode_op(query, planes, pages, lengths, self.num_kv_heads, self.block_size)


def triton_decode_attention(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                            head_dim: int, block_size: int) -> TritonDecodeAttention | None:
    """The kernel where it applies to a runner (a CUDA device, or any device under TRITON_INTERPRET=1), else None."""
    if triton is None or (device.type != "cuda" and not INTERPRETED):
        return None
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        log.info("paged decode attention (Triton) off: %s activations", dtype)
        return None
    if not (_power_of_two(block_size) and _power_of_two(head_dim) and min(block_size, head_dim) >= 16):
        log.info("paged decode attention (Triton) off: block_size %d and head_dim %d must be powers of two >= 16",
                 block_size, head_dim)
        return None
    return TritonDecodeAttention(num_heads, num_kv_heads, head_dim, block_size)
