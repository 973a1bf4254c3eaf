"""The GPU's paged decode attention kernel (npu/paged_attention_triton.py), run in Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU): against attention over the gathered pages, for
random page tables and lengths (page-aligned, one token, pages shared between rows, padding past a row's length
that holds NaN), float32 and bfloat16; and the Qwen3 runner's decode rows through it against its gather + SDPA path.
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
from npu.paged_attention_triton import triton_decode_attention  # noqa: E402
from npu.qwen3.runner import Qwen3Runner  # noqa: E402
from npu.step import SeqStep, StepBatch  # noqa: E402


def gathered_attention(q, planes, pages, lengths, block: int, kv_heads: int) -> torch.Tensor:
    """The reference: each row's pages gathered, its keys cut at its length, plain softmax attention in float32."""
    rows, heads, dim = q.shape
    out = []
    for r in range(rows):
        n = int(lengths[r])
        used = pages[r, :-(-n // block)]
        k = planes[2 * used].reshape(-1, kv_heads, dim)[:n].float()
        v = planes[2 * used + 1].reshape(-1, kv_heads, dim)[:n].float()
        qr = q[r].float().view(kv_heads, heads // kv_heads, dim)
        weights = (torch.einsum("kgd,tkd->kgt", qr, k) * dim ** -0.5).softmax(-1)
        out.append(torch.einsum("kgt,tkd->kgd", weights, v).reshape(heads, dim))
    return torch.stack(out)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (32, 8)])
def test_kernel_equals_attention_over_gathered_pages(dtype, tolerance, heads, kv_heads):
    block, dim, num_pages = 16, 32, 24
    kernel = triton_decode_attention(torch.device("cpu"), dtype, heads, kv_heads, dim, block)
    gen = torch.Generator().manual_seed(heads)
    planes = torch.randn(2 * num_pages, block, kv_heads * dim, generator=gen).to(dtype)
    rng = random.Random(heads)
    lengths = [1, 16, 17, 5 * block, rng.randint(2, 6 * block)]
    width = max(-(-n // block) for n in lengths) + 1                       # padding past every row's pages
    pages = torch.tensor([rng.sample(range(num_pages), width) for _ in lengths])
    pages[1, 0] = pages[0, 0]                                              # two rows share a page
    unused = sorted(set(range(num_pages)) - {int(p) for r, n in enumerate(lengths)
                                             for p in pages[r, :-(-n // block)]})
    planes[2 * torch.tensor(unused)] = float("nan")                        # pages no row reads hold NaN
    planes[2 * torch.tensor(unused) + 1] = float("nan")
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    got = kernel(q, planes, pages, torch.tensor(lengths))
    want = gathered_attention(q, planes, pages, torch.tensor(lengths), block, kv_heads)
    assert got.dtype == dtype and not got.isnan().any()
    assert torch.allclose(got.float(), want, atol=tolerance, rtol=tolerance), (got.float() - want).abs().max()


def test_qwen3_decode_rows_through_the_kernel_match_the_gather_path():
    model = load_runtime_config(["+model=qwen3_tiny"]).model
    runners = []
    for kernel in (False, True):
        r = Qwen3Runner(model, "cpu")
        lay = model.layout
        r.paged_decode = triton_decode_attention(torch.device("cpu"), r.dtype, lay.num_heads, lay.num_kv_heads,
                                                 lay.head_dim, lay.block_size) if kernel else None
        r.load_weights()
        r.allocate_pools({"kv": 16}, 2)
        runners.append(r)
    rng = random.Random(3)
    prompts = {"a": [rng.randrange(3, 500) for _ in range(37)], "b": [rng.randrange(3, 500) for _ in range(5)]}
    tables = {"a": {"kv": [4, 9, 2]}, "b": {"kv": [7]}}
    outs = []
    for r in runners:
        for name, tokens in prompts.items():
            r.execute(StepBatch([SeqStep(name, tokens, 0, tables[name], sample=False)], new_pages=tables[name]))
        outs.append(r.execute(StepBatch([SeqStep("a", [11], 37, tables["a"]), SeqStep("b", [12], 5, tables["b"])])))
    assert torch.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    assert outs[0].argmax(-1).tolist() == outs[1].argmax(-1).tolist()
