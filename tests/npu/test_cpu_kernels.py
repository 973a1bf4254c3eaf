"""The compiled CPU kernels (npu.cpu_kernels, npu.fused_norms): built once per sources, compiler and CPU;
loading them leaves the process's float32 math alone; off, with the reason logged, without a compiler or
when switched off; and the fused norms equal the torch ops they replace (to the bit in bfloat16, where
torch rounds at the same places)."""

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from appliance.config.compose import load_runtime_config
from npu import cpu_kernels
from npu.fused_norms import CpuFusedNorms, TorchNorms, layer_norms
from npu.paged_attention_cpu import paged_decode_attention
from npu.qwen3.runner import Qwen3Runner

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler: runners use torch ops (tested elsewhere)")


def test_it_is_built_once_per_sources_compiler_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("APPLIANCE_KERNEL_CACHE", str(tmp_path))
    first = cpu_kernels.build()
    assert first.parent == tmp_path and first.name.startswith("appliance_kernels-")
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == stamp   # from the cache
    assert [p.name for p in tmp_path.iterdir()] == [first.name]                # no temporary left


def test_loading_the_library_keeps_denormals():
    """-ffast-math objects are linked without -ffast-math: GCC < 13 would add crtfastmath.o, which sets
    flush-to-zero for the whole process when the library loads."""
    cpu_kernels.load()
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 1).item() != 0.0 and (torch.tensor([1e-38]) * 0.01).item() != 0.0


def test_without_a_working_compiler_the_runner_keeps_torch_ops_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("APPLIANCE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", shutil.which("false"))
    with caplog.at_level(logging.WARNING, logger="npu.cpu_kernels"):
        assert paged_decode_attention(torch.device("cpu"), torch.float32, 8, 2, 64, 16) is None
    assert "CPU kernels unavailable" in caplog.text and "false" in caplog.text
    assert list(tmp_path.iterdir()) == []                 # the failed build left nothing behind
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))   # a compiler that does not exist: still no crash
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="npu.cpu_kernels"):
        assert paged_decode_attention(torch.device("cpu"), torch.float32, 8, 2, 64, 16) is None
    assert "no-such-g++" in caplog.text
    rc = load_runtime_config(["+model=qwen3_tiny"])
    runner = Qwen3Runner(rc.model, "cpu")
    assert runner.paged_decode is None and type(runner.norms) is TorchNorms
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("APPLIANCE_CPU_KERNELS", "0")
    runner = Qwen3Runner(rc.model, "cpu")
    assert runner.paged_decode is None and type(runner.norms) is TorchNorms
    monkeypatch.delenv("APPLIANCE_CPU_KERNELS")
    assert paged_decode_attention(torch.device("meta"), torch.float32, 8, 2, 64, 16) is None
    assert type(layer_norms(torch.device("meta"), torch.float32, 1e-6)) is TorchNorms
    assert paged_decode_attention(torch.device("cpu"), torch.float16, 8, 2, 64, 16) is None
    assert type(layer_norms(torch.device("cpu"), torch.float32, 1e-6)) is CpuFusedNorms


def rope_rows(n: int, hd: int, dtype) -> torch.Tensor:
    """[n, 2, hd]: cos, then the signed sin (-sin | sin), of positions 0..n-1 (as Qwen3Runner._rope)."""
    inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(n, dtype=torch.float32) * 37, inv)
    emb = torch.cat((freqs, freqs), -1)
    return torch.stack((emb.cos(), torch.cat((-freqs.sin(), freqs.sin()), -1)), 1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fused_norms_equal_the_torch_ops(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    fused, ref = layer_norms(torch.device("cpu"), dtype, 1e-6), TorchNorms(1e-6)
    assert isinstance(fused, CpuFusedNorms)
    hidden, heads, hd, inter = 512, 10, 64, 384

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def same(a, b):
        if dtype is torch.bfloat16:       # rounded where torch rounds: a differing element is a float32 sum
            assert (a != b).float().mean().item() < 0.002      # added in another order, landing across a tie
            assert torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=1e-6)
        else:
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)

    x, w = rand(rows, hidden, scale=3), rand(hidden)
    same(fused.rms_norm(x, w), ref.rms_norm(x, w))

    delta = rand(rows, hidden)
    x1, x2 = x.clone(), x.clone()
    same(fused.add_rms_norm_(x1, delta, w), ref.add_rms_norm_(x2, delta, w))
    assert torch.equal(x1, x2) and torch.equal(x1, x + delta)   # the residual stream, rounded as torch's add

    qkv = rand(rows, (heads + 2) * hd)
    qw, rope = rand(heads, hd), rope_rows(rows, hd, dtype)
    q1, q2 = qkv.clone(), qkv.clone()
    fused.qk_norm_rope_(q1, heads, qw, rope)
    ref.qk_norm_rope_(q2, heads, qw, rope)
    same(q1, q2)
    assert torch.equal(q1[:, heads * hd:], qkv[:, heads * hd:])   # v untouched

    gate_up = rand(rows, 2 * inter, scale=2)
    same(fused.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))
    assert torch.equal(ref.silu_and_mul(gate_up), F.silu(gate_up[:, :inter]) * gate_up[:, inter:])


def test_fused_norms_hand_what_they_do_not_fit_to_torch():
    """A non-contiguous input, another dtype or a 3-d tensor take the torch ops, not a wrong pointer walk."""
    fused = layer_norms(torch.device("cpu"), torch.float32, 1e-6)
    x = torch.randn(8, 1024)[:, ::2]                       # strided
    w = torch.randn(512)
    assert torch.allclose(fused.rms_norm(x, w), F.rms_norm(x, (512,), w, 1e-6))
    x16 = torch.randn(4, 512, dtype=torch.float16)
    assert torch.equal(fused.rms_norm(x16, w.half()), F.rms_norm(x16, (512,), w.half(), 1e-6))
    x3 = torch.randn(2, 3, 512)
    assert torch.allclose(fused.rms_norm(x3, w), F.rms_norm(x3, (512,), w, 1e-6))
