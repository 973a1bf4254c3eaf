"""DeepSeek V4's clamped SwiGLU activation (moe.swiglu and moe.grouped_swiglu between their GEMMs) as one Triton
launch on a GPU.

Why: between an expert's (or the shared expert's) gate / up GEMMs and its down GEMM, torch runs a clamp of the gate,
a clamp of the up projection, the SiLU and the product: four launches over the step's [pairs, intermediate]
activations, two MoE blocks per layer. Here one launch reads gate and up once and writes the product:

    silu(min(gate, limit)) * clamp(up, -limit, limit)           (no clamp where limit is None)

with torch's roundings: the clamps are exact, the SiLU is computed in float32 and rounded to the activations' dtype
before the product, which is rounded again (bfloat16: to nearest even, by the bits). Not torch's bits: the
exponential is Triton's. tests/npu/test_dsv4_activation_triton.py checks it in Triton's interpreter against the torch
ops.

Where it applies (activation_kernel_applies): tensors on a CUDA device with Triton importable; elsewhere the torch ops
run. A torch custom op with a fake.
"""

from __future__ import annotations

import torch

from npu.triton_runtime import rounded_as, triton

BLOCK = 1024        # elements per program

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _clamped_swiglu(gate_ptr, up_ptr, out_ptr, numel, limit, CLAMP: tl.constexpr, BF16: tl.constexpr,
                        BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = at < numel
        gate = tl.load(gate_ptr + at, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + at, mask=inside, other=0.0).to(tl.float32)
        if CLAMP:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        silu = rounded_as(gate / (1.0 + tl.exp(-gate)), BF16)
        out = rounded_as(silu * up, BF16)
        tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=inside)


def activation_kernel_applies(device: torch.device) -> bool:
    """Whether the swiglus take the kernel for tensors on `device`: a CUDA device with Triton."""
    return triton is not None and device.type == "cuda"


@torch.library.custom_op("appliance::dsv4_clamped_swiglu", mutates_args=())
def clamped_swiglu_op(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) of two equal-shaped tensors (no clamp for limit None)."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    if out.numel():
        _clamped_swiglu[(triton.cdiv(out.numel(), BLOCK),)](
            gate, up, out, out.numel(), 0.0 if limit is None else limit, CLAMP=limit is not None,
            BF16=gate.dtype == torch.bfloat16, BLOCK=BLOCK)
    return out


@clamped_swiglu_op.register_fake
def _clamped_swiglu_shape(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)
