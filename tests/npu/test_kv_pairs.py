"""The kv-pairs layout of a bfloat16 CPU pool (npu.kv_pairs): its word maps, the writer, and the two attention kernels
reading it give, bit for bit, what they give over the same values in the rows layout; a bf16 Qwen3 runner's logits are
the same in either layout; the layout is chosen by what the CPU has. The rows-layout kernels themselves are checked
against attention references in test_paged_attention_cpu.py and test_prefill_attention_cpu.py."""

import random

import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.errors import EnvironmentSettingError
from npu.cpu_kernels import amx_granted, kernels_for, load
from npu.kv_pairs import LAYOUT_SWITCH, KVPairsWriter, kv_pairs_writer, to_pairs, to_rows
from npu.paged_attention_cpu import PagedDecodeAttention
from npu.prefill_attention_cpu import AVX512_BF16, CausalPrefillAttention, available_paths
from npu.qwen3.runner import Qwen3Runner
from npu.step import SeqStep, StepBatch
from tests.npu.test_paged_attention_cpu import LENGTHS, scattered
from tests.support.threads import on_threads

LIB = kernels_for(torch.device("cpu"), torch.bfloat16, "tests")
HAS_PAIRS = LIB is not None and bool(LIB.kv_pairs_layout())
needs_pairs = pytest.mark.skipif(not HAS_PAIRS, reason="the kv-pairs kernels need AVX512-BF16 and the kernel build")


def bits(t: torch.Tensor) -> torch.Tensor:
    """A bfloat16 tensor's bits (NaN compares equal to the same NaN)."""
    return t.view(torch.int16)


@pytest.mark.parametrize("kv_heads, head_dim, block_size", [(2, 64, 16), (4, 128, 32), (1, 64, 48)])
def test_to_pairs_puts_dimension_pairs_and_key_pairs_in_words_and_to_rows_undoes_it(kv_heads, head_dim, block_size):
    pages = 3
    rows = torch.randn(2 * pages, block_size, kv_heads * head_dim).to(torch.bfloat16)
    pairs = to_pairs(rows, kv_heads, head_dim)
    assert pairs.shape == rows.shape and torch.equal(bits(to_rows(pairs, kv_heads, head_dim)), bits(rows))
    words = pairs.view(2 * pages, -1).view(torch.int32)
    rwords = rows.view(torch.int32)                # [planes, block, kv_heads x head_dim / 2]: a token's dim pairs
    for p, g, w, t in [(0, 0, 0, 0), (1, kv_heads - 1, head_dim // 2 - 1, block_size - 1), (2, 0, 5, 7)]:
        # K plane of page p: word (g, w, t) is dims 2w, 2w + 1 of key t
        assert words[2 * p, (g * head_dim // 2 + w) * block_size + t] == rwords[2 * p, t, g * head_dim // 2 + w]
        # V plane: word (g, j, d) is dim d of keys 2j, 2j + 1 (the even key in the low half)
        j, d = t // 2, w
        word = int(words[2 * p + 1, (g * block_size // 2 + j) * head_dim + d])
        even, odd = (int(rows[2 * p + 1, 2 * j + i, g * head_dim + d].view(torch.int16)) & 0xFFFF for i in (0, 1))
        assert word & 0xFFFFFFFF == even | odd << 16


@needs_pairs
@pytest.mark.parametrize("kv_heads, head_dim, block_size, tokens", [(2, 64, 16, 5), (4, 64, 32, 300), (2, 128, 16, 40)])
def test_the_writer_puts_each_token_where_to_pairs_does(kv_heads, head_dim, block_size, tokens):
    """Any slots (odd and even, any page, K and V planes of two layers), tokens from a strided view of a projection's
    output, at 1 and 2 threads (300 tokens take the threaded loop): the pool equals the rows layout's index_put, seen
    through to_pairs, and nothing else in the pool moves (its NaN stay)."""
    half, layers, pages = kv_heads * head_dim, 2, 24
    pool_rows = torch.full((layers, pages, block_size, 2 * half), float("nan"), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(tokens)
    slots = torch.randperm(pages * block_size, generator=g)[:tokens]         # distinct (page, slot) per token
    layer = torch.randint(layers, (tokens,), generator=g)
    k_rows = (layer * pages * 2 + slots // block_size * 2) * block_size + slots % block_size
    rows = torch.stack([k_rows, k_rows + block_size], 1)                     # V: the same slot of the V plane
    qkv = torch.randn(tokens, 3 * half, generator=g).to(torch.bfloat16)      # q | k | v, as the runner's
    flat = pool_rows.view(-1, half)
    flat.index_put_((rows,), qkv[:, half:].unflatten(1, (2, half)))
    want = torch.stack([to_pairs(pool_rows[i].view(-1, block_size, half), kv_heads, head_dim) for i in range(layers)])
    for threads in (1, 2):
        pool = torch.full_like(pool_rows, float("nan"))
        writer = KVPairsWriter(load(), kv_heads, head_dim, block_size)
        on_threads(threads, writer, pool, rows, qkv[:, half:])
        assert torch.equal(bits(pool.view(want.shape)), bits(want))


@needs_pairs
def test_the_writer_refuses_rows_outside_the_pool_or_in_the_wrong_plane():
    writer = KVPairsWriter(load(), 2, 64, 16)
    pool = torch.zeros(1, 4, 16, 256, dtype=torch.bfloat16)          # 8 planes of 16 rows
    kv = torch.zeros(1, 256, dtype=torch.bfloat16)
    for bad in ([[0, 128]], [[-1, 16]], [[16, 32]], [[0, 1]]):      # past the end, negative, K in a V plane, V in K
        with pytest.raises(ValueError, match="K rows in even planes"):
            writer(pool, torch.tensor(bad), kv)
    with pytest.raises(ValueError, match="do not fit"):
        writer(pool.float(), torch.tensor([[0, 16]]), kv)
    with pytest.raises(ValueError, match="head_dim 80"):
        KVPairsWriter(load(), 2, 80, 16)
    writer(pool, torch.tensor([[33, 49]]), torch.ones(1, 256, dtype=torch.bfloat16))
    assert pool.ne(0).sum() == 2 * 128                               # one token's K and V, nothing else


def pool_of_rows(heads, kv_heads, head_dim, block_size, seed):
    """test_paged_attention_cpu's scattered rows (a NaN page padding every table), with NaN in each last page's
    unwritten rows too."""
    query, pool, table, lengths = scattered(torch.bfloat16, heads, kv_heads, head_dim, block_size, seed)
    for r, n in enumerate(LENGTHS):
        last = int(table[r, (n - 1) // block_size])
        pool[2 * last:2 * last + 2, (n - 1) % block_size + 1:] = float("nan")
    return query, pool, table, lengths


@needs_pairs
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(12, 2, 64, 16), (16, 4, 64, 32), (16, 2, 128, 16),
                                                                    (8, 8, 64, 16), (40, 8, 128, 32)])
def test_decode_over_pairs_is_the_rows_kernel_bit_for_bit(heads, kv_heads, head_dim, block_size):
    """The same products in the same order, read from where they lie: equal bits to the one-pass AVX512-BF16 path
    over the rows layout, NaN past every row's length never read, at 1 and 2 threads."""
    query, pool, table, lengths = pool_of_rows(heads, kv_heads, head_dim, block_size, seed=heads)
    rows_op = PagedDecodeAttention(load(), torch.bfloat16, heads, kv_heads, head_dim, block_size, tiles=False)
    pairs_op = PagedDecodeAttention(load(), torch.bfloat16, heads, kv_heads, head_dim, block_size, pairs=True)
    want = rows_op(query, pool, table, lengths)
    assert torch.isfinite(want).all()
    for threads in (1, 2):
        got = on_threads(threads, pairs_op, query, to_pairs(pool, kv_heads, head_dim), table, lengths)
        assert torch.equal(got, want)


@needs_pairs
def test_the_kernels_refuse_a_pairs_pool_they_cannot_read():
    with pytest.raises(ValueError, match="kv-pairs layout"):
        PagedDecodeAttention(load(), torch.float32, 8, 2, 64, 16, pairs=True)
    with pytest.raises(ValueError, match="kv-pairs layout"):
        PagedDecodeAttention(load(), torch.bfloat16, 8, 2, 64, 8, pairs=True)          # block_size 8
    op = CausalPrefillAttention(load(), torch.bfloat16, 8, 2, 64, AVX512_BF16)
    planes = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv-pairs layout"):
        op.paged(torch.zeros(2, 512, dtype=torch.bfloat16), planes, torch.zeros(1, 2, dtype=torch.long), 10, 2,
                 pairs=True)


@needs_pairs
@pytest.mark.parametrize("count, context, length, block_size", [(3, 50, 17, 16), (2, 300, 64, 32), (1, 33, 2, 16),
                                                                (2, 31, 31, 16)])
def test_paged_prefill_over_pairs_is_the_rows_kernel_bit_for_bit(count, context, length, block_size):
    """Chunks after cached tokens (odd contexts: a half-filled last key pair; NaN everywhere else in the pool):
    equal bits to the AVX512-BF16 path packing the same pages from the rows layout."""
    heads, kv_heads, head_dim = 8, 2, 64
    g = torch.Generator().manual_seed(context)
    width = -(-context // block_size)
    npages = count * width + 3
    pool = torch.full((2 * npages, block_size, kv_heads * head_dim), float("nan"), dtype=torch.bfloat16)
    pages = torch.randperm(npages, generator=g)[:count * width].view(count, width)
    for c in range(count):
        for t in range(context):
            p = int(pages[c, t // block_size])
            pool[2 * p:2 * p + 2, t % block_size] = torch.randn(2, kv_heads * head_dim, generator=g).to(torch.bfloat16)
    q = torch.randn(count * length, heads * head_dim, generator=g).to(torch.bfloat16)
    assert AVX512_BF16 in available_paths(load())
    op = CausalPrefillAttention(load(), torch.bfloat16, heads, kv_heads, head_dim, AVX512_BF16)
    want = op.paged(q, pool, pages, context, length)
    got = op.paged(q, to_pairs(pool, kv_heads, head_dim), pages, context, length, pairs=True)
    assert torch.isfinite(want).all() and torch.equal(got, want)


def bf16_runner(monkeypatch, layout: str | None, row_dtype: str = "bfloat16") -> Qwen3Runner:
    if layout is None:
        monkeypatch.delenv(LAYOUT_SWITCH, raising=False)
    else:
        monkeypatch.setenv(LAYOUT_SWITCH, layout)
    rc = load_runtime_config(["+model=qwen3_tiny", "model.layout.head_dim=64", "model.cache_groups.0.row.width=256",
                              "model.layout.dtype=bfloat16", f"model.cache_groups.0.row.dtype={row_dtype}"])
    return Qwen3Runner(rc.model, "cpu")


@needs_pairs
def test_a_bf16_runner_gives_the_same_logits_in_either_layout(monkeypatch):
    """Prompts in chunks (from position 0, then after cached tokens), a prefix-cache hit on shared pages, decode
    rows of odd and even lengths together with a prefill chunk: the same logits, bit for bit, and the pool holds the
    same K and V, in its own order."""
    results, pools = [], []
    for layout in ("rows", "pairs"):
        runner = bf16_runner(monkeypatch, layout)
        assert (runner.kv_pairs is not None) == (layout == "pairs")
        runner.load_weights()
        runner.allocate_pools({"kv": 24}, 2)
        rng = random.Random(7)

        def ids(n):
            return [rng.randrange(3, 500) for _ in range(n)]
        a, b = ids(37), ids(20)
        steps = [StepBatch([SeqStep("a", a[:30], 0, {"kv": [0, 1]}, sample=False), SeqStep("b", b, 0, {"kv": [2, 3]})],
                           new_pages={"kv": [0, 1, 2, 3]}),
                 StepBatch([SeqStep("a", a[30:], 30, {"kv": [0, 1, 4]}),           # after 30 cached tokens
                            SeqStep("b", [9], 20, {"kv": [2, 3]})], new_pages={"kv": [4]}),
                 # "c" shares a's first two pages (a prefix hit of 32 tokens) and prefills the rest
                 StepBatch([SeqStep("c", ids(9), 32, {"kv": [0, 1, 5]}), SeqStep("a", [11], 37, {"kv": [0, 1, 4]}),
                            SeqStep("b", [12], 21, {"kv": [2, 3]})], new_pages={"kv": [5]})]
        logits = [runner.execute(step) for step in steps]
        for i in range(5):                                                        # decode a and b, odd and even
            logits.append(runner.execute(StepBatch([SeqStep("a", [13 + i], 38 + i, {"kv": [0, 1, 4]}),
                                                    SeqStep("b", [14 + i], 22 + i, {"kv": [2, 3]})])))
        results.append(logits)
        planes = runner.pools["kv"][:, :6].reshape(-1, 2 * 6, runner.block_size, 128)
        pools.append(planes if layout == "rows" else torch.stack([to_rows(p, 2, 64) for p in planes]))
        runner.free_pools()
    for rows_logits, pairs_logits in zip(*results):
        assert torch.isfinite(rows_logits).all() and torch.equal(rows_logits, pairs_logits)
    assert torch.equal(bits(pools[0]), bits(pools[1]))


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


@pytest.mark.skipif(LIB is None, reason="the kernel build")
def test_the_layout_is_chosen_by_the_cpu_and_the_switch(monkeypatch):
    """pairs by default exactly where the CPU has AVX512-BF16 and the tile unit is not granted; rows=rows always;
    pairs where asked and the CPU can, for a bfloat16 pool; a typo names the switch; float32 pools stay in rows."""
    flags = cpu_flags()
    default = bf16_runner(monkeypatch, None)
    assert (default.kv_pairs is not None) == ("avx512_bf16" in flags and not amx_granted(LIB))
    assert default.paged_decode is not None and default.paged_decode.pairs == (default.kv_pairs is not None)
    assert bf16_runner(monkeypatch, "rows").kv_pairs is None
    assert (bf16_runner(monkeypatch, "pairs").kv_pairs is not None) == ("avx512_bf16" in flags)
    assert bf16_runner(monkeypatch, "pairs", row_dtype="float32").kv_pairs is None       # a float32 pool: rows
    with pytest.raises(EnvironmentSettingError, match=LAYOUT_SWITCH):
        bf16_runner(monkeypatch, "pair")
    monkeypatch.delenv(LAYOUT_SWITCH)
    assert kv_pairs_writer(torch.device("cpu"), torch.float32, 2, 64, 16) is None
    assert kv_pairs_writer(torch.device("cpu"), torch.bfloat16, 2, 80, 16) is None        # head_dim 80
