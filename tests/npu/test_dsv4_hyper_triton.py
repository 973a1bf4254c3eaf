"""The hyper-connections' kernels (npu/deepseek_v4/hyper_triton.py), run in Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU) against hyper's torch ops: hc_pre's mixings,
collapse and (after the same Sinkhorn) comb, and hc_post, in float32 and bfloat16, at widths off the kernel's
block; and the ops on fake CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's interpreter")]
triton = pytest.importorskip("triton")

from npu.deepseek_v4 import hyper  # noqa: E402
from npu.deepseek_v4.hyper_triton import BLOCK_D, hc_mix_op, hc_post_op, hyper_kernels_apply  # noqa: E402


def released_like(n: int, hc: int, dim: int, dtype, seed: int):
    """Streams and hc_pre's parameters of the released shapes' kind (scales near 1, small projections)."""
    gen = torch.Generator().manual_seed(seed)
    streams = torch.randn(n, hc, dim, generator=gen).to(dtype)
    fn = torch.randn(2 * hc + hc * hc, hc * dim, generator=gen) * 0.05
    base = torch.randn(2 * hc + hc * hc, generator=gen) * 0.5
    scale = 1 + torch.rand(3, generator=gen)
    return streams, fn, base, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [48, BLOCK_D + 40])                      # one block, and past one
def test_hc_pre_with_the_kernel_matches_the_torch_ops(dtype, dim, monkeypatch):
    hc, iters, eps = 4, 20, 1e-6
    streams, fn, base, scale = released_like(5, hc, dim, dtype, seed=dim)
    want = hyper.hc_pre(streams, fn, base, scale, iters, eps, 1e-6)      # CPU tensors: the torch ops
    monkeypatch.setattr(hyper, "hyper_kernels_apply", lambda device, n: True)
    got = hyper.hc_pre(streams, fn, base, scale, iters, eps, 1e-6)
    for g, w, name in zip(got, want, ("post", "comb", "collapsed")):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        tolerance = 2e-6 if g.dtype == torch.float32 else 1e-2
        assert torch.allclose(g.float(), w.float(), rtol=tolerance, atol=tolerance), (name, (g - w).abs().max())
    assert torch.allclose(got[1].sum(dim=1), torch.ones(5, hc), atol=1e-3)   # comb still doubly stochastic


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("dim", [48, BLOCK_D + 40])
def test_hc_post_kernel_matches_the_torch_ops(dtype, tolerance, dim):
    """bfloat16 to the bit: each product and the sum are rounded where torch rounds them, and the mixing sums four
    exact products in float32 (as a matmul of bf16 values does)."""
    gen = torch.Generator().manual_seed(dim)
    n, hc = 6, 4
    streams = torch.randn(n, hc, dim, generator=gen).to(dtype)
    out = torch.randn(n, dim, generator=gen).to(dtype)
    post = torch.rand(n, hc, generator=gen) * 2
    comb = hyper.sinkhorn(torch.rand(n, hc, hc, generator=gen) + 0.1, 20, 1e-6)
    want = hyper.hc_post(out, streams, post, comb)
    got = hc_post_op(out, streams, post, comb)
    assert got.shape == want.shape and got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance), (got.float() - want.float()).abs().max()


def test_where_the_kernels_apply_and_their_fakes():
    assert not hyper_kernels_apply(torch.device("cpu"), 4)
    assert hyper_kernels_apply(torch.device("cuda"), 4) and not hyper_kernels_apply(torch.device("cuda"), 3)
    from tests.support.fake_cuda import fake_cuda
    with fake_cuda():
        streams = torch.empty(3, 4, 64, device="cuda", dtype=torch.bfloat16)
        post, comb, collapsed = hc_mix_op(torch.empty(3, 24, device="cuda"), torch.empty(24, device="cuda"),
                                          torch.empty(3, device="cuda"), streams, 1e-6)
        assert (post.shape, comb.shape, collapsed.shape) == ((3, 4), (3, 4, 4), (3, 64))
        assert collapsed.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
        assert hc_post_op(torch.empty(3, 64, device="cuda", dtype=torch.bfloat16), streams, post, comb).shape == (3, 4, 64)
