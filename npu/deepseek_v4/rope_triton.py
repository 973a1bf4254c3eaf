"""DeepSeek V4's RoPE rotation (npu.deepseek_v4.rope.Rotation.apply) as one Triton kernel on a GPU, to the bit.

Why: in torch a rotation is seven launches (the rope channels widened, the pairs swapped, two products, their sum,
the cast back, the concatenation with the channels it keeps), and a decode step rotates 17 times in the tiny model
(queries, keys, the compressors' pooled rows, the indexer's queries, the attention output rotated back): about 120
of its device ops (bench/count_device_ops.py). Here each rotation is one launch that reads every channel once and
writes the rotated copy.

The same numbers as Rotation.apply: a rope channel j becomes x[j] * cos[j] + x[j ^ 1] * sin[j] in float32 (sin
signed per pair: Rope.at), each product rounded, then their sum, then the cast to x's dtype: floating-point fusion
is off for this kernel (enable_fp_fusion=False), so no product is fused into the add (an FMA rounds once, torch's
separate multiply and add kernels round twice), and the cast to bfloat16 rounds to nearest even by the bits, as
torch's does (the interpreter's own cast truncates; NaN is not expected here). tests/npu/test_rope_triton.py checks
it in Triton's interpreter.

Where it applies (rotation_kernel_applies): a CUDA device with Triton importable; elsewhere the torch ops run. It is
a torch custom op with a fake (FakeTensorMode, CUDA graph capture and torch.compile see a known output).
"""

from __future__ import annotations

import torch

from npu.triton_runtime import INTERPRETED, triton

BLOCK_ROWS = 4      # heads (rows of x past its first dim) per program

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rotate(x_ptr, cos_ptr, sin_ptr, out_ptr, HEADS: tl.constexpr, WIDTH: tl.constexpr,
                DIM: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr, TO_BF16: tl.constexpr):
        token = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_W)
        live = (heads[:, None] < HEADS) & (cols[None, :] < WIDTH)
        at = (token.to(tl.int64) * HEADS + heads[:, None]) * WIDTH + cols[None, :]
        x = tl.load(x_ptr + at, mask=live, other=0.0)
        rope = cols - (WIDTH - DIM)                  # the channel's index among the rope channels (< 0: kept)
        is_rope = (rope >= 0) & (cols < WIDTH)
        partner = tl.load(x_ptr + (at - cols[None, :] + (cols ^ 1)[None, :]), mask=live & is_rope[None, :],
                          other=0.0)
        k = tl.where(is_rope, rope, 0)
        cos = tl.load(cos_ptr + token.to(tl.int64) * DIM + k, mask=is_rope, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + token.to(tl.int64) * DIM + k, mask=is_rope, other=0.0).to(tl.float32)
        rotated = x.to(tl.float32) * cos[None, :] + partner.to(tl.float32) * sin[None, :]
        if TO_BF16:                                  # round to nearest even by the bits (as torch's cast)
            bits = rotated.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            cast = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            cast = rotated.to(x.dtype)
        out = tl.where(is_rope[None, :], cast, x)
        tl.store(out_ptr + at, out, mask=live)


def rotation_kernel_applies(device: torch.device) -> bool:
    """Whether Rotation.apply takes the kernel for tensors on `device`: a CUDA device with Triton (the tests run the op
    itself in the interpreter on the CPU)."""
    return triton is not None and device.type == "cuda"


@torch.library.custom_op("appliance::rope_rotate", mutates_args=())
def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, ..., width] with its trailing dim = cos.shape[-1] channels rotated in interleaved pairs by cos / sin
    [N, dim] (sin signed per pair, Rope.at): Rotation.apply's result, in one launch."""
    x = x.contiguous()
    out = torch.empty_like(x)
    tokens, width, dim = x.shape[0], x.shape[-1], cos.shape[-1]
    heads = x.numel() // max(tokens * width, 1)
    if out.numel() == 0:
        return out
    options = {} if INTERPRETED else {"enable_fp_fusion": False}    # separate rounding of products and sum
    grid = (tokens, triton.cdiv(heads, BLOCK_ROWS))
    _rotate[grid](x, cos.contiguous(), sin.contiguous(), out, HEADS=heads, WIDTH=width, DIM=dim,
                  BLOCK_W=triton.next_power_of_2(width), BLOCK_H=BLOCK_ROWS, TO_BF16=x.dtype == torch.bfloat16,
                  **options)
    return out


@rotate.register_fake
def _rotate_shape(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)
