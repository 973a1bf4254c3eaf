"""DeepSeek V4's RMS norms (attention.rms_norm and hyper.unweighted_rms) as one Triton launch each on a GPU.

Why: in torch an RMS norm is six or seven launches (the float32 copy, the squares, their mean, + eps, rsqrt, the
products, the cast back), and the model normalizes often: attn_norm and ffn_norm per layer, the q-LoRA latent and
the KV row, every query head without a weight, the compressors' pooled rows, the hyper-connections' streams before
each mixing (bench/count_device_ops.py: about 240 of the tiny model's decode-step ops). Here a program normalizes one
row: a pass summing the squares in float32, then a pass writing the scaled row.

The same formulas, step for step, as the torch functions they replace:
    rms_norm(x, w, eps)        (w * (xf * rsqrt(mean(xf^2) + eps))).to(x.dtype), xf = x in float32
    unweighted_rms(x, eps)     x * rsqrt(mean(xf^2) + eps).to(x.dtype), the product rounded to x.dtype
with each rounding where torch rounds (a cast to bfloat16 rounds to nearest even by the bits, as torch's does; the
interpreter's own cast truncates). Not the same bits: the squares are summed in another order than torch's
reduction, so results can differ in the last place; tests/npu/test_dsv4_norms_triton.py checks them in Triton's
interpreter against the torch functions, the GPU oracle against transformers on the device.

Where it applies (norm_kernel_applies): tensors on a CUDA device with Triton importable; elsewhere the torch ops run.
Each is a torch custom op with a fake (FakeTensorMode, graph capture and torch.compile see a known output).
"""

from __future__ import annotations

import torch

from npu.triton_runtime import rounded_as, triton

MAX_BLOCK = 1024     # columns per pass of a row's loop


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rms_rows(x_ptr, w_ptr, out_ptr, width, eps, BLOCK: tl.constexpr, WEIGHTED: tl.constexpr,
                  BF16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * width
        squares = tl.zeros([BLOCK], tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row + cols, mask=cols < width, other=0.0).to(tl.float32)
            squares += x * x
        inv = 1.0 / tl.sqrt_rn(tl.sum(squares, axis=0) / width + eps)
        if not WEIGHTED:                                   # rsqrt(...).to(x.dtype): rounded before the product
            inv = rounded_as(inv, BF16)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < width
            x = tl.load(x_ptr + row + cols, mask=inside, other=0.0).to(tl.float32)
            if WEIGHTED:
                y = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32) * (x * inv)
            else:
                y = x * inv
            tl.store(out_ptr + row + cols, rounded_as(y, BF16).to(out_ptr.dtype.element_ty), mask=inside)


def norm_kernel_applies(device: torch.device) -> bool:
    """Whether the norms take the kernel for tensors on `device`: a CUDA device with Triton (the tests run the ops
    themselves in the interpreter on the CPU)."""
    return triton is not None and device.type == "cuda"


def _launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    width = x.shape[-1]
    if out.numel() == 0:
        return out
    _rms_rows[(x.numel() // width,)](x, x if weight is None else weight.contiguous(), out, width, eps,
                                     BLOCK=min(MAX_BLOCK, triton.next_power_of_2(width)), WEIGHTED=weight is not None,
                                     BF16=x.dtype == torch.bfloat16)
    return out


@torch.library.custom_op("appliance::dsv4_rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """attention.rms_norm over the last dim of x: (weight * (xf * rsqrt(mean(xf^2) + eps))).to(x.dtype)."""
    return _launch(x, weight, eps)


@rms_norm_op.register_fake
def _rms_norm_shape(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("appliance::dsv4_unweighted_rms", mutates_args=())
def unweighted_rms_op(x: torch.Tensor, eps: float) -> torch.Tensor:
    """hyper.unweighted_rms over the last dim of x: x * rsqrt(mean(xf^2) + eps).to(x.dtype)."""
    return _launch(x, None, eps)


@unweighted_rms_op.register_fake
def _unweighted_rms_shape(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)
