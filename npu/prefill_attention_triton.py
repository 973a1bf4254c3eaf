"""Causal attention of prefill chunks after cached tokens on a GPU, by a Triton kernel that reads the pages in place.

Why: a chunk that starts after cached tokens (a long prompt's later chunks, a prefix-cache hit) attends to its
whole context, most of it already in the paged pool. The gather + SDPA path copied every page of that context into
a dense K / V buffer per layer before attending (a 16k-token context of 8 kv heads x 128 in bf16 is 64 MB copied per
layer per chunk) and built an offset-causal mask for it; this kernel walks the chunk's block table instead, as the
decode kernel (npu/paged_attention_triton.py) does for one-token rows and as vLLM's prefix-prefill and unified
Triton attention kernels do. Chunks from position 0 keep SDPA's causal flash kernel: their keys are their own rows.

One program per (block of BLOCK_M query tokens, chunk, query head): it loads the block's queries, then for each tile
of BLOCK_N keys up to the block's last position (causal: nothing past it is read) finds each key's page in the
chunk's table and its row in the page, loads those K rows straight from the pool ([BLOCK_N, head_dim], a tile may
span pages), scores them in float32 with the offset-causal mask (query i of a chunk of `length` tokens ending at
`context` sits at position context - length + i), keeps a running max and sum (online softmax), and accumulates
the same rows of the V plane. The pool is npu/qwen3/runner.py's: one layer as [2 x pages, block, kv_heads x
head_dim], page p's K plane at 2p, its V plane at 2p + 1.

Where it applies (triton_prefill_attention): a CUDA device with Triton importable (or any device under
TRITON_INTERPRET=1, for the tests), float16 / bfloat16 / float32, a block size and head_dim that are powers of two
of at least 16. tests/npu/test_prefill_attention_triton.py runs it in Triton's interpreter against attention over
the gathered pages and the Qwen3 runner's cached chunks through it against its gather + SDPA path.
"""

from __future__ import annotations

import logging

import torch

from npu.triton_runtime import INTERPRETED, triton

log = logging.getLogger("npu.prefill_attention_triton")

BLOCK_M = 64      # query tokens per program: one tile of scores is [BLOCK_M, BLOCK_N]
BLOCK_N = 64      # keys per tile, gathered across pages


if triton is not None:
    import triton.language as tl

    # length, context and table_width change from step to step; Triton would compile a variant for each of their
    # divisibility classes the first time one appears mid-serving: not specialized.
    @triton.jit(do_not_specialize=["length", "context", "table_width"])
    def _paged_prefill(q_ptr, q_stride, pool_ptr, table_ptr, table_width, out_ptr, length, context, scale,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                       TILE_M: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        block_m = tl.program_id(0)
        chunk = tl.program_id(1)
        head = tl.program_id(2)
        kv_head = head // (HEADS // KV_HEADS)
        dims = tl.arange(0, HEAD_DIM)
        index = block_m * TILE_M + tl.arange(0, TILE_M)                  # query tokens of this block, in the chunk
        live = index < length
        rows = chunk * length + index                                     # their rows of the flat batch
        q = tl.load(q_ptr + rows[:, None] * q_stride + head * HEAD_DIM + dims[None, :], mask=live[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        first = context - length                                         # position of the chunk's first token
        positions = first + index
        end = first + tl.minimum(length, (block_m + 1) * TILE_M)          # keys up to the block's last position
        plane = BLOCK * KV_HEADS * HEAD_DIM                               # elements of one K or V plane
        col = kv_head * HEAD_DIM + dims
        best = tl.full([TILE_M], float("-inf"), tl.float32)
        total = tl.zeros([TILE_M], tl.float32)
        acc = tl.zeros([TILE_M, HEAD_DIM], tl.float32)
        for start in range(0, end, TILE_N):
            keys = start + tl.arange(0, TILE_N)
            valid = keys < end
            page = tl.load(table_ptr + chunk * table_width + keys // BLOCK, mask=valid, other=0).to(tl.int64)
            k_rows = (2 * page) * plane + (keys % BLOCK) * (KV_HEADS * HEAD_DIM)     # each key's row in its K plane
            k = tl.load(pool_ptr + k_rows[:, None] + col[None, :], mask=valid[:, None], other=0.0)   # [TILE_N, HD]
            if UPCAST:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale      # [TILE_M, TILE_N]
            seen = valid[None, :] & (keys[None, :] <= positions[:, None])
            scores = tl.where(seen, scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))          # finite: key 0 is seen by every query
            rescale = tl.exp(best - new_best)
            weights = tl.exp(scores - new_best[:, None])
            total = total * rescale + tl.sum(weights, axis=1)
            v = tl.load(pool_ptr + k_rows[:, None] + plane + col[None, :], mask=valid[:, None], other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
            best = new_best
        out = acc / total[:, None]
        tl.store(out_ptr + (rows[:, None] * HEADS + head) * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=live[:, None])


@torch.library.custom_op("appliance::paged_prefill_attention", mutates_args=())
def paged_prefill_op(query: torch.Tensor, planes: torch.Tensor, pages: torch.Tensor, context: int, length: int,
                     num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The kernel as a torch op (FakeTensorMode and torch.compile see an op with a known output, not a raw launch):
    query [count x length, heads x head_dim] rows (each row's elements contiguous) -> [count x length, heads,
    head_dim]."""
    rows = query.shape[0]
    head_dim = query.shape[1] // num_heads
    out = torch.empty(rows, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if rows == 0:
        return out
    count = pages.shape[0]
    _paged_prefill[(triton.cdiv(length, BLOCK_M), count, num_heads)](
        query, query.stride(0), planes, pages.contiguous(), pages.shape[1], out, length, context, head_dim ** -0.5,
        HEADS=num_heads, KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK=planes.shape[1], TILE_M=BLOCK_M,
        TILE_N=max(BLOCK_N, planes.shape[1]), PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST=INTERPRETED and query.dtype == torch.bfloat16)   # the interpreter's tl.dot reads bf16 as raw bits
    return out


@paged_prefill_op.register_fake
def _paged_prefill_shape(query: torch.Tensor, planes: torch.Tensor, pages: torch.Tensor, context: int, length: int,
                         num_heads: int, num_kv_heads: int) -> torch.Tensor:
    return query.new_empty(query.shape[0], num_heads, query.shape[1] // num_heads)


class TritonPrefillAttention:
    """Chunks after cached tokens over one layer's pool (the `paged` interface of
    npu.prefill_attention_cpu.CausalPrefillAttention)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.num_heads, self.num_kv_heads, self.head_dim, self.block_size = num_heads, num_kv_heads, head_dim, block_size

    def paged(self, q: torch.Tensor, planes: torch.Tensor, pages: torch.Tensor, context: int, length: int,
              checked: bool = False) -> torch.Tensor:
        """q [count x length, heads x head_dim] row views (each row's elements contiguous), chunk c's rows c x
        length..; each chunk attends causally to the first `context` tokens of its pages (its own last, already
        written to the pool); planes [2 x pages, block_size, kv_heads x head_dim]; pages [count, width] page ids.
        Returns [count x length, heads, head_dim]. No host sync: the page ids are the caller's to check on the host
        (`checked` must say it did: Qwen3Runner's StepLayout.build)."""
        count, width = pages.shape
        nh, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if (not checked or q.shape != (count * length, nh * hd) or q.stride(1) != 1 or not planes.is_contiguous()
                or planes.shape[1:] != (self.block_size, kvh * hd) or q.dtype != planes.dtype
                or not 1 <= length <= context <= width * self.block_size):
            raise ValueError(f"paged prefill attention (Triton): q {tuple(q.shape)} {q.stride()} {q.dtype}, planes "
                             f"{tuple(planes.shape)} {planes.dtype}, pages {tuple(pages.shape)}, {count} chunks of "
                             f"{length} rows over {context} tokens (page ids checked: {checked}) do not fit a kernel "
                             f"of {nh} heads x {hd}, {kvh} kv heads, block {self.block_size}")
        return paged_prefill_op(q, planes, pages, context, length, nh, kvh)


def triton_prefill_attention(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                             head_dim: int, block_size: int) -> TritonPrefillAttention | None:
    """The kernel where it applies to a runner (a CUDA device, or any device under TRITON_INTERPRET=1), else None."""
    if triton is None or (device.type != "cuda" and not INTERPRETED):
        return None
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        log.info("paged prefill attention (Triton) off: %s activations", dtype)
        return None
    power_of_two = all(n >= 16 and n & (n - 1) == 0 for n in (block_size, head_dim))
    if not power_of_two or num_heads % num_kv_heads:
        log.info("paged prefill attention (Triton) off: block_size %d and head_dim %d must be powers of two >= 16, "
                 "%d heads a multiple of %d kv heads", block_size, head_dim, num_heads, num_kv_heads)
        return None
    return TritonPrefillAttention(num_heads, num_kv_heads, head_dim, block_size)
