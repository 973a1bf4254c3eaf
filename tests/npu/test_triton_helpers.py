"""npu/triton_runtime.py's helpers the kernels share, in Triton's interpreter: e4m3_values (float8 e4m3 bytes decoded
by integer ops, for GPUs without a float8 type) against torch's float8_e4m3fn, every code."""

from __future__ import annotations

import pytest
import torch

from npu.triton_runtime import e4m3_values, triton

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _decode(codes_ptr, out_ptr, BLOCK: tl.constexpr):
        at = tl.arange(0, BLOCK)
        tl.store(out_ptr + at, e4m3_values(tl.load(codes_ptr + at).to(tl.int32)))


def test_every_finite_e4m3_code_decodes_to_torchs_value():
    codes = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256, dtype=torch.float32)
    _decode[(1,)](codes, out, BLOCK=256)
    expected = codes.view(torch.float8_e4m3fn).float()
    finite = ~expected.isnan()                                  # 0x7F and 0xFF: NaN, which quantized data never holds
    assert int(finite.sum()) == 254
    assert torch.equal(out[finite], expected[finite])           # subnormals, zero and -0 magnitudes, 448 included
    assert torch.equal(out[finite].signbit(), expected[finite].signbit())
