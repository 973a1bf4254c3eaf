"""DeepseekV4Runner against the plain reference (tests/dsv4_reference.py) on the tiny dsv4 layout.

The runner is driven directly with StepBatch objects and the small page allocator below: prompts
cross the window, compression and block boundaries and wrap every ring; prefill is chunked in several
ways; sequences in prefill and decode share steps; pools start full of NaN or random garbage.
"""

from __future__ import annotations

import math
import random
from functools import lru_cache
from typing import Callable

import pytest
import torch

from appliance.config.compose import load_runtime_config
from npu.deepseek_v4 import DeepseekV4Runner
from npu.step import SeqStep, StepBatch
from npu.weights import random_state_dict
from tests.npu.dsv4_reference import DeepseekV4Reference

PROMPT_LENS = (1, 3, 4, 5, 15, 16, 17, 33, 70, 130)
MAX_NEW = 5
STD = 0.1      # larger than the serving default, so attention and the indexer are far from uniform


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one intra-op thread is far faster than two contending ones on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@lru_cache(maxsize=None)
def model():
    return load_runtime_config([]).model


@lru_cache(maxsize=None)
def weights() -> dict[str, torch.Tensor]:
    expected = DeepseekV4Runner(model(), "cpu").expected_weights()
    return random_state_dict(expected, seed=7, device="cpu", std=STD)


def prompt(length: int) -> list[int]:
    rng = random.Random(1000 + length)
    return [rng.randrange(model().layout.vocab_size) for _ in range(length)]


@lru_cache(maxsize=None)
def reference(length: int) -> tuple[list[int], torch.Tensor]:
    tokens, logits = DeepseekV4Reference(model().layout, weights()).greedy(prompt(length), MAX_NEW)
    return tokens, torch.stack(logits)


def make_runner() -> DeepseekV4Runner:
    runner = DeepseekV4Runner(model(), "cpu")
    runner.set_weights(weights())
    return runner


def blocks_for(num_seqs: int, extra: int = 0) -> dict[str, int]:
    """Pages for num_seqs sequences at max_model_len (one capacity slot each), plus `extra` per group."""
    return {s.name: num_seqs * s.max_blocks_per_seq + extra for s in model().cache_groups}


class PageAllocator:
    """Physical pages per group from a shuffled free list. Full groups append one page per logical page;
    a ring slot moving to a new logical page gives its page back and takes a random free one, so
    pages are reused with another sequence's (or layer's) stale contents."""

    def __init__(self, num_blocks: dict[str, int], seed: int):
        self.specs = model().cache_groups
        self.rng = random.Random(seed)
        self.free = {s.name: list(range(num_blocks[s.name])) for s in self.specs}
        self.tables: dict[str, dict[str, list[int]]] = {}
        self.logical: dict[str, dict[str, list[int]]] = {}

    def _take(self, name: str) -> int:
        free = self.free[name]
        return free.pop(self.rng.randrange(len(free)))

    def step(self, rid: str, start: int, n: int) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """Block tables for tokens [start, start + n) and the pages newly assigned for them."""
        tables = self.tables.setdefault(
            rid, {s.name: [-1] * s.max_blocks_per_seq if s.is_ring else [] for s in self.specs})
        logical = self.logical.setdefault(rid, {s.name: [-1] * s.max_blocks_per_seq for s in self.specs})
        new: dict[str, list[int]] = {s.name: [] for s in self.specs}
        for s in self.specs:
            table = tables[s.name]
            end = math.ceil((start + n) / s.tokens_per_page)
            for lp in range(start // s.tokens_per_page if s.is_ring else len(table), end):
                if s.is_ring:
                    slot = lp % s.max_blocks_per_seq
                    if logical[s.name][slot] == lp:
                        continue
                    if table[slot] >= 0:
                        self.free[s.name].append(table[slot])
                    table[slot], logical[s.name][slot] = self._take(s.name), lp
                    new[s.name].append(table[slot])
                else:
                    table.append(self._take(s.name))
                    new[s.name].append(table[-1])
        return {k: list(v) for k, v in tables.items()}, new

    def release(self, rid: str) -> None:
        for name, table in self.tables.pop(rid).items():
            self.free[name].extend(p for p in table if p >= 0)


def fill_pools(runner: DeepseekV4Runner, how: str, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for pool in runner.pools.values():
        if how == "nan":
            pool.fill_(float("nan"))
        elif how == "random":
            pool.copy_(torch.randn(pool.shape, generator=gen) * 100)


def run_paged(runner: DeepseekV4Runner, lengths, chunk: Callable[[int, int], int], num_blocks: dict[str, int],
              seed: int = 0, check_zeroed: bool = False) -> dict[int, tuple[list[int], torch.Tensor]]:
    """Serve every prompt at once (prefill chunks and decodes mixed in one step) until MAX_NEW tokens each.

    chunk(seq_index, start) is the next prefill chunk size. Returns length -> (tokens, sampled logits).
    """
    alloc = PageAllocator(num_blocks, seed)
    states = {i: {"tokens": prompt(n), "prompt": n, "done": 0, "out": [], "logits": []} for i, n in enumerate(lengths)}
    while any(len(st["out"]) < MAX_NEW for st in states.values()):
        seqs, owners, new_pages = [], [], {}
        for i, st in states.items():
            if len(st["out"]) == MAX_NEW:
                continue
            start = st["done"]
            n = min(chunk(i, start), st["prompt"] - start) if start < st["prompt"] else 1
            tables, new = alloc.step(f"r{i}", start, n)
            for name, pages in new.items():
                new_pages.setdefault(name, []).extend(pages)
            seqs.append(SeqStep(f"r{i}", st["tokens"][start:start + n], start, tables,
                                sample=start + n >= st["prompt"]))
            owners.append(i)
            st["done"] += n
        logits = runner.execute(StepBatch(seqs, new_pages))
        if check_zeroed:   # every state page assigned in this step holds only written rows and zeros
            for name in runner.state_groups:
                for page in new_pages.get(name, []):
                    assert not runner.pools[name][:, page].isnan().any(), f"{name} page {page} not cleared"
        sampled = [i for i, s in zip(owners, seqs) if s.sample]
        assert logits.shape == (len(sampled), model().layout.vocab_size)
        for i, row in zip(sampled, logits):
            st = states[i]
            st["out"].append(int(row.argmax()))
            st["logits"].append(row)
            st["tokens"].append(st["out"][-1])
            if len(st["out"]) == MAX_NEW:
                alloc.release(f"r{i}")
    return {lengths[i]: (st["out"], torch.stack(st["logits"])) for i, st in states.items()}


def assert_matches_reference(results: dict[int, tuple[list[int], torch.Tensor]]) -> None:
    for length, (tokens, logits) in results.items():
        ref_tokens, ref_logits = reference(length)
        assert tokens == ref_tokens, f"prompt of {length} tokens"
        diff = (logits - ref_logits).abs().max().item()
        assert diff < 1e-4, f"prompt of {length} tokens: logits differ by {diff}"


def test_prompt_lengths_cover_every_boundary_and_ring_wrap():
    """The chosen lengths really cross the window, both ratios, the block and each ring's capacity."""
    m = model()
    longest = max(PROMPT_LENS) + MAX_NEW
    for spec in m.cache_groups:
        if spec.is_ring:
            assert longest > spec.max_blocks_per_seq * spec.tokens_per_page, spec.name
    topk = m.layout.index_topk
    csa = min(r for r in m.main_layer_ratios if r)
    assert longest // csa > topk        # the indexer has to choose


@pytest.mark.parametrize("garbage", ["zero", "nan", "random"])
def test_batched_greedy_matches_reference(garbage):
    runner = make_runner()
    runner.allocate_pools(blocks_for(len(PROMPT_LENS)), num_scratch=2)
    fill_pools(runner, garbage)
    results = run_paged(runner, PROMPT_LENS, lambda i, start: model().layout.tokens_in_flight,
                        blocks_for(len(PROMPT_LENS)), check_zeroed=garbage == "nan")
    assert_matches_reference(results)


@pytest.mark.parametrize("name", ["by7", "random", "one_then_full", "token_by_token"])
def test_chunkings_give_the_reference_tokens(name):
    tif = model().layout.tokens_in_flight
    rng = random.Random(3)
    chunk = {"by7": lambda i, s: 7,
             "random": lambda i, s: rng.randint(1, tif),
             "one_then_full": lambda i, s: 1 if s == 0 else tif,   # every later chunk starts mid-run
             "token_by_token": lambda i, s: 1}[name]
    lengths = (17, 33) if name == "token_by_token" else (33, 70, 130)
    runner = make_runner()
    runner.allocate_pools(blocks_for(len(lengths)), num_scratch=1)
    fill_pools(runner, "nan")
    assert_matches_reference(run_paged(runner, lengths, chunk, blocks_for(len(lengths)), seed=5))


def test_same_runner_two_pool_sizes_same_outputs():
    runner = make_runner()
    lengths = (5, 70, 130)
    out = []
    for blocks, seed in ((blocks_for(len(lengths)), 1), (blocks_for(3 * len(lengths), extra=5), 2)):
        runner.allocate_pools(blocks, num_scratch=1)
        fill_pools(runner, "random", seed)
        out.append(run_paged(runner, lengths, lambda i, s: 32, blocks, seed=seed))
    assert runner.pools["ori"].shape[1] != blocks_for(len(lengths))["ori"] + 1
    for length in lengths:
        assert out[0][length][0] == out[1][length][0]
        assert torch.allclose(out[0][length][1], out[1][length][1], atol=1e-6, rtol=0)


def test_new_state_pages_are_zeroed_and_hold_only_written_rows():
    runner = make_runner()
    runner.allocate_pools(blocks_for(1), num_scratch=1)
    fill_pools(runner, "nan")
    alloc = PageAllocator(blocks_for(1), seed=0)
    n = 5
    tables, new = alloc.step("r", 0, n)
    runner.execute(StepBatch([SeqStep("r", prompt(n), 0, tables)], new))
    d = model().layout.head_dim
    for name in runner.state_groups:
        spec = model().group(name)
        used = 2 * (d if name != "csa_inner_state" else model().layout.index_head_dim)
        for lp in range(math.ceil(n / spec.tokens_per_page)):
            page = runner.pools[name][:, tables[name][spec.ring_slot(lp)]]   # [layers, rows, width]
            assert page[..., used:].eq(0).all()                              # unused channels (if any)
            for row in range(spec.rows_per_block):
                token = lp * spec.tokens_per_page + row
                written = page[:, row, :used]
                assert (written.eq(0).all() if token >= n else written.ne(0).any()), (name, token)
    # pages never assigned to anyone are left alone (no full-pool clears)
    assigned = set(new["csa_state"])
    untouched = [p for p in range(blocks_for(1)["csa_state"]) if p not in assigned]
    assert runner.pools["csa_state"][:, untouched].isnan().all()


def test_profile_batch_uses_scratch_pages_only():
    rc = load_runtime_config([])
    runner = make_runner()
    blocks = blocks_for(1)
    runner.allocate_pools(blocks, num_scratch=rc.decode_batch)
    fill_pools(runner, "nan")
    batch = runner.profile_batch(rc.max_num_batched_tokens, rc.max_num_seqs)
    tif = rc.model.layout.tokens_in_flight
    assert sum(len(s.token_ids) for s in batch.seqs) == min(rc.max_num_batched_tokens, rc.max_num_seqs * tif)
    assert all(len(s.token_ids) <= tif for s in batch.seqs) and len(batch.seqs) <= rc.max_num_seqs
    for s in batch.seqs:
        for name, pages in s.block_tables.items():
            assert pages and all(blocks[name] <= p < blocks[name] + rc.decode_batch for p in pages)
    logits = runner.execute(batch)
    assert logits.shape == (len(batch.seqs), rc.model.layout.vocab_size)
    for name, pool in runner.pools.items():       # real pages untouched
        assert pool[:, : blocks[name]].isnan().all(), name


def test_missing_page_is_a_clear_error():
    runner = make_runner()
    runner.allocate_pools(blocks_for(1), num_scratch=1)
    tables, new = PageAllocator(blocks_for(1), seed=0).step("r", 0, 20)
    tables["cmp_c4"] = tables["cmp_c4"][:1]          # tokens 16..19 have no cmp_c4 page
    with pytest.raises(ValueError, match="'r'.*cmp_c4.*row 4"):
        runner.execute(StepBatch([SeqStep("r", prompt(20), 0, tables)], new))


def test_step_longer_than_tokens_in_flight_is_rejected():
    runner = make_runner()
    runner.allocate_pools(blocks_for(1), num_scratch=1)
    n = model().layout.tokens_in_flight + 1
    tables, new = PageAllocator(blocks_for(1), seed=0).step("r", 0, n)
    with pytest.raises(ValueError, match="tokens_in_flight"):
        runner.execute(StepBatch([SeqStep("r", prompt(n), 0, tables)], new))


def test_random_weights_are_seeded_and_serve():
    a, b = DeepseekV4Runner(model(), "cpu"), DeepseekV4Runner(model(), "cpu")
    a.load_weights()
    b.load_weights()
    assert set(a.params) == set(a.expected_weights())
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)
    a.allocate_pools(blocks_for(1), num_scratch=1)
    tables, new = PageAllocator(blocks_for(1), seed=0).step("r", 0, 9)
    logits = a.execute(StepBatch([SeqStep("r", prompt(9), 0, tables)], new))
    ref = DeepseekV4Reference(model().layout, a.params).logits(prompt(9))[-1]
    assert (logits[0] - ref).abs().max() < 1e-4


@pytest.mark.parametrize("overrides", [[], ["+model=dsv4"]])
def test_roles_and_weights_follow_the_layout(overrides):
    m = load_runtime_config(overrides).model
    runner = DeepseekV4Runner(m, "cpu")           # no weights, no pools: cheap even for the full model
    ratios = m.main_layer_ratios
    nonzero = sorted({r for r in ratios if r})
    assert (runner.csa_ratio, runner.hca_ratio) == (nonzero[0], nonzero[-1])
    expected = runner.expected_weights()
    for layer, ratio in enumerate(ratios):
        names = [k for k in expected if k.startswith(f"layers.{layer}.")]
        assert any(".attn.compressor." in k for k in names) == bool(ratio)
        assert any(".attn.indexer." in k for k in names) == (ratio == nonzero[0])
        if ratio:
            assert expected[f"layers.{layer}.attn.compressor.ape"][0] == (ratio, m.layout.head_dim)
    assert not any(k.startswith(f"layers.{len(ratios)}.") for k in expected)     # MTP layer not served
    assert ("lm_head.weight" in expected) != m.layout.tie_word_embeddings


def test_missing_cache_group_is_a_clear_error():
    import dataclasses
    m = model()
    broken = dataclasses.replace(m, cache_groups=tuple(g for g in m.cache_groups if g.name != "idx"))
    with pytest.raises(ValueError, match="needs cache group 'idx'"):
        DeepseekV4Runner(broken, "cpu")


def int8_idx_runner() -> DeepseekV4Runner:
    """The tiny runner with idx rows stored as full dsv4 stores them: int8 values plus an fp32 scale."""
    import dataclasses
    m = model()
    groups = tuple(dataclasses.replace(g, row_dtype="int8", row_extra_bytes=4) if g.name == "idx" else g
                   for g in m.cache_groups)
    runner = DeepseekV4Runner(dataclasses.replace(m, cache_groups=groups), "cpu")
    runner.set_weights(weights())
    return runner


def test_int8_indexer_rows_hold_values_and_scale():
    n, di = model().layout.tokens_in_flight, model().layout.index_head_dim
    pools = []
    for runner in (make_runner(), int8_idx_runner()):
        runner.allocate_pools(blocks_for(1), num_scratch=1)
        tables, new = PageAllocator(blocks_for(1), seed=0).step("r", 0, n)
        runner.execute(StepBatch([SeqStep("r", prompt(n), 0, tables)], new))
        pools.append(runner.pools["idx"][:, tables["idx"]])            # [layers, pages, rows, width]
    exact, packed = pools
    assert packed.dtype == torch.int8 and packed.shape[-1] == di + 4
    scale = packed[..., di:].contiguous().view(torch.float32)            # [..., 1]
    restored = packed[..., :di].float() * scale
    assert exact.abs().amax() > 0.1
    assert ((restored - exact).abs() <= 0.5 * scale + 1e-6).all()       # round to nearest step
    assert torch.allclose(scale[..., 0], exact.abs().amax(-1) / 127)


def test_int8_indexer_rows_serve():
    """Where the indexer has no choice (every visible row fits in index_topk), quantized keys cannot
    change the output; longer prompts still serve (their selection may differ by quantization)."""
    runner = int8_idx_runner()
    runner.allocate_pools(blocks_for(len(PROMPT_LENS)), num_scratch=1)
    fill_pools(runner, "random")
    results = run_paged(runner, PROMPT_LENS, lambda i, s: 32, blocks_for(len(PROMPT_LENS)))
    no_choice = {n: r for n, r in results.items()
                 if (n + MAX_NEW - 1) // runner.csa_ratio <= model().layout.index_topk}
    assert len(no_choice) >= 5
    assert_matches_reference(no_choice)
    for tokens, logits in results.values():
        assert len(tokens) == MAX_NEW and torch.isfinite(logits).all()
