"""npu.linear.Projection: every path computes x W^T, whatever the row count, and holds what it says."""

import pytest
import torch
import torch.nn.functional as F

from npu.linear import (
    BF16_GEMM_SWITCH,
    EXACT_ROWS,
    FP32_GEMM_SWITCH,
    ONEDNN_PACK_ROWS,
    Projection,
    cpu_bf16_gemm,
    cpu_fp32_gemm,
    onednn_rows,
)

ROWS = [0, 1, 2, 7, 32, 64, 65, 300]


@pytest.fixture
def fp32_gemm(gemm_switches):
    """Force the float32 path by its switch (None: the default)."""
    return lambda path: gemm_switches(**{FP32_GEMM_SWITCH: path})


@pytest.fixture
def bf16_gemm(gemm_switches):
    """Force the bfloat16 path by its switch (the kernel where this CPU has AVX512-BF16, oneDNN, torch; None: the
    default)."""
    return lambda path: gemm_switches(**{BF16_GEMM_SWITCH: path})


@pytest.mark.parametrize("gemm", ["mkl", "onednn", "torch", "kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16384, 512), (96, 64)])      # packed by MKL in fp32 / left plain
def test_projection_equals_x_times_w_transposed(dtype, shape, gemm, fp32_gemm, bf16_gemm):
    fp32_gemm(gemm if dtype == torch.float32 else None)
    bf16_gemm(gemm if dtype == torch.bfloat16 and gemm != "mkl" else None)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g).to(dtype)
    proj = Projection.of(w)
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=g).to(dtype)
        y = proj(x)
        assert y.shape == (rows, shape[0]) and y.dtype == dtype and y.is_contiguous()
        exact = x.double() @ w.double().t()
        # the float32 reference's own rounding, or one bf16 rounding of the output plus the sum's
        tol = 1e-4 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(y.double(), exact, rtol=tol, atol=tol * float(exact.abs().amax()) if rows else 0.0)


ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
MKL = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


@pytest.mark.parametrize(("switch", "chosen"), [(None, "onednn" if ONEDNN else "torch"),
                                                 ("mkl", "mkl" if MKL else "torch"),
                                                 ("onednn", "onednn" if ONEDNN else "torch"), ("torch", "torch")])
def test_float32_gemm_defaults_to_onednn_and_the_switch_chooses(fp32_gemm, switch, chosen):
    """oneDNN is the default on every CPU maker (the fastest on AMD; on Intel within 10-40% of MKL's packed GEMM
    for a third of its memory, npu/linear.py); the switch picks another; each path holds what it says."""
    fp32_gemm(switch)
    assert cpu_fp32_gemm() == chosen
    w = torch.randn(16384, 512)                  # large enough for MKL to pack (PACKED_MAX_GROWTH)
    proj = Projection.of(w)
    if chosen == "onednn":
        assert proj.weight is None and proj.mkl_packed is None and proj.tensors() == [proj.onednn_packed]
    elif chosen == "mkl":
        assert proj.onednn_packed is None and proj.weight is w and proj.mkl_packed is not None
    else:
        assert proj.tensors() == [w]


def test_float32_gemm_switch_refuses_a_typo(fp32_gemm):
    fp32_gemm("mlk")
    with pytest.raises(ValueError, match="APPLIANCE_CPU_FP32_GEMM='mlk': expected mkl, onednn, torch or kernel"):
        cpu_fp32_gemm()


ONEDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_bfloat16_weight_is_held_once_on_the_path_this_cpu_takes(bf16_gemm):
    """With the project's kernel (AVX512-BF16 without AMX) or oneDNN bf16 (avx512bw/vl/dq or avx_ne_convert): only
    the packed copy. Without either (an AVX2 host, where torch refuses the reorder): only the plain weight, and the
    projection is F.linear bit for bit."""
    bf16_gemm(None)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 128, generator=g).to(torch.bfloat16)
    proj = Projection.of(w)
    if cpu_bf16_gemm() == "kernel":
        assert proj.weight is None and proj.onednn_packed is None and proj.kernel_packed is not None
        assert proj.tensors() == [proj.kernel_packed.packed] and proj.kernel_packed.packed.numel() == w.numel()
        assert proj.shape == (256, 128)
        return
    if ONEDNN_BF16:
        assert proj.weight is None and proj.tensors() == [proj.onednn_packed]
        return
    assert proj.onednn_packed is None and proj.mkl_packed is None and proj.tensors() == [w]
    for rows in ROWS:
        x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
        assert torch.equal(proj(x), F.linear(x, w))


class EmulatedOneDnn:
    """oneDNN's two bf16 ops as Projection calls them, emulated with plain matmuls so the packed path's
    bookkeeping runs on any CPU: the "packed" weight is W^T (another layout, as oneDNN's blocked one is), so
    a path that read it as the plain weight would compute the wrong shape."""

    def __init__(self):
        self.reorders, self.calls, self.rows = [], [], []

    def reorder(self, weight: torch.Tensor, batch_size: int) -> torch.Tensor:
        self.reorders.append((weight.shape, batch_size))
        return weight.t().contiguous()

    def linear(self, x, packed, bias, attr, scalars, algorithm):
        self.calls.append((bias, attr, scalars, algorithm))
        self.rows.append(x.shape[0])
        return x @ packed


def test_packed_bfloat16_path_with_onednn_emulated(monkeypatch, fp32_gemm, bf16_gemm):
    """The packed path where oneDNN bf16 cannot run (this AVX2 host): packed once at ONEDNN_PACK_ROWS, the
    plain weight dropped, every call routed to the packed copy with no bias and no fused activation."""
    bf16_gemm("onednn")
    onednn = EmulatedOneDnn()
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", onednn.reorder)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", onednn.linear)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    proj = Projection.of(w)
    assert onednn.reorders == [((96, 64), ONEDNN_PACK_ROWS)]
    assert proj.weight is None and proj.mkl_packed is None and proj.tensors() == [proj.onednn_packed]
    for rows in ROWS:
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        torch.testing.assert_close(proj(x), F.linear(x, w))
    assert onednn.calls == [(None, "none", [], "")] * len(ROWS)
    assert onednn.rows == [onednn_rows(r) for r in ROWS]                # oneDNN sees bucketed row counts only
    fp32_gemm("mkl")
    assert Projection.of(w.float()).onednn_packed is None          # float32 takes oneDNN only where chosen


def test_row_buckets_bound_the_row_counts_onednn_sees_and_the_extra_rows():
    """oneDNN builds a primitive per row count (npu.linear's docstring): every count up to EXACT_ROWS runs as it is,
    larger ones at a bucket at most 1/16 larger, 128 buckets up to 2,048 rows, each bucket its own bucket."""
    buckets = [onednn_rows(r) for r in range(1, 8193)]
    assert buckets[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))
    assert all(r <= b <= r + r / 16 for r, b in enumerate(buckets, start=1))
    assert buckets == sorted(buckets)
    assert len(set(buckets[:2048])) == 128 and len(set(buckets)) == 128 + 2 * 16
    assert all(onednn_rows(b) == b for b in set(buckets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_equal_an_exact_call_at_the_bucket(dtype, fp32_gemm, bf16_gemm):
    """A call between buckets keeps the rows a call at its bucket computes, bit for bit (the extra rows are zeros
    and dropped), so a row's value depends on the bucket, as it would on the row count."""
    fp32_gemm("onednn")
    bf16_gemm("onednn")
    if dtype == torch.bfloat16 and not ONEDNN_BF16:
        pytest.skip("oneDNN bf16 does not run on this CPU (the emulated test covers the path)")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(384, 256, generator=g).to(dtype)
    proj = Projection.of(w)
    assert proj.onednn_packed is not None
    for rows in (33, 65, 300):
        x = torch.randn(rows, 256, generator=g).to(dtype)
        full = torch.cat([x, torch.zeros(onednn_rows(rows) - rows, 256, dtype=dtype)])
        y = proj(x)
        assert y.shape == (rows, 384) and y.is_contiguous()
        assert torch.equal(y, proj(full)[:rows])
