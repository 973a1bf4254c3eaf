"""The GPU's paged prefill attention kernel (npu/prefill_attention_triton.py), run in Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU): chunks after cached tokens against attention over
their gathered pages with the offset-causal mask, float32 and bfloat16, for pages out of order and shared, contexts
and chunks off page and tile edges, chunks longer than a query block, several chunks per call, strided query rows and
NaN in every page no chunk may read; the op on fake CUDA; and the Qwen3 runner's cached chunks (a prefix-cache hit,
a long prompt's later chunks) through it against its gather + SDPA path.
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
from npu.prefill_attention_triton import BLOCK_M, triton_prefill_attention  # noqa: E402
from npu.qwen3.runner import Qwen3Runner  # noqa: E402
from npu.step import SeqStep, StepBatch  # noqa: E402


def gathered_attention(q, planes, pages, context: int, length: int, block: int, heads: int, kv_heads: int):
    """The reference: each chunk's pages gathered, its keys cut at `context`, softmax attention in float64 with
    query i at position context - length + i seeing keys 0..position (GQA: query head h reads kv head h // group)."""
    dim = q.shape[1] // heads
    out = []
    for c in range(pages.shape[0]):
        used = pages[c, :-(-context // block)]
        k = planes[2 * used].reshape(-1, kv_heads, dim)[:context].double().repeat_interleave(heads // kv_heads, 1)
        v = planes[2 * used + 1].reshape(-1, kv_heads, dim)[:context].double().repeat_interleave(heads // kv_heads, 1)
        qc = q[c * length:(c + 1) * length].double().view(length, heads, dim)
        scores = torch.einsum("qhd,khd->hqk", qc, k) * dim ** -0.5
        positions = torch.arange(context - length, context)
        scores = scores.masked_fill(torch.arange(context)[None, :] > positions[:, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(out)


def pool_and_pages(chunks: int, context: int, block: int, kv_heads: int, dim: int, dtype, seed: int):
    """A random pool with each chunk's pages drawn out of order (chunk 1 shares chunk 0's first page), one spare
    column past every context, and NaN in every page no chunk reads and in every row past a context."""
    width = -(-context // block) + 1
    num_pages = chunks * width + 4
    gen = torch.Generator().manual_seed(seed)
    planes = torch.randn(2 * num_pages, block, kv_heads * dim, generator=gen).to(dtype)
    rng = random.Random(seed)
    pages = torch.tensor(rng.sample(range(num_pages), chunks * width)).view(chunks, width)
    if chunks > 1:
        pages[1, 0] = pages[0, 0]
    read = {int(p) for c in range(chunks) for p in pages[c, :-(-context // block)]}
    unread = torch.tensor(sorted(set(range(num_pages)) - read))
    planes[2 * unread] = float("nan")
    planes[2 * unread + 1] = float("nan")
    if context % block:                                        # and the rows past each context in its last page
        last = pages[:, (context - 1) // block]
        planes[2 * last, context % block:] = float("nan")
        planes[2 * last + 1, context % block:] = float("nan")
    return planes, pages, gen


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,block,chunks,context,length", [
    (4, 2, 16, 1, 40, 8),                  # one chunk, context and chunk off page edges
    (6, 2, 16, 3, 130, BLOCK_M + 5),       # group of 3 (not a power of two), a chunk longer than a query block,
                                           # three chunks with one shared page, context past two key tiles
    (4, 4, 32, 2, 64, 64),                 # no GQA, pages of 32, a whole context computed as one chunk
    (8, 2, 16, 1, 17, 1),                  # a one-token chunk
    (2, 1, 128, 1, 200, 70),               # pages larger than a key tile
])
def test_kernel_equals_attention_over_gathered_pages(dtype, tolerance, heads, kv_heads, block, chunks, context,
                                                      length):
    dim = 32
    kernel = triton_prefill_attention(torch.device("cpu"), dtype, heads, kv_heads, dim, block)
    planes, pages, gen = pool_and_pages(chunks, context, block, kv_heads, dim, dtype, seed=heads * block + length)
    qkv = torch.randn(chunks * length, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, :heads * dim]                                   # rows of the layer's qkv: a strided view
    got = kernel.paged(q, planes, pages, context, length, checked=True)
    want = gathered_attention(q, planes, pages, context, length, block, heads, kv_heads)
    assert got.shape == (chunks * length, heads, dim) and got.dtype == dtype and not got.isnan().any()
    assert torch.allclose(got.double(), want, atol=tolerance, rtol=tolerance), (got.double() - want).abs().max()


def test_kernel_refuses_what_it_cannot_read():
    kernel = triton_prefill_attention(torch.device("cpu"), torch.float32, 4, 2, 32, 16)
    planes, pages, _ = pool_and_pages(1, 40, 16, 2, 32, torch.float32, seed=0)
    q = torch.zeros(8, 4 * 32)
    with pytest.raises(ValueError, match="page ids checked: False"):        # the caller must have range-checked
        kernel.paged(q, planes, pages, 40, 8)
    with pytest.raises(ValueError, match="over 100 tokens"):                 # a context past the table's pages
        kernel.paged(q, planes, pages, 100, 8, checked=True)
    assert triton_prefill_attention(torch.device("cpu"), torch.float32, 4, 2, 48, 16) is None   # head_dim 48
    assert triton_prefill_attention(torch.device("cpu"), torch.int8, 4, 2, 32, 16) is None


def test_op_on_fake_cuda_has_the_output_shape():
    from npu.prefill_attention_triton import paged_prefill_op
    from tests.support.fake_cuda import fake_cuda
    with fake_cuda():
        q = torch.empty(2 * 8, 6 * 32, device="cuda", dtype=torch.bfloat16)
        planes = torch.empty(2 * 10, 16, 2 * 32, device="cuda", dtype=torch.bfloat16)
        out = paged_prefill_op(q, planes, torch.zeros(2, 4, dtype=torch.long, device="cuda"), 40, 8, 6, 2)
        assert out.shape == (16, 6, 32) and out.device.type == "cuda" and out.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_cached_chunks_through_the_kernel_match_the_gather_path(dtype):
    """A prompt prefilled in chunks of 32 (later chunks attend to cached pages), then another prompt that hits its
    first two pages in the prefix cache and computes the rest as one chunk after them, then a decode step: the
    runner with the kernel (and no CPU prefill kernel) against the runner's gather + SDPA path."""
    model = load_runtime_config(["+model=qwen3_tiny", f"model.layout.dtype={dtype}"]).model
    runners = []
    for kernel in (False, True):
        r = Qwen3Runner(model, "cpu")
        lay = model.layout
        r.prefill_attention = None                            # no CPU kernel: chunks from 0 through SDPA in both
        r.cached_prefill = triton_prefill_attention(torch.device("cpu"), r.dtype, lay.num_heads, lay.num_kv_heads,
                                                    lay.head_dim, lay.block_size) if kernel else None
        r.load_weights()
        r.allocate_pools({"kv": 24}, 2)
        runners.append(r)
    assert runners[1].cached_prefill is not None
    rng = random.Random(5)
    a = [rng.randrange(3, 500) for _ in range(90)]
    b = a[:32] + [rng.randrange(3, 500) for _ in range(21)]       # shares a's first two pages (block 16)
    pages_a, pages_b = [4, 9, 2, 11, 6, 0], [4, 9, 13, 20]
    outs = []
    for r in runners:
        logits = []
        for start in range(0, 90, 32):                            # a's chunks: 32, then 32 and 26 after cached rows
            chunk = a[start:start + 32]
            logits.append(r.execute(StepBatch([SeqStep("a", chunk, start, {"kv": pages_a})],
                                              new_pages={"kv": pages_a} if start == 0 else {})))
        logits.append(r.execute(StepBatch([SeqStep("b", b[32:], 32, {"kv": pages_b})],    # b after its cached 32
                                          new_pages={"kv": pages_b[2:]})))
        logits.append(r.execute(StepBatch([SeqStep("a", [7], 90, {"kv": pages_a}), SeqStep("b", [8], 53,
                                                                                           {"kv": pages_b})])))
        outs.append(torch.cat(logits).float())
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    assert torch.allclose(outs[0], outs[1], atol=tolerance, rtol=tolerance), (outs[0] - outs[1]).abs().max()
    if dtype == "float32":                                        # bf16 rounds in other places: near ties may part
        assert outs[0].argmax(-1).tolist() == outs[1].argmax(-1).tolist()


@pytest.mark.parametrize("decode_rows", [1, 2, 3])
def test_a_steps_page_tables_start_16_bytes_aligned(decode_rows):
    """Triton specializes a kernel on its pointers' alignment: a step's page tables (slices of its one upload) start
    on 16 bytes whatever the token count, so a new alignment never compiles a second variant mid-serving."""
    from npu.qwen3.step_layout import StepLayout
    from npu.qwen3.step_meta import StepMeta
    seqs = [SeqStep(f"d{i}", [5], 20 + i, {"kv": [i, 10 + i]}) for i in range(decode_rows)]
    seqs.append(SeqStep("c", list(range(3, 10)), 16, {"kv": [7, 8]}))                  # a chunk after cached tokens
    layout = StepLayout.build(seqs, 16, 32, 1, paged=True)
    meta = StepMeta.upload(layout, lambda n: torch.arange(n), torch.arange(2)[:, None], torch.device("cpu"))
    tables = [d.pages for d in meta.decodes] + [p.pages for p in meta.prefills if p.pages is not None]
    assert len(tables) == 2
    assert all(t.storage_offset() * t.element_size() % 16 == 0 for t in tables)
    assert meta.decodes[0].pages[:, 0].tolist() == list(range(decode_rows))              # the right values there
