"""DeepSeek V4's in-place attention kernel (npu/deepseek_v4/attention_triton.py), run in Triton's interpreter on the
CPU (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU): against the softmax with a sink over the rows
gathered out of the pools in float64, for a window part shared by a sequence's queries and a part picked per query,
heads past one block, queries that see nothing but the sink, NaN in every row no query may read; and the tiny model's
steps (prompts, a chunk after cached tokens, decode rows past compressed windows, the CSA indexer's picks) with the
kernel against Attention's read-out path (PoolIO.read + _attend), float32 and bfloat16.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's interpreter")]
triton = pytest.importorskip("triton")

from appliance.config.compose import load_runtime_config  # noqa: E402
from npu.deepseek_v4.attention_triton import (  # noqa: E402
    HEAD_BLOCK,
    KeyRows,
    sparse_attention,
    sparse_attention_applies,
    sparse_attention_op,
)
from npu.registry import build_runner  # noqa: E402
from npu.step import StepBatch  # noqa: E402
from tests.npu.test_device_guard import BLOCKS, DSV4, serving_steps  # noqa: E402


def reference(q, sink, parts: list[KeyRows]) -> torch.Tensor:
    """float64: each query's scores over every part's rows it sees (gathered from the pools), the sink logit in the
    softmax's denominator, the probabilities times the same rows."""
    S, Q, H, d = q.shape
    out = torch.zeros(S, Q, H, d, dtype=torch.float64)
    for s in range(S):
        for i in range(Q):
            rows, logits = [], [sink.double()[:, None]]
            for part in parts:
                page = part.page[s] if part.page.dim() == 2 else part.page[s, i]
                row = part.row[s] if part.row.dim() == 2 else part.row[s, i]
                seen = part.mask[s, i]
                keys = part.pool[page[seen], row[seen], :d].to(q.dtype).double()       # [K, d]
                rows.append(keys)
                logits.append(torch.einsum("hd,kd->hk", q[s, i].double(), keys) * d ** -0.5)
            probs = torch.cat(logits, dim=1).softmax(dim=1)[:, 1:]
            out[s, i] = probs @ torch.cat(rows)
    return out


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads", [4, HEAD_BLOCK + 4])
def test_kernel_equals_the_softmax_with_a_sink_over_gathered_rows(dtype, tolerance, heads):
    S, Q, d, pages, rows_per_page = 3, 5, 32, 12, 8
    gen = torch.Generator().manual_seed(heads)
    rng = random.Random(heads)
    window_pool = torch.randn(pages, rows_per_page, d + 8, generator=gen).to(dtype)     # rows wider than d
    picked_pool = torch.randn(pages, rows_per_page, d, generator=gen).to(dtype)
    # the window part: [S, Kw] rows shared by a sequence's queries; the picked part: [S, Q, k] rows per query
    kw, k = 19, 6
    w_page = torch.tensor([[rng.randrange(pages) for _ in range(kw)] for _ in range(S)])
    w_row = torch.tensor([[rng.randrange(rows_per_page) for _ in range(kw)] for _ in range(S)])
    w_mask = torch.rand(S, Q, kw, generator=gen) < 0.6
    p_page = torch.randint(0, pages, (S, Q, k), generator=gen)
    p_row = torch.randint(0, rows_per_page, (S, Q, k), generator=gen)
    p_mask = torch.rand(S, Q, k, generator=gen) < 0.7
    w_mask[1, 2], p_mask[1, 2] = False, False                    # a query that sees only the sink
    parts = [KeyRows(window_pool, w_page, w_row, w_mask), KeyRows(picked_pool, p_page, p_row, p_mask)]
    for part in parts:                                           # every row no query sees holds NaN
        seen = torch.zeros(part.pool.shape[:2], dtype=torch.bool)
        for s in range(S):
            for i in range(Q):
                page = part.page[s] if part.page.dim() == 2 else part.page[s, i]
                row = part.row[s] if part.row.dim() == 2 else part.row[s, i]
                seen[page[part.mask[s, i]], row[part.mask[s, i]]] = True
        part.pool[~seen] = float("nan")
    q = torch.randn(S, Q, heads, d, generator=gen).to(dtype)
    sink = torch.randn(heads, generator=gen)
    for used in (parts[:1], parts):
        got = sparse_attention(q, sink, used)
        want = reference(q, sink, used)
        assert got.shape == q.shape and got.dtype == dtype and not got.isnan().any()
        assert torch.allclose(got.double(), want, atol=tolerance, rtol=tolerance), (got.double() - want).abs().max()
        assert got[1, 2].eq(0).all()                             # nothing seen: the sink takes all the weight


def test_where_the_kernel_applies():
    assert sparse_attention_applies(torch.device("cpu"), torch.bfloat16, 512)         # in the interpreter
    assert not sparse_attention_applies(torch.device("cpu"), torch.bfloat16, 48)      # not a power of two
    assert not sparse_attention_applies(torch.device("cpu"), torch.int8, 64)


def test_op_on_fake_cuda_has_the_output_shape():
    from tests.support.fake_cuda import fake_cuda
    with fake_cuda():
        q = torch.empty(6, 4, 32, device="cuda", dtype=torch.bfloat16)
        pool = torch.empty(10, 8, 32, device="cuda", dtype=torch.bfloat16)
        table = torch.zeros(2, 7, dtype=torch.long, device="cuda")
        mask = torch.zeros(2, 3, 7, dtype=torch.bool, device="cuda")
        out = sparse_attention_op(q, torch.zeros(4, device="cuda"), 3, pool, table, table, mask, None, None, None, None)
        assert out.shape == (6, 4, 32) and out.device.type == "cuda"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dsv4_steps_through_the_kernel_match_the_read_out_path(dtype, monkeypatch):
    import npu.deepseek_v4.attention as attention_module
    calls = []

    def counted(q, sink, parts):
        calls.append(len(parts))
        return sparse_attention(q, sink, parts)
    monkeypatch.setattr(attention_module, "sparse_attention", counted)
    rc = load_runtime_config([*DSV4, f"model.layout.dtype={dtype}"])
    runners = []
    for in_place in (False, True):
        runner = build_runner(rc.model, torch.device("cpu"))
        runner.attention.in_place = in_place                 # a CPU runner reads out; the kernel in the interpreter
        runner.load_weights()
        runner.allocate_pools({g.name: BLOCKS for g in rc.model.cache_groups}, rc.decode_batch)
        runners.append(runner)
    outs = []
    for runner in runners:
        steps = serving_steps(runner)
        decode = steps[-1]
        for extra in range(2, 8):                             # decode rows past the next compressed windows
            steps.append(StepBatch([s.__class__(s.request_id, [13 + extra], s.start_pos + extra - 1, s.block_tables)
                                    for s in decode.seqs]))
        with torch.inference_mode():
            outs.append(torch.cat([runner.execute(step) for step in steps]).float())
    assert set(calls) == {1, 2}              # window-only layers, and the compressed ones (HCA, CSA's picks) too
    tolerance = 1e-4 if dtype == "float32" else 6e-2
    assert not outs[1].isnan().any()
    assert torch.allclose(outs[0], outs[1], atol=tolerance, rtol=tolerance), (outs[0] - outs[1]).abs().max()
    if dtype == "float32":
        assert outs[0].argmax(-1).tolist() == outs[1].argmax(-1).tolist()
