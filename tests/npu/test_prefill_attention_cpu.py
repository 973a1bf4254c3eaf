"""The CPU causal prefill-attention kernel (npu.prefill_attention_cpu): every path this CPU has (the portable
loops always; AVX-512 float32, AMX bfloat16 and AVX512-BF16 bfloat16 where the CPU has them: an Intel Xeon with
AMX runs all four, an AMD Zen 4 all but AMX) against float64 attention, at the tile and
block edges, with the running max raised late in a sequence, for chunks after cached tokens reading a pool's pages
(NaN wherever they must not read), independent of the thread count and of the other sequences of a call, its
arguments checked, and used by the Qwen3 runner for both kinds of chunk (the transformers oracle,
test_qwen3_oracle.py, runs it too). Building and the fallback: test_cpu_kernels.py."""

import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from appliance.config.compose import load_runtime_config
from npu.cpu_kernels import load
from npu.kv_pairs import LAYOUT_SWITCH
from npu.prefill_attention_cpu import (
    AMX,
    AVX512,
    AVX512_BF16,
    PORTABLE,
    CausalPrefillAttention,
    available_paths,
    causal_prefill_attention,
    fast_path,
)
from npu.qwen3.runner import Qwen3Runner
from npu.step import SeqStep, StepBatch
from tests.support.threads import on_threads

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler: the runner uses SDPA (tested elsewhere)")

LENGTHS = [1, 15, 16, 17, 31, 32, 33, 47, 100, 161]     # tile (16) and block (32) edges, and a few blocks


def paths() -> set[int]:
    return available_paths(load())


def path_params():
    """(dtype, path) pairs; a fast path the CPU lacks is skipped with the reason."""
    out = []
    for dtype, path, name in ((torch.float32, PORTABLE, "portable-fp32"), (torch.bfloat16, PORTABLE, "portable-bf16"),
                              (torch.float32, AVX512, "avx512-fp32"), (torch.bfloat16, AMX, "amx-bf16"),
                              (torch.bfloat16, AVX512_BF16, "avx512bf16-bf16")):
        marks = [pytest.mark.skipif(path not in paths(), reason=f"this CPU has no {name.split('-')[0]} path")]
        out.append(pytest.param(dtype, path, id=name, marks=marks))
    return out


def packed(dtype, heads, kv_heads, head_dim, lengths, seed=0, scale=1.0):
    """The layer's qkv rows of sequences one after another: q | k | v per row, as the runner holds them."""
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(sum(lengths), (heads + 2 * kv_heads) * head_dim, generator=g)).to(dtype)


def views(qkv, heads, kv_heads, head_dim):
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    return qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]


def reference(qkv, heads, kv_heads, head_dim, lengths, dtype=torch.float64):
    """Causal attention of each sequence alone, by SDPA in `dtype`: [rows, heads, head_dim]."""
    outs, first = [], 0
    for n in lengths:
        rows = qkv[first:first + n].to(dtype).view(n, heads + 2 * kv_heads, head_dim)
        first += n
        q, k, v = (rows[:, a:b].transpose(0, 1)[None] for a, b in
                   ((0, heads), (heads, heads + kv_heads), (heads + kv_heads, heads + 2 * kv_heads)))
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


def error(got, want) -> float:
    return (got.double() - want).abs().max().item()


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 64), (12, 2, 64), (4, 4, 128), (6, 1, 64),
                                                       (4, 2, 32), (2, 1, 96), (2, 2, 256)])
@pytest.mark.parametrize("dtype, path", path_params())
def test_every_path_equals_causal_attention(dtype, path, heads, kv_heads, head_dim):
    if path == AVX512 and head_dim % 64:
        pytest.skip("the AVX-512 path takes head_dim in multiples of 64")
    if path in (AMX, AVX512_BF16) and head_dim % 32:
        pytest.skip("the bfloat16 paths take head_dim in multiples of 32")
    qkv = packed(dtype, heads, kv_heads, head_dim, LENGTHS)
    op = CausalPrefillAttention(load(), dtype, heads, kv_heads, head_dim, path)
    out = op(*views(qkv, heads, kv_heads, head_dim), LENGTHS)
    assert out.dtype == dtype and out.shape == (sum(LENGTHS), heads, head_dim)
    want = reference(qkv, heads, kv_heads, head_dim, LENGTHS)
    if dtype == torch.float32:
        assert error(out, want) < 2e-6
    else:       # no worse than torch's own bfloat16 SDPA on the same inputs (P rounded to bfloat16 in both)
        sdpa = reference(qkv, heads, kv_heads, head_dim, LENGTHS, torch.bfloat16)
        assert error(out, want) <= 1.5 * error(sdpa, want) + 1e-3


@pytest.mark.parametrize("dtype, path", path_params())
def test_a_max_that_keeps_rising_and_large_scores(dtype, path):
    """Scores that grow along the sequence (each key larger than the last: the AMX path raises its running max
    in steps and rescales its accumulator) and scores of several hundred (exp overflows without the max)."""
    heads, kv_heads, head_dim, lengths = 4, 2, 64, [300, 70]
    qkv = packed(torch.float32, heads, kv_heads, head_dim, lengths, seed=3)
    rows = qkv.view(-1, heads + 2 * kv_heads, head_dim)
    rows[:, :heads] = rows[:, :heads].abs() * 3                       # queries and keys point the same way...
    position = torch.cat([torch.arange(n, dtype=torch.float32) for n in lengths])
    rows[:, heads:heads + kv_heads] = rows[:, heads:heads + kv_heads].abs() * (0.2 + position / 25)[:, None, None]
    qkv = qkv.to(dtype)                                               # ...and later keys are longer
    op = CausalPrefillAttention(load(), dtype, heads, kv_heads, head_dim, path)
    out = op(*views(qkv, heads, kv_heads, head_dim), lengths)
    want = reference(qkv, heads, kv_heads, head_dim, lengths)
    assert torch.isfinite(out).all()
    sdpa = reference(qkv, heads, kv_heads, head_dim, lengths, dtype)   # scores of ~300 lose digits in any dtype
    assert error(out, want) <= 1.5 * error(sdpa, want) + (1e-6 if dtype == torch.float32 else 1e-3)


def paged_case(dtype, heads, kv_heads, head_dim, block_size, count, context, length, seed=0):
    """count chunks of `length` rows at the end of `context`-token contexts, each over its own shuffled pages of a
    pool whose other rows (the pages' unwritten tails, the pages nobody owns) are NaN."""
    g = torch.Generator().manual_seed(seed)
    width = -(-context // block_size)
    npages = count * width + 3
    pool = torch.full((2 * npages, block_size, kv_heads * head_dim), float("nan"))
    pages = torch.randperm(npages, generator=g)[:count * width].view(count, width)
    keys = torch.randn(count, 2, context, kv_heads * head_dim, generator=g)
    for c in range(count):
        for t in range(context):
            p = int(pages[c, t // block_size])
            pool[2 * p, t % block_size], pool[2 * p + 1, t % block_size] = keys[c, 0, t], keys[c, 1, t]
    q = torch.randn(count * length, heads * head_dim, generator=g)
    return q.to(dtype), pool.to(dtype), pages, keys.to(dtype)


def paged_reference(q, keys, heads, kv_heads, head_dim, length, dtype=torch.float64):
    """Each chunk's rows (positions context - length ..) over its context, offset-causal, by SDPA in `dtype`."""
    count, _, context, _ = keys.shape
    mask = torch.arange(context)[None, :] <= torch.arange(context - length, context)[:, None]
    outs = []
    for c in range(count):
        qc = q[c * length:(c + 1) * length].to(dtype).view(length, heads, head_dim).transpose(0, 1)[None]
        k, v = (keys[c, i].to(dtype).view(context, kv_heads, head_dim).transpose(0, 1)[None] for i in (0, 1))
        outs.append(F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("count, context, length, block_size", [(3, 50, 17, 16), (2, 300, 64, 32), (1, 33, 2, 16),
                                                                (4, 100, 100, 16)])
@pytest.mark.parametrize("dtype, path", path_params())
def test_chunks_after_cached_tokens_read_the_pages(dtype, path, count, context, length, block_size):
    """The paged entry: each chunk's rows at the end of its context, keys from the pool's pages (NaN everywhere
    else in the pool: nothing past a context or outside its pages is read), against float64 attention; a chunk
    that is its whole context (4 x 100 of 100) equals the activations entry's result."""
    heads, kv_heads, head_dim = 8, 2, 64
    q, pool, pages, keys = paged_case(dtype, heads, kv_heads, head_dim, block_size, count, context, length)
    op = CausalPrefillAttention(load(), dtype, heads, kv_heads, head_dim, path)
    out = op.paged(q, pool, pages, context, length)
    want = paged_reference(q, keys, heads, kv_heads, head_dim, length)
    assert out.shape == (count * length, heads, head_dim) and torch.isfinite(out).all()
    if dtype == torch.float32:
        assert error(out, want) < 2e-6
    else:
        sdpa = paged_reference(q, keys, heads, kv_heads, head_dim, length, torch.bfloat16)
        assert error(out, want) <= 1.5 * error(sdpa, want) + 1e-3
    if length == context:
        qkv = torch.cat([q.view(count, length, -1), keys.transpose(1, 2).reshape(count, context, -1)], -1)
        own = op(*views(qkv.reshape(count * length, -1), heads, kv_heads, head_dim), [length] * count)
        assert torch.equal(own, out)


def test_paged_arguments_that_do_not_fit_are_a_clear_error():
    op = CausalPrefillAttention(load(), torch.float32, 8, 2, 64, PORTABLE)
    q, pool, pages, _ = paged_case(torch.float32, 8, 2, 64, 16, 2, 40, 8)
    with pytest.raises(ValueError, match="2 chunks of 8 rows over 49 tokens do not fit"):
        op.paged(q, pool, pages, 49, 8)                           # more tokens than 3 pages of 16 hold
    with pytest.raises(ValueError, match="do not fit"):
        op.paged(q, pool, pages.int(), 40, 8)
    outside = pages.clone()
    outside[1, 0] = pool.shape[0] // 2
    with pytest.raises(ValueError, match=r"page ids in \[\d+, \d+\] for a pool of \d+ pages"):
        op.paged(q, pool, outside, 40, 8)



@pytest.mark.parametrize("dtype, path", path_params())
def test_sequences_do_not_depend_on_the_thread_count_or_on_each_other(dtype, path):
    heads, kv_heads, head_dim = 8, 2, 64
    qkv = packed(dtype, heads, kv_heads, head_dim, LENGTHS, seed=1)
    op = CausalPrefillAttention(load(), dtype, heads, kv_heads, head_dim, path)
    one, two, three = (on_threads(n, op, *views(qkv, heads, kv_heads, head_dim), LENGTHS) for n in (1, 2, 3))
    assert torch.equal(one, two) and torch.equal(one, three)       # a task is 16 rows of one head on one thread
    first = sum(LENGTHS[:8])                                        # the 100-token sequence, alone
    alone = op(*views(qkv[first:first + 100], heads, kv_heads, head_dim), [100])
    assert torch.equal(alone, one[first:first + 100])


def test_arguments_that_do_not_fit_the_kernel_are_a_clear_error():
    op = CausalPrefillAttention(load(), torch.float32, 8, 2, 64, PORTABLE)
    qkv = packed(torch.float32, 8, 2, 64, [10, 6])
    q, k, v = views(qkv, 8, 2, 64)
    with pytest.raises(ValueError, match="do not fit a torch.float32 kernel of 8 heads x 64, 2 kv heads"):
        op(q.to(torch.bfloat16), k, v, [10, 6])
    with pytest.raises(ValueError, match="lengths summing to 15"):
        op(q, k, v, [10, 5])
    with pytest.raises(ValueError, match="do not fit"):
        op(q, k, v, [16, 0])                                        # an empty sequence
    with pytest.raises(ValueError, match="do not fit"):
        op(q[:, :256], k, v, [10, 6])                               # 4 heads' worth of query
    with pytest.raises(ValueError, match="do not fit"):
        op(q, k.contiguous(), v, [10, 6])                           # k and v with different row strides
    with pytest.raises(ValueError, match="not available"):
        CausalPrefillAttention(load(), torch.float32, 8, 2, 64, 7)
    with pytest.raises(ValueError, match="up to 256"):                # the kernel's buffers hold 256 columns
        CausalPrefillAttention(load(), torch.float32, 2, 1, 512, PORTABLE)
    if AVX512 in paths():
        for dtype, head_dim in ((torch.float32, 96), (torch.bfloat16, 64)):
            with pytest.raises(ValueError, match="multiple of 64"):
                CausalPrefillAttention(load(), dtype, 2, 1, head_dim, AVX512)


def test_the_fast_path_is_chosen_by_dtype_head_size_and_cpu():
    every = {PORTABLE, AVX512, AMX, AVX512_BF16}
    assert fast_path(torch.bfloat16, 64, every) == (AMX, "AMX bfloat16 tiles")
    assert fast_path(torch.bfloat16, 64, every - {AMX}) == (AVX512_BF16, "AVX512-BF16 dot products")   # AMD Zen 4
    assert fast_path(torch.float32, 128, every) == (AVX512, "AVX-512 float32")
    for dtype, head_dim, have, why in ((torch.bfloat16, 64, {PORTABLE, AVX512}, "AMX"),
                                       (torch.bfloat16, 64, {PORTABLE, AVX512}, "AVX512-BF16"),
                                       (torch.bfloat16, 80, every, "multiple of 32"),
                                       (torch.float32, 64, {PORTABLE}, "AVX-512"),
                                       (torch.float32, 96, {PORTABLE, AVX512}, "multiple of 64"),
                                       (torch.float16, 64, every, "no kernel")):
        path, reason = fast_path(dtype, head_dim, have)
        assert path is None and why in reason
    assert causal_prefill_attention(torch.device("meta"), torch.float32, 8, 2, 64) is None   # CPU runners only


def chunked_prefills(rng: random.Random) -> list[StepBatch]:
    """Two steps: three chunks from position 0 (two of one length: one group for the runner), then the next chunks
    of "a" and "b" after their 37 cached tokens (one group: same start and length) and a first chunk of "d"."""
    def ids(n):
        return [rng.randrange(3, 500) for _ in range(n)]
    first = StepBatch([SeqStep("a", ids(37), 0, {"kv": [0, 1, 2]}), SeqStep("b", ids(37), 0, {"kv": [3, 4, 5]}),
                       SeqStep("c", ids(20), 0, {"kv": [6, 7]})], new_pages={"kv": list(range(8))})
    second = StepBatch([SeqStep("a", ids(21), 37, {"kv": [0, 1, 2, 8]}), SeqStep("b", ids(21), 37, {"kv": [3, 4, 5, 9]}),
                        SeqStep("d", ids(5), 0, {"kv": [10]})], new_pages={"kv": [8, 9, 10]})
    return [first, second]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_runner_sends_prefill_chunks_to_the_kernel_and_matches_sdpa(dtype, monkeypatch):
    monkeypatch.setenv(LAYOUT_SWITCH, "rows")      # SDPA gathers rows-layout pages (the kv-pairs layout: test_kv_pairs)
    name = str(dtype).split(".")[1]
    rc = load_runtime_config(["+model=qwen3_tiny", "model.layout.head_dim=64", "model.cache_groups.0.row.width=256",
                              f"model.layout.dtype={name}", f"model.cache_groups.0.row.dtype={name}"])
    runner = Qwen3Runner(rc.model, "cpu")
    path, _ = fast_path(dtype, runner.head_dim, paths())
    if path is None:
        assert runner.prefill_attention is None                     # SDPA where the kernel would not be faster
        pytest.skip("this CPU has no fast prefill path for this dtype")
    assert runner.prefill_attention is not None
    runner.load_weights()
    calls = []
    op = runner.prefill_attention

    class Counted:
        def __call__(self, q, k, v, lengths):
            calls.append(("own", list(lengths)))
            return op(q, k, v, lengths)

        def paged(self, q, planes, pages, context, length, checked=False):
            calls.append(("paged", tuple(pages.shape), context, length))
            return op.paged(q, planes, pages, context, length, checked)

    results = []
    for kernel in (Counted(), None):
        runner.prefill_attention = runner.cached_prefill = kernel     # chunks from position 0, chunks after cached
        runner.allocate_pools({"kv": 16}, 1)
        results.append([runner.execute(step).float() for step in chunked_prefills(random.Random(2))])
        runner.free_pools()
    layers = rc.model.layout.num_layers
    assert calls == ([("own", [20]), ("own", [37, 37])] * layers       # per layer: one call per group
                     + [("own", [5]), ("paged", (2, 4), 58, 21)] * layers)
    tol = 1e-5 if dtype == torch.float32 else 0.1                    # bf16: logits of ~1, rounded per layer
    for kernel_logits, sdpa_logits in zip(*results):
        assert (kernel_logits - sdpa_logits).abs().max().item() < tol
