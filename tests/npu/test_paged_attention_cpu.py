"""The CPU paged decode-attention kernel (npu.paged_attention_cpu): exact against attention over gathered
pages, reads nothing past a row's length, independent of the thread count, its indices checked before it
runs, and used by the Qwen3 runner on CPU, where the transformers oracle (test_qwen3_oracle.py) runs it.
Building, caching and the fallback without a compiler: test_cpu_kernels.py."""

import random
import shutil

import pytest
import torch

from appliance.config.compose import load_runtime_config
from npu.cpu_kernels import load
from npu.paged_attention_cpu import PagedDecodeAttention, amx_applies, paged_decode_attention
from npu.qwen3.runner import Qwen3Runner
from npu.step import SeqStep, StepBatch
from tests.support.threads import on_threads

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler: the runner uses gather + SDPA (tested elsewhere)")

LENGTHS = (1, 15, 16, 17, 50, 200)


def kernel(dtype, heads, kv_heads, head_dim, block_size) -> PagedDecodeAttention:
    op = paged_decode_attention(torch.device("cpu"), dtype, heads, kv_heads, head_dim, block_size)
    assert op is not None, "the kernel did not build (see the log)"
    return op


def scattered(dtype, heads, kv_heads, head_dim, block_size, seed=0):
    """A pool of 64 pages, rows of LENGTHS over shuffled pages, and a NaN page padding every table: the kernel
    must stop at each row's length."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(2 * 64, block_size, kv_heads * head_dim, generator=g).to(dtype)
    poison = 63
    pool[2 * poison:2 * poison + 2] = float("nan")
    width = max(-(-n // block_size) for n in LENGTHS) + 1
    free = list(range(poison))
    random.Random(seed).shuffle(free)
    table = torch.full((len(LENGTHS), width), poison, dtype=torch.long)
    for r, n in enumerate(LENGTHS):
        for i in range(-(-n // block_size)):
            table[r, i] = free.pop()
    query = torch.randn(len(LENGTHS), heads, head_dim, generator=g).to(dtype)
    return query, pool, table, torch.tensor(LENGTHS)


def reference(query, pool, table, lengths, kv_heads):
    """Each row's K and V gathered page by page, float32 softmax attention, GQA by repeating kv heads."""
    rows, heads, hd = query.shape
    out = torch.empty(rows, heads, hd)
    for r in range(rows):
        n = int(lengths[r])
        pages = table[r, :-(-n // pool.shape[1])]
        k = pool[2 * pages].reshape(-1, kv_heads, hd)[:n].float().repeat_interleave(heads // kv_heads, 1)
        v = pool[2 * pages + 1].reshape(-1, kv_heads, hd)[:n].float().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,khd->hk", query[r].float(), k) * hd ** -0.5
        out[r] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(8, 2, 64, 16), (4, 4, 32, 8), (16, 2, 128, 32),
                                                                    (6, 3, 80, 16)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_kernel_equals_attention_over_gathered_pages(dtype, tol, heads, kv_heads, head_dim, block_size):
    query, pool, table, lengths = scattered(dtype, heads, kv_heads, head_dim, block_size)
    op = kernel(dtype, heads, kv_heads, head_dim, block_size)
    out = op(query, pool, table, lengths)
    assert torch.equal(op(query, pool, table, lengths, checked_longest=max(LENGTHS)), out)   # the runner's call
    want = reference(query, pool, table, lengths, kv_heads)
    assert out.dtype == dtype and out.shape == query.shape
    assert torch.isfinite(out).all()                      # the NaN page past every row's length is never read
    assert (out.float() - want).abs().max().item() < tol * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(12, 2, 64, 16), (16, 4, 64, 8), (16, 2, 128, 32),
                                                                    (7, 7, 64, 16), (32, 2, 128, 16)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_unwritten_rows_of_each_last_page_never_reach_an_output(dtype, tol, heads, kv_heads, head_dim, block_size):
    """The one-pass AVX-512 path (head_dim 64 / 128) reads 16-key blocks: NaN in the K and V rows past each row's
    length on its last page (a block's tail, pages of 8 keys, heads in groups of 1 to 16 per kv head) stays out of
    the scores and the sums; the outputs are the reference's, whatever the thread count."""
    query, pool, table, lengths = scattered(dtype, heads, kv_heads, head_dim, block_size, seed=3)
    for r, n in enumerate(LENGTHS):
        last = int(table[r, (n - 1) // block_size])
        pool[2 * last:2 * last + 2, n % block_size or block_size:] = float("nan")
    op = kernel(dtype, heads, kv_heads, head_dim, block_size)
    if op.tiles:
        op = PagedDecodeAttention(load(), dtype, heads, kv_heads, head_dim, block_size, tiles=False)
    one, two = (on_threads(n, op, query, pool, table, lengths) for n in (1, 2))
    want = reference(query, pool, table, lengths, kv_heads)
    assert torch.isfinite(two).all() and torch.equal(one, two)
    assert (two.float() - want).abs().max().item() < tol * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(8, 2, 64, 16), (12, 2, 64, 32), (16, 2, 128, 32),
                                                                    (32, 2, 64, 16), (6, 6, 128, 16)])
def test_the_amx_path_equals_attention_over_gathered_pages(heads, kv_heads, head_dim, block_size):
    """bf16 on the tile unit (where the CPU has one): the reference's tolerance, as the AVX-512 path; both paths
    agree to bf16 rounding; NaN in the rows past each row's length (its last page's tail, the padding page) never
    reaches an output (the tile path computes scores for whole 16-key groups and stages V in key pairs)."""
    applies, why = amx_applies(load(), torch.bfloat16, heads, kv_heads, head_dim, block_size)
    if not applies:
        pytest.skip(f"no AMX decode path here: {why}")
    query, pool, table, lengths = scattered(torch.bfloat16, heads, kv_heads, head_dim, block_size, seed=2)
    for r, n in enumerate(LENGTHS):                       # the unwritten rows of each row's last page, K and V
        last = int(table[r, (n - 1) // block_size])
        pool[2 * last:2 * last + 2, n % block_size or block_size:] = float("nan")
    tiles = PagedDecodeAttention(load(), torch.bfloat16, heads, kv_heads, head_dim, block_size, tiles=True)
    vector = PagedDecodeAttention(load(), torch.bfloat16, heads, kv_heads, head_dim, block_size, tiles=False)
    out, other = tiles(query, pool, table, lengths), vector(query, pool, table, lengths)
    want = reference(query, pool, table, lengths, kv_heads)
    assert torch.isfinite(out).all()
    assert (out.float() - want).abs().max().item() < 1e-2 * max(1.0, want.abs().max().item())
    assert (out.float() - other.float()).abs().max().item() < 1.6e-2
    one, two = (on_threads(n, tiles, query, pool, table, lengths) for n in (1, 2))
    assert torch.equal(one, two) and torch.equal(two, out)


def test_the_amx_path_is_picked_for_bf16_where_it_applies_and_refused_elsewhere():
    lib = load()
    op = paged_decode_attention(torch.device("cpu"), torch.bfloat16, 8, 2, 64, 16)
    assert op is not None and op.tiles == amx_applies(lib, torch.bfloat16, 8, 2, 64, 16)[0]
    assert not kernel(torch.float32, 8, 2, 64, 16).tiles                      # float32: the AVX-512 kernel
    for shape, why in (((8, 2, 80, 16), "head_dim 64 or 128"), ((36, 2, 64, 16), "up to 16 query heads"),
                       ((8, 2, 64, 8), "block_size a multiple of 16")):
        applies, reason = amx_applies(lib, torch.bfloat16, *shape)
        assert not applies and (why in reason or "AMX" in reason)
        assert not kernel(torch.bfloat16, *shape).tiles
        if "AMX" not in reason:
            with pytest.raises(ValueError, match=why):
                PagedDecodeAttention(lib, torch.bfloat16, *shape, tiles=True)



def test_rows_do_not_depend_on_the_thread_count_or_on_each_other():
    query, pool, table, lengths = scattered(torch.float32, 8, 2, 64, 16, seed=1)
    op = kernel(torch.float32, 8, 2, 64, 16)
    one, two = (on_threads(n, op, query, pool, table, lengths) for n in (1, 2))
    assert torch.equal(one, two)                          # a row is one task, whichever thread runs it
    alone = on_threads(2, op, query[3:4], pool, table[3:4], lengths[3:4])
    assert torch.equal(alone[0], one[3])


def test_one_long_row_splits_its_kv_heads_over_the_threads():
    """Batch 1 at a 1,000-token context (enough work to wake a second thread): each thread takes one kv head's
    query heads; the result equals the one-thread run bit for bit, and the reference."""
    g = torch.Generator().manual_seed(4)
    pool = torch.randn(2 * 64, 16, 2 * 64, generator=g)
    table = torch.randperm(64, generator=g)[:63].view(1, 63)
    lengths, query = torch.tensor([1000]), torch.randn(1, 8, 64, generator=g)
    op = kernel(torch.float32, 8, 2, 64, 16)
    one, two = (on_threads(n, op, query, pool, table, lengths) for n in (1, 2))
    assert torch.equal(one, two)
    assert (two - reference(query, pool, table, lengths, 2)).abs().max().item() < 2e-6


def test_arguments_that_do_not_fit_the_kernel_are_a_clear_error():
    query, pool, table, lengths = scattered(torch.float32, 8, 2, 64, 16)
    op = kernel(torch.float32, 8, 2, 64, 16)
    with pytest.raises(ValueError, match="do not fit a torch.float32 kernel of 8 heads x 64"):
        op(query.to(torch.bfloat16), pool, table, lengths)
    with pytest.raises(ValueError, match="lengths"):
        op(query, pool, table, lengths.int())
    with pytest.raises(ValueError, match="query"):
        op(query[:, :4], pool, table, lengths)
    outside = table.clone()
    outside[2, 0] = pool.shape[0] // 2                    # one past the last page
    with pytest.raises(ValueError, match=r"page ids in \[\d+, 64\] for a pool of 64 pages"):
        op(query, pool, outside, lengths)
    for bad in (0, table.shape[1] * 16 + 1):             # nothing to attend to; more tokens than the table holds
        wrong = lengths.clone()
        wrong[1] = bad
        with pytest.raises(ValueError, match="lengths in"):
            op(query, pool, table, wrong)


def mixed_step(rng: random.Random) -> tuple[dict, StepBatch]:
    """Histories of 3, 13 and 40 tokens, then a step with their decode rows, a chunk after cached tokens and
    a chunk from position 0."""
    histories = {"a": ([rng.randrange(3, 500) for _ in range(3)], [3]),
                 "b": ([rng.randrange(3, 500) for _ in range(13)], [0, 1]),
                 "c": ([rng.randrange(3, 500) for _ in range(40)], [4, 5, 6])}
    step = StepBatch([SeqStep("a", [7], 3, {"kv": [3]}), SeqStep("c", [9], 40, {"kv": [4, 5, 6]}),
                      SeqStep("b", [11], 13, {"kv": [0, 1]}),
                      SeqStep("b2", [rng.randrange(3, 500) for _ in range(5)], 13, {"kv": [0, 1]}),
                      SeqStep("f", [rng.randrange(3, 500) for _ in range(9)], 0, {"kv": [8]})],
                     new_pages={"kv": [8]})          # first used here (the pool starts uninitialized)
    return histories, step


def test_the_cpu_runner_sends_decode_rows_to_the_kernel_and_matches_its_sdpa_path():
    rc = load_runtime_config(["+model=qwen3_tiny"])
    runner = Qwen3Runner(rc.model, "cpu")
    assert runner.paged_decode is not None                # picked by default on CPU
    runner.load_weights()
    calls = []
    op = runner.paged_decode

    def counted(*args, **kwargs):
        calls.append((args[2].shape, kwargs.get("checked_longest")))
        return op(*args, **kwargs)

    results = []
    for paged in (counted, None):
        runner.paged_decode = paged
        runner.allocate_pools({"kv": 16}, 1)
        histories, step = mixed_step(random.Random(5))
        for name, (tokens, pages) in histories.items():
            runner.execute(StepBatch([SeqStep(name, tokens, 0, {"kv": pages}, sample=False)],
                                     new_pages={"kv": pages}))
        results.append(runner.execute(step))
        runner.free_pools()
    layers = rc.model.layout.num_layers
    assert calls == [((3, 3), 41)] * layers               # one call per layer for the three decode rows; the
                                                          # longest context (40 cached + 1) is passed as checked
    assert (results[0] - results[1]).abs().max().item() < 1e-5


def test_the_bf16_runner_on_amx_tiles_matches_its_avx512_decode():
    """The tile path inside a bf16 model step, between oneDNN's projections (which use the same tile unit with
    configurations of their own): decode logits within bf16 rounding of the AVX-512 path's, step after step."""
    rc = load_runtime_config(["+model=qwen3_tiny", "model.layout.head_dim=64", "model.cache_groups.0.row.width=256",
                              "model.layout.dtype=bfloat16", "model.cache_groups.0.row.dtype=bfloat16"])
    runner = Qwen3Runner(rc.model, "cpu")
    if runner.paged_decode is None or not runner.paged_decode.tiles:
        pytest.skip("no AMX decode path here")
    runner.load_weights()
    tiles = runner.paged_decode
    vector = PagedDecodeAttention(load(), torch.bfloat16, 4, 2, 64, runner.block_size, tiles=False)
    rng = random.Random(3)
    outputs = []
    for op in (tiles, vector):
        runner.paged_decode = op
        runner.allocate_pools({"kv": 16}, 1)
        prompts = {"a": [rng.randrange(3, 500) for _ in range(40)], "b": [rng.randrange(3, 500) for _ in range(9)]}
        tables = {"a": {"kv": [0, 1, 2, 3]}, "b": {"kv": [4]}}
        runner.execute(StepBatch([SeqStep(n, t, 0, tables[n], sample=False) for n, t in prompts.items()],
                                 new_pages={"kv": [0, 1, 2, 3, 4]}))
        logits = []
        for step in range(6):
            logits.append(runner.execute(StepBatch([SeqStep(n, [7 + step], len(t) + step, tables[n])
                                                    for n, t in prompts.items()])).float())
        outputs.append(torch.stack(logits))
        runner.free_pools()
        rng = random.Random(3)
    assert torch.isfinite(outputs[0]).all()
    assert (outputs[0] - outputs[1]).abs().max().item() < 0.1
