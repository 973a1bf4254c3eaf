"""Manifold-constrained hyper-connections: hc_mult residual streams per token instead of one residual.

Before each sub-layer (attention, MoE) a learned projection of the RMS-normalized streams gives three
mixings: `pre` collapses the streams into the sub-layer's input, `post` spreads its output back over the
streams, and `comb` (made doubly stochastic by Sinkhorn iterations, so mixing never amplifies) mixes the
streams themselves: streams' = post x out + comb^T streams. At the end `hc_head` collapses the streams.
The mixing math runs in float32; the streams keep the compute dtype.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from npu.deepseek_v4.hyper_triton import hc_mix_op, hc_post_op, hyper_kernels_apply
from npu.deepseek_v4.norms_triton import norm_kernel_applies, unweighted_rms_op


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalized over the last dim, no weight; one launch on a GPU (npu.deepseek_v4.norms_triton)."""
    if norm_kernel_applies(x.device):
        return unweighted_rms_op(x, eps)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


SINKHORN_LANES = 64    # tokens padded to a multiple of this: see sinkhorn


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[N, n, n] positive matrices -> doubly stochastic: columns first, then rows and columns alternately,
    each normalization x / (sum + eps) as released (transformers' DeepseekV4HyperConnection), iters of them.

    The matrices are tiny (hc x hc per token), so the 2 x iters - 1 normalizations cost kernel launches, not
    arithmetic. They run in place on one [n + 1, n + 1, tokens] buffer whose extra row and column hold eps: a
    row's (column's) sum over the padded buffer is its sum + eps, so each normalization is two launches (sum,
    divide) instead of three and allocates only the sums. Tokens are last, so both sums reduce over an outer
    dimension one element after the other, eps last: the released math's additions in its order. Padding
    the tokens to a multiple of SINKHORN_LANES keeps torch's CPU reduction on its vectorized path, which adds
    in that order for every lane (its tail path does not), so the result is bitwise the released one
    (tests/npu/test_dsv4_parts.py). The padding tokens are eps matrices, normalized like the others and dropped."""
    num, n, _ = comb.shape
    padded = comb.new_full((n + 1, n + 1, -(-num // SINKHORN_LANES) * SINKHORN_LANES), eps)
    matrices = padded[:n, :n]                                   # [n, n, tokens], a view
    matrices[..., :num] = comb.permute(1, 2, 0)
    rows_eps, cols_eps = padded[:n], padded[:, :n]              # each row (column) with its eps
    matrices.div_(cols_eps.sum(dim=0, keepdim=True))
    for _ in range(iters - 1):
        matrices.div_(rows_eps.sum(dim=1, keepdim=True))
        matrices.div_(cols_eps.sum(dim=0, keepdim=True))
    return matrices[..., :num].permute(2, 0, 1).contiguous()


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
           hc_eps: float, norm_eps: float,
           normalize: Callable[[torch.Tensor, int, float], torch.Tensor] = sinkhorn
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [N, hc, D] -> (post [N, hc], comb [N, hc, hc], collapsed sub-layer input [N, D]). Each result
    is a new tensor, so the + eps and x 2 after the activations run in place. normalize: sinkhorn, or the same math
    in one launch on a GPU (npu.deepseek_v4.sinkhorn_triton). On a GPU the mixings and the collapse are one launch
    too (npu.deepseek_v4.hyper_triton)."""
    n, hc, _ = streams.shape
    mixes = F.linear(unweighted_rms(streams.flatten(1).float(), norm_eps), fn.float())
    if hyper_kernels_apply(streams.device, hc):
        post, comb, collapsed = hc_mix_op(mixes, base, scale, streams, hc_eps)
        return post, normalize(comb, iters, hc_eps), collapsed
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b).add_(hc_eps)
    post = torch.sigmoid(post_w * post_s + post_b).mul_(2)
    comb = torch.softmax(comb_w.view(n, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1).add_(hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, normalize(comb, iters, hc_eps), collapsed


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The sub-layer's output spread over the streams plus the mixed streams (comb applied transposed); one launch on
    a GPU (npu.deepseek_v4.hyper_triton)."""
    if hyper_kernels_apply(streams.device, streams.shape[1]):
        return hc_post_op(out, streams, post, comb)
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """The final collapse of the streams [N, hc, D] -> [N, D] (sigmoid weights, no mixing)."""
    mixes = F.linear(unweighted_rms(streams.flatten(1).float(), norm_eps), fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
