"""npu/kernels/gemm.cpp through npu.gemm_cpu: x W^T for any shape, each row a function of its own input row, nothing
written outside the output, in bfloat16 and float32; bfloat16's chosen where the CPU has AVX512-BF16 and no AMX."""

import ctypes

import pytest
import torch

from npu.cpu_kernels import SWITCH, ptr
from npu.gemm_cpu import PackedWeight, kernel_library
from npu.linear import BF16_GEMM_SWITCH, Projection, cpu_bf16_gemm

LIBS = {dtype: kernel_library(torch.device("cpu"), dtype) for dtype in (torch.bfloat16, torch.float32)}
DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(
    lib is None, reason="the kernel needs AVX-512 (bfloat16: AVX512-BF16) and the kernel build"))
    for dtype, lib in LIBS.items()]


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


def within_one_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y is x W^T rounded once to its dtype, up to the float32 sum's own error (k terms)."""
    exact = x.double() @ w.double().t()
    sum_error = x.shape[1] * 2.0 ** -23 * (x.double().abs() @ w.double().abs().t())
    rounding = (2.0 ** -8 if y.dtype == torch.bfloat16 else 2.0 ** -24) * exact.abs()
    gap = (y.double() - exact).abs()
    assert bool((gap <= rounding + sum_error).all()), float((gap - rounding - sum_error).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(16, 2), (17, 3), (48, 64), (40, 1), (1000, 777), (1536, 1024)])
def test_kernel_computes_x_times_w_transposed(n, k, dtype):
    """Every row-group size (1-14 rows and their tails), a last block of 1-16 columns, odd and even k."""
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(dtype)
    packed = PackedWeight.of(w, LIBS[dtype])
    assert packed.packed.numel() == -(-n // 16) * 16 * (k + k % 2 if dtype == torch.bfloat16 else k)
    for rows in (1, 2, 13, 14, 15, 28, 29, 100):
        x = torch.randn(rows, k, generator=g).to(dtype)
        y = packed(x)
        assert y.shape == (rows, n) and y.dtype == dtype and y.is_contiguous()
        within_one_rounding(y, x, w)
    assert packed(torch.empty(0, k, dtype=dtype)).shape == (0, n)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(TypeError, match="the GEMM kernel takes a CPU"):
        packed(torch.zeros(2, k, dtype=other))            # another dtype's bytes are never read as this one's
    with pytest.raises(TypeError, match="the GEMM kernel takes a CPU"):
        packed(torch.zeros(2, k + 1, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_depends_on_its_own_input_alone(dtype):
    """The bits of a row do not change with the batch it is in, its place there or the thread count (a request's
    greedy tokens do not move with what it is batched with)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 300, generator=g).to(dtype)
    packed = PackedWeight.of(w, LIBS[dtype])
    x = torch.randn(37, 300, generator=g).to(dtype)
    full = packed(x)
    for i in range(37):
        assert torch.equal(packed(x[i:i + 1]), full[i:i + 1])
    perm = torch.randperm(37, generator=g)
    assert torch.equal(packed(x[perm]), full[perm])
    assert torch.equal(packed(x[5:30]), full[5:30])
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(packed(x), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reads_rows_at_their_stride_and_writes_nothing_outside_the_output(dtype):
    """x rows a stride apart (a view into a wider tensor, NaN in the columns between); the output's last block has
    one column, and the values after the output keep what they held."""
    g = torch.Generator().manual_seed(9)
    n, k, rows = 33, 65, 17
    w = torch.randn(n, k, generator=g).to(dtype)
    packed = PackedWeight.of(w, LIBS[dtype])
    wide = torch.full((rows, k + 7), float("nan"), dtype=dtype)
    wide[:, :k] = torch.randn(rows, k, generator=g).to(dtype)
    x = wide[:, :k]
    guard = 64
    out = torch.full((rows * n + guard,), 7.0, dtype=dtype)
    packed.gemm(ptr(x), ctypes.c_int64(rows), ctypes.c_int64(k), ctypes.c_int64(x.stride(0)), ptr(packed.packed),
                  ctypes.c_int64(n), ptr(out), ctypes.c_int(torch.get_num_threads()))
    y = out[:rows * n].view(rows, n)
    assert torch.isfinite(y).all() and bool((out[rows * n:] == 7.0).all())
    assert torch.equal(y, packed(x.contiguous()))
    within_one_rounding(y, x, w)


@pytest.fixture
def bf16_gemm(gemm_switches):
    return lambda path, kernels=None: gemm_switches(**{BF16_GEMM_SWITCH: path, SWITCH: kernels})


def test_the_kernel_is_the_default_where_the_cpu_has_avx512_bf16_and_no_amx(bf16_gemm):
    bf16_gemm(None)
    flags = cpu_flags()
    own = "avx512_bf16" in flags and "amx_bf16" not in flags
    if "avx512_bf16" in flags and LIBS[torch.bfloat16] is None:
        pytest.skip("the kernel library did not build here (no compiler?)")
    assert (cpu_bf16_gemm() == "kernel") == own
    w = torch.randn(64, 32).to(torch.bfloat16)
    assert (Projection.of(w).kernel_packed is not None) == own
    bf16_gemm(None, kernels="0")                       # the kernels off: never the kernel
    assert cpu_bf16_gemm() != "kernel" and Projection.of(w).kernel_packed is None


def test_the_switch_chooses_and_refuses_a_typo(bf16_gemm):
    bf16_gemm("torch")
    assert cpu_bf16_gemm() == "torch"
    w = torch.randn(64, 32).to(torch.bfloat16)
    assert Projection.of(w).tensors() == [w]
    bf16_gemm("kernel")                                # on an AMX CPU too, where it is not the default
    assert (cpu_bf16_gemm() == "kernel") == ("avx512_bf16" in cpu_flags() and LIBS[torch.bfloat16] is not None)
    bf16_gemm("kernal")
    with pytest.raises(ValueError, match="APPLIANCE_CPU_BF16_GEMM='kernal': expected kernel, onednn or torch"):
        cpu_bf16_gemm()


def bf16_tiny_runner():
    """The tiny Qwen3 widened to head_dim 64 (the paged decode kernel's one-pass path) and hidden 256, in bfloat16
    (weights and pool) on the CPU, its seeded random weights loaded."""
    import dataclasses

    from appliance.config.compose import load_runtime_config
    from npu.qwen3.runner import Qwen3Runner

    m = load_runtime_config(["+model=qwen3_tiny", "model.layout.hidden_size=256", "model.layout.head_dim=64",
                             "model.layout.intermediate_size=768", "model.cache_groups.0.row.width=256"]).model
    m = dataclasses.replace(m, layout=dataclasses.replace(m.layout, dtype="bfloat16"),
                            cache_groups=(dataclasses.replace(m.cache_groups[0], row_dtype="bfloat16"),))
    runner = Qwen3Runner(m, "cpu")
    runner.load_weights()
    runner.allocate_pools({"kv": 32}, 1)
    return runner


@pytest.mark.skipif(LIBS[torch.bfloat16] is None, reason="the kernel needs AVX512-BF16 and the kernel build")
def test_a_bfloat16_sequence_gets_the_same_logits_alone_and_batched(bf16_gemm):
    """With the kernel every part of a Qwen3 step computes a row from that row alone (the projections here; the
    attention and norm kernels by their own tests), so a bfloat16 sequence's logits, prefill and decode, are the same
    bits alone and batched with other sequences: greedy output cannot move with what it is batched with. (On an AMD
    EPYC oneDNN's bf16 GEMM passes this too; on the Intel Xeon with AMX its sums changed with the row count above
    32, npu/linear.py.)"""
    from npu.step import SeqStep, StepBatch

    bf16_gemm("kernel")
    runner = bf16_tiny_runner()
    assert runner.lm_head is not None and runner.lm_head.kernel_packed is not None
    rng = torch.Generator().manual_seed(11)
    prompts = {name: torch.randint(3, 500, (n,), generator=rng).tolist() for name, n in
               (("a", 21), ("b", 5), ("c", 40))}

    def run(names: list[str], first_page: int) -> tuple[torch.Tensor, torch.Tensor]:
        pages = {name: [first_page + 3 * i + j for j in range(3)] for i, name in enumerate(names)}
        with torch.inference_mode():
            prefill = runner.execute(StepBatch([SeqStep(n, prompts[n], 0, {"kv": pages[n]}) for n in names],
                                               new_pages={"kv": [p for n in names for p in pages[n]]}))
            decode = runner.execute(StepBatch([SeqStep(n, [prompts[n][0]], len(prompts[n]), {"kv": pages[n]})
                                               for n in names]))
        return prefill[names.index("a")], decode[names.index("a")]

    alone = run(["a"], 1)
    batched = run(["c", "a", "b"], 10)
    assert alone[0].dtype == torch.bfloat16 and torch.isfinite(alone[1]).all()
    assert torch.equal(alone[0], batched[0]) and torch.equal(alone[1], batched[1])
