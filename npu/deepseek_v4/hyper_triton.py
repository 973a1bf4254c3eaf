"""The hyper-connections' elementwise math (hyper.hc_pre's mixings and collapse, hyper.hc_post) as one Triton launch
each on a GPU.

Why: around each sub-layer hc_pre turns its projection of the streams into three mixings (a sigmoid for pre, one for
post, a row softmax for comb, each a multiply, an add and the activation) and collapses the streams with pre (a
product and a sum), and hc_post spreads the output back and mixes the streams (casts, a product, a batched matmul, a
sum): about eighteen launches per sub-layer on a few kilobytes (bench/count_device_ops.py: a quarter of the tiny
model's decode-step ops), two sub-layers per layer. Here hc_pre's part after its projection is one launch (then the
Sinkhorn kernel), hc_post is one.

    hc_mix(mixes, base, scale, streams, eps) -> (post, comb, collapsed):
        pre  = sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
        post = sigmoid(mixes[:, hc:2hc] * scale[1] + base[hc:2hc]) * 2
        comb = softmax(mixes[:, 2hc:] * scale[2] + base[2hc:], over each row of hc) + eps       (before Sinkhorn)
        collapsed = sum_h pre[h] * streams[h], in float32, cast to the streams' dtype
    hc_post(out, streams, post, comb) -> post[i] * out + sum_j comb[j, i] * streams[j], each product and the sum
        rounded to the streams' dtype as torch rounds them (bfloat16: to nearest even, by the bits)

Not the same bits as the torch ops: the exponentials and the sums over the streams run in another order and precision
(tl.exp), so results may part in the last places; tests/npu/test_dsv4_hyper_triton.py checks them in Triton's
interpreter against hyper's torch ops, the GPU oracle against transformers on the device.

Where it applies (hyper_kernels_apply): tensors on a CUDA device with Triton importable and hc a power of two (the
released hc_mult is 4); elsewhere hyper's torch ops run. Torch custom ops with fakes, as the other kernels.
"""

from __future__ import annotations

import torch

from npu.triton_runtime import rounded_as, triton

BLOCK_D = 256        # channels of the streams per program


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _hc_mix(mixes_ptr, base_ptr, scale_ptr, streams_ptr, post_ptr, comb_ptr, collapsed_ptr, width, dim, eps,
                HC: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        h = tl.arange(0, HC)
        row = mixes_ptr + token * width
        pre_x = tl.load(row + h) * tl.load(scale_ptr) + tl.load(base_ptr + h)
        pre = 1.0 / (1.0 + tl.exp(-pre_x)) + eps
        if block == 0:                                     # the mixings, once per token
            post_x = tl.load(row + HC + h) * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + h)
            tl.store(post_ptr + token * HC + h, 2.0 * (1.0 / (1.0 + tl.exp(-post_x))))
            cells = h[:, None] * HC + h[None, :]
            comb_x = tl.load(row + 2 * HC + cells) * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + cells)
            e = tl.exp(comb_x - tl.max(comb_x, axis=1)[:, None])
            tl.store(comb_ptr + token * HC * HC + cells, e / tl.sum(e, axis=1)[:, None] + eps)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        inside = cols < dim
        s = tl.load(streams_ptr + (token * HC + h[:, None]) * dim + cols[None, :], mask=inside[None, :],
                    other=0.0).to(tl.float32)                                          # [HC, BLOCK]
        collapsed = rounded_as(tl.sum(pre[:, None] * s, axis=0), BF16)
        tl.store(collapsed_ptr + token * dim + cols, collapsed.to(collapsed_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _hc_post(out_ptr, streams_ptr, post_ptr, comb_ptr, result_ptr, dim, HC: tl.constexpr, BLOCK: tl.constexpr,
                 BF16: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < dim
        h = tl.arange(0, HC)
        s = tl.load(streams_ptr + (token * HC + h[:, None]) * dim + cols[None, :], mask=inside[None, :],
                    other=0.0).to(tl.float32)                                          # [HC (j), BLOCK]
        o = tl.load(out_ptr + token * dim + cols, mask=inside, other=0.0).to(tl.float32)
        for i in tl.static_range(HC):
            spread = rounded_as(rounded_as(tl.load(post_ptr + token * HC + i), BF16) * o, BF16)
            weights = rounded_as(tl.load(comb_ptr + token * HC * HC + h * HC + i), BF16)           # comb[j, i]
            mixed = rounded_as(tl.sum(weights[:, None] * s, axis=0), BF16)
            value = rounded_as(spread + mixed, BF16)
            tl.store(result_ptr + (token * HC + i) * dim + cols, value.to(result_ptr.dtype.element_ty), mask=inside)


def hyper_kernels_apply(device: torch.device, hc: int) -> bool:
    """Whether hc_pre / hc_post take the kernels for tensors on `device`: a CUDA device with Triton, hc a power of two
    (the tests run the ops themselves in the interpreter on the CPU)."""
    return triton is not None and device.type == "cuda" and hc > 0 and hc & (hc - 1) == 0


@torch.library.custom_op("appliance::dsv4_hc_mix", mutates_args=())
def hc_mix_op(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [N, 2 hc + hc^2] float32 (the streams' projection), base [2 hc + hc^2], scale [3], streams [N, hc, D]
    -> (post [N, hc], comb [N, hc, hc] before Sinkhorn, both float32; collapsed [N, D] in the streams' dtype)."""
    n, hc, dim = streams.shape
    post = torch.empty(n, hc, dtype=torch.float32, device=streams.device)
    comb = torch.empty(n, hc, hc, dtype=torch.float32, device=streams.device)
    collapsed = torch.empty(n, dim, dtype=streams.dtype, device=streams.device)
    if n:
        streams = streams.contiguous()
        _hc_mix[(n, triton.cdiv(dim, BLOCK_D))](
            mixes.contiguous(), base.float().contiguous(), scale.float().contiguous(), streams, post, comb, collapsed,
            mixes.shape[1], dim, eps, HC=hc, BLOCK=BLOCK_D, BF16=streams.dtype == torch.bfloat16)
    return post, comb, collapsed


@hc_mix_op.register_fake
def _hc_mix_shape(mixes, base, scale, streams, eps):
    n, hc, dim = streams.shape
    return (streams.new_empty(n, hc, dtype=torch.float32), streams.new_empty(n, hc, hc, dtype=torch.float32),
            streams.new_empty(n, dim))


@torch.library.custom_op("appliance::dsv4_hc_post", mutates_args=())
def hc_post_op(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """hyper.hc_post: out [N, D], streams [N, hc, D], post [N, hc], comb [N, hc, hc] -> [N, hc, D]."""
    n, hc, dim = streams.shape
    result = torch.empty(n, hc, dim, dtype=streams.dtype, device=streams.device)
    if n:
        _hc_post[(n, triton.cdiv(dim, BLOCK_D))](out.contiguous(), streams.contiguous(), post.float().contiguous(),
                                                 comb.float().contiguous(), result, dim, HC=hc, BLOCK=BLOCK_D,
                                                 BF16=streams.dtype == torch.bfloat16)
    return result


@hc_post_op.register_fake
def _hc_post_shape(out, streams, post, comb):
    return torch.empty_like(streams, memory_format=torch.contiguous_format)
