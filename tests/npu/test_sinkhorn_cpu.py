"""The hyper-connections' Sinkhorn normalization as one C++ call on a CPU (npu/deepseek_v4/sinkhorn_cpu.py,
npu/kernels/sinkhorn.cpp): bit for bit hyper.sinkhorn, the released math, at every block edge, hc and iteration
count, on one thread and on the parallel path; where the runner chooses it; and a build with fast math, which would
reorder the sums or divide by reciprocals, is told apart by the same comparison."""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch

import npu.cpu_kernels as cpu_kernels
from appliance.config.compose import load_runtime_config
from npu.deepseek_v4.hyper import hc_pre, sinkhorn
from npu.deepseek_v4.sinkhorn_cpu import MAX_N, CpuSinkhorn, cpu_sinkhorn_for
from npu.registry import build_runner
from tests.npu.test_device_guard import DSV4

LANES = 16          # the kernel's tokens per block (npu/kernels/sinkhorn.cpp)


def kernel() -> CpuSinkhorn:
    got = cpu_sinkhorn_for(torch.device("cpu"), 4)
    if got is None:
        pytest.skip("the CPU kernels do not build here (no C++ compiler)")
    assert isinstance(got, CpuSinkhorn)
    return got


def mixing(tokens: int, hc: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    """What hc_pre hands sinkhorn: a softmax per row plus hc_eps (positive, rows summing to about 1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(tokens, hc, hc, generator=g) * spread, dim=-1) + 1e-6


@pytest.mark.parametrize("tokens", [1, LANES - 1, LANES, LANES + 1, 300])   # 300: 19 blocks, the threaded path
@pytest.mark.parametrize("hc", [2, 3, 4, 8])
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_the_kernel_gives_the_bits_of_the_released_math(tokens, hc, iters):
    comb = mixing(tokens, hc, seed=tokens * 31 + hc * 7 + iters)
    assert torch.equal(kernel()(comb, iters, 1e-6), sinkhorn(comb, iters, 1e-6))


@pytest.mark.parametrize("threads", [1, 2])
def test_far_from_stochastic_inputs_on_one_and_two_threads(threads):
    comb = mixing(4100, 4, seed=threads, spread=12.0)     # near one-hot rows: the sums span orders of magnitude
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel()(comb, 20, 1e-6)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, sinkhorn(comb, 20, 1e-6))
    torch.testing.assert_close(out.sum(dim=1), torch.ones(4100, 4), rtol=0, atol=1e-3)   # columns stochastic


def test_hc_pre_through_the_kernel_is_hc_pre():
    g = torch.Generator().manual_seed(5)
    streams, fn = torch.randn(9, 4, 32, generator=g), torch.randn(24, 128, generator=g) * 0.1
    base, scale = torch.randn(24, generator=g), torch.ones(3)
    torch_ops = hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    through = hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, normalize=kernel())
    assert all(torch.equal(a, b) for a, b in zip(torch_ops, through, strict=True))


def test_where_it_is_chosen(monkeypatch):
    model = load_runtime_config(DSV4).model
    assert isinstance(build_runner(model, torch.device("cpu")).sinkhorn, CpuSinkhorn)
    assert cpu_sinkhorn_for(torch.device("cuda"), 4) is None           # a GPU has its Triton kernel
    assert cpu_sinkhorn_for(torch.device("cpu"), MAX_N + 1) is None    # past the kernel's block
    monkeypatch.setenv(cpu_kernels.SWITCH, "0")
    assert cpu_sinkhorn_for(torch.device("cpu"), 4) is None
    assert build_runner(model, torch.device("cpu")).sinkhorn is sinkhorn


def test_a_fast_math_build_is_told_apart(tmp_path):
    """Why the source is built without -ffast-math: built with it (as the other sources are), the same comparison
    fails."""
    kernel()
    source, obj, lib = cpu_kernels.KERNELS / "sinkhorn.cpp", tmp_path / "sinkhorn.o", tmp_path / "fast.so"
    compiler = cpu_kernels.find_compiler()
    subprocess.run([compiler, *cpu_kernels.COMPILE_FLAGS, "-o", str(obj), str(source)], check=True)
    subprocess.run([compiler, *cpu_kernels.LINK_FLAGS, "-o", str(lib), str(obj)], check=True)
    fast = CpuSinkhorn(ctypes.CDLL(str(lib)))
    comb = mixing(300, 4, seed=1)
    assert not torch.equal(fast(comb, 20, 1e-6), sinkhorn(comb, 20, 1e-6))
    assert torch.equal(kernel()(comb, 20, 1e-6), sinkhorn(comb, 20, 1e-6))
