"""Fixtures shared by the npu tests."""

import pytest

from npu.linear import cpu_bf16_gemm, cpu_fp32_gemm


@pytest.fixture
def gemm_switches(monkeypatch):
    """Set environment switches of the CPU GEMM choice (None unsets one), e.g. APPLIANCE_CPU_FP32_GEMM="mkl", and
    forget the cached choices, so a test takes a path whatever this CPU's default is (every path runs on either
    CPU kind)."""
    def force(**switches: str | None) -> None:
        for name, value in switches.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        cpu_bf16_gemm.cache_clear()
        cpu_fp32_gemm.cache_clear()
    yield force
    cpu_bf16_gemm.cache_clear()
    cpu_fp32_gemm.cache_clear()
