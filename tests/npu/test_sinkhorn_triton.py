"""The hyper-connections' Sinkhorn kernel (npu/deepseek_v4/sinkhorn_triton.py) in Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 where there is no GPU): bit for bit hyper.sinkhorn, the released math, at every tile edge and
iteration count; where it is chosen; and the DeepSeek V4 runner on fake CUDA reaching it as an op with no host sync."""

from __future__ import annotations

import os

import pytest
import torch

from npu.deepseek_v4.hyper import hc_pre, sinkhorn
from npu.deepseek_v4.sinkhorn_triton import BLOCK, sinkhorn_for, triton_sinkhorn
from npu.step import SeqStep, StepBatch
from npu.triton_runtime import triton
from tests.npu.test_device_guard import DSV4, fake_runner, step, tables

pytestmark = [pytest.mark.skipif(triton is None, reason="Triton is not installed"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's interpreter")]


def mixing(tokens: int, hc: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    """What hc_pre hands sinkhorn: a softmax per row plus hc_eps (positive, rows summing to about 1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(tokens, hc, hc, generator=g) * spread, dim=-1) + 1e-6


@pytest.mark.parametrize("tokens", [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_the_kernel_gives_the_bits_of_the_released_math(tokens, iters):
    comb = mixing(tokens, 4, seed=tokens * 31 + iters)
    assert torch.equal(triton_sinkhorn(comb, iters, 1e-6), sinkhorn(comb, iters, 1e-6))


@pytest.mark.parametrize("hc", [2, 8])
def test_other_powers_of_two_and_far_from_stochastic_inputs(hc):
    comb = mixing(70, hc, seed=hc, spread=12.0)          # near one-hot rows: the sums span orders of magnitude
    out = triton_sinkhorn(comb, 20, 1e-6)
    assert torch.equal(out, sinkhorn(comb, 20, 1e-6))
    torch.testing.assert_close(out.sum(dim=1), torch.ones(70, hc), rtol=0, atol=1e-3)   # columns stochastic


def test_hc_pre_through_the_kernel_is_hc_pre():
    g = torch.Generator().manual_seed(5)
    streams, fn = torch.randn(9, 4, 32, generator=g), torch.randn(24, 128, generator=g) * 0.1
    base, scale = torch.randn(24, generator=g), torch.ones(3)
    torch_ops = hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    kernel = hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, normalize=triton_sinkhorn)
    assert all(torch.equal(a, b) for a, b in zip(torch_ops, kernel, strict=True))


def test_where_the_kernel_is_chosen():
    assert sinkhorn_for(torch.device("cuda"), 4) is triton_sinkhorn
    assert sinkhorn_for(torch.device("cpu"), 4) is sinkhorn          # the CPU keeps torch's (no interpreter there)
    assert sinkhorn_for(torch.device("cuda"), 3) is sinkhorn         # tl.arange needs a power of two


def test_the_dsv4_runner_on_fake_cuda_runs_its_hyper_connections_through_the_op():
    """A CUDA runner holds the kernel, and its forward on fake CUDA (tests/support/fake_cuda: a host sync fails) calls
    it for each hc_pre: attention's and the MoE's in every layer."""
    runner, _ = fake_runner(DSV4)
    assert runner.sinkhorn is triton_sinkhorn  # type: ignore[attr-defined]
    calls = []

    def counting(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        calls.append(tuple(comb.shape))
        return triton_sinkhorn(comb, iters, eps)
    runner.sinkhorn = counting  # type: ignore[attr-defined]
    step(runner, StepBatch([SeqStep("a", list(range(3, 35)), 0, tables(runner, 0, 128), prompt_len=32)]))
    assert calls == [(32, 4, 4)] * (2 * runner.model.layout.num_layers)
