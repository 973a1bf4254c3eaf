"""DeepSeek V4's indexer-score kernel (npu/deepseek_v4/indexer_triton.py), run in Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU) against Attention._index's torch ops: plain float32
rows, and float8 e4m3 / int8 rows with their inline float32 scale (as paging.quantize_rows stores them), heads past
one block, rows a query does not see (NaN there), the padding up to the ranking width, and zero-score ties kept
exactly 0; and the op on fake CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's interpreter")]
triton = pytest.importorskip("triton")

from npu.deepseek_v4.indexer_triton import FLOAT8, INT8, PLAIN, index_scores, index_scores_op, pool_values  # noqa: E402
from npu.deepseek_v4.paging import quantize_rows  # noqa: E402


def reference(q, head_w, keys, visible, width):
    """_index's torch ops on dequantized rows keys [S, K, d] (float32)."""
    d = q.shape[-1]
    dots = torch.einsum("sqhd,skd->sqhk", q.float(), keys).relu_().mul_(d ** -0.5)
    score = dots.mul_(head_w[..., None]).sum(dim=2)
    return torch.nn.functional.pad(score.masked_fill(~visible, float("-inf")), (0, width - score.shape[-1]),
                                   value=float("-inf"))


@pytest.mark.parametrize("fmt", ["float32", "float8", "int8"])
@pytest.mark.parametrize("heads", [16, 20])
def test_kernel_scores_equal_the_torch_ops(fmt, heads):
    S, Q, K, d, pages, per_page, width = 2, 3, 37, 16, 6, 8, 45
    gen = torch.Generator().manual_seed(heads)
    q = torch.randn(S, Q, heads, d, generator=gen)
    head_w = torch.randn(S, Q, heads, generator=gen)
    rows = torch.randn(pages, per_page, d, generator=gen)
    if fmt == "float32":
        pool, keys_of = rows.clone(), rows
    else:
        dtype = torch.float8_e4m3fn if fmt == "float8" else torch.int8
        raw = quantize_rows(rows, dtype)                                   # [pages, rows, d + 4] bytes
        pool = raw.view(dtype)
        scale = raw[..., d:].contiguous().view(torch.float32)
        keys_of = raw[..., :d].view(dtype).float() * scale                 # what PoolIO.read gives
    page = torch.randint(0, pages, (S, K), generator=gen)
    row = torch.randint(0, per_page, (S, K), generator=gen)
    visible = torch.rand(S, Q, K, generator=gen) < 0.7
    visible[1, 2] = False                                                  # a query that sees nothing: all -inf
    keys = keys_of[page, row]
    seen = torch.zeros(pages, per_page, dtype=torch.bool)
    for s in range(S):
        seen[page[s][visible[s].any(0)], row[s][visible[s].any(0)]] = True
    if fmt == "float32":
        pool[~seen] = float("nan")                                          # rows no query sees are never read
    values = pool_values(pool, scaled=fmt != "float32")
    assert values == {"float32": PLAIN, "float8": FLOAT8, "int8": INT8}[fmt]
    got = index_scores(q, head_w, pool, page, row, visible, width, values, d)
    want = reference(q, head_w, keys, visible, width)
    assert got.shape == (S, Q, width) and got.dtype == torch.float32
    assert torch.equal(got.isinf(), want.isinf()) and got[1, 2].isinf().all()
    finite = want.isfinite()
    assert torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5), (got[finite] - want[finite]).abs().max()


def test_a_row_no_head_scores_is_exactly_zero_as_in_torch():
    """The only way two rows tie (Attention._index breaks ties as transformers does): every head's relu is 0."""
    q = torch.ones(1, 1, 16, 16)
    keys = -torch.ones(2, 4, 16)
    page, row = torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None]
    got = index_scores(q, torch.ones(1, 1, 16), keys, page, row, torch.ones(1, 1, 4, dtype=torch.bool), 4, PLAIN)
    assert got.eq(0).all() and not got.signbit().any()


def test_formats_the_kernel_cannot_read_and_the_fake():
    assert pool_values(torch.empty(0, dtype=torch.float8_e5m2), scaled=True) is None
    assert pool_values(torch.empty(0, dtype=torch.int32), scaled=False) is None
    from tests.support.fake_cuda import fake_cuda
    with fake_cuda():
        out = index_scores_op(torch.empty(6, 16, 16, device="cuda"), torch.empty(6, 16, device="cuda"),
                              torch.empty(4, 8, 20, dtype=torch.int8, device="cuda"),
                              torch.zeros(2, 5, dtype=torch.long, device="cuda"),
                              torch.zeros(2, 5, dtype=torch.long, device="cuda"),
                              torch.zeros(2, 3, 5, dtype=torch.bool, device="cuda"), 3, 5, 9, INT8, 16)
        assert out.shape == (6, 9) and out.dtype == torch.float32 and out.device.type == "cuda"
