"""DeepseekV4Runner against transformers' DeepseekV4ForCausalLM on one tiny checkpoint with the released names.

transformers is the oracle for the math and for the paging rules alike (it replaces the former unpaged
reference in tests/): its greedy tokens and float32 logits, computed with its own cache one sequence at a
time, must come out of the runner whatever the batching, chunking and paging. The runner is driven directly
with StepBatch objects and the small page allocator below: prompts cross the window, both compression
ratios and block boundaries and wrap every ring; prefill is chunked in several ways; sequences in prefill
and decode share steps; pools start full of NaN or random garbage. (Prefix hits and preemption are checked
through the engine in tests/engine/test_engine_dsv4_oracle.py.)
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from functools import lru_cache
from typing import Callable

import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.archs.deepseek_v4.layout import csa_ratio
from npu.deepseek_v4.runner import DeepseekV4Runner
from npu.step import SeqStep, StepBatch
from npu.weights import load_state_dict
from tests.support.checkpoints import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

PROMPT_LENS = (1, 3, 4, 5, 15, 16, 17, 33, 70, 130)
MAX_NEW = 5
STD = 0.1      # larger than the serving default, so attention, routing and the indexer are far from uniform
LOGIT_TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@lru_cache(maxsize=None)
def model():
    return load_runtime_config([]).model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("dsv4_tiny"), model(), seed=7, std=STD)


@pytest.fixture(scope="module")
def weights(checkpoint) -> dict[str, torch.Tensor]:
    return load_state_dict(checkpoint, DeepseekV4Runner(model(), "cpu").expected_weights(), "cpu", progress=False)


@pytest.fixture(scope="module")
def hf(checkpoint):
    loaded, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, output_loading_info=True)
    return loaded.eval(), info


def prompt(length: int) -> list[int]:
    rng = random.Random(1000 + length)
    return [rng.randrange(model().layout.vocab_size) for _ in range(length)]


@pytest.fixture(scope="module")
def reference(hf) -> Callable[[int], tuple[list[int], torch.Tensor]]:
    """Greedy tokens and the logits each was chosen from, by transformers with its own cache."""
    from transformers.cache_utils import DynamicCache

    net = hf[0]

    @lru_cache(maxsize=None)
    def run(length: int) -> tuple[list[int], torch.Tensor]:
        cache = DynamicCache(config=net.config)
        with torch.no_grad():
            out = net(torch.tensor([prompt(length)]), cache=cache, use_cache=True)
            tokens, logits = [], []
            for step in range(MAX_NEW):
                logits.append(out.logits[0, -1].float())
                tokens.append(int(logits[-1].argmax()))
                if step + 1 < MAX_NEW:
                    out = net(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
        return tokens, torch.stack(logits)

    return run


def make_runner(weights, m=None) -> DeepseekV4Runner:
    runner = DeepseekV4Runner(m or model(), "cpu")
    runner.set_weights(weights)
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


def assert_matches(reference, results: dict[int, tuple[list[int], torch.Tensor]]) -> None:
    for length, (tokens, logits) in results.items():
        ref_tokens, ref_logits = reference(length)
        assert tokens == ref_tokens, f"prompt of {length} tokens"
        diff = (logits - ref_logits).abs().max().item()
        assert diff < LOGIT_TOL, f"prompt of {length} tokens: logits differ by {diff}"


def test_transformers_loads_the_released_names_exactly(hf, checkpoint, weights):
    _, info = hf
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert any(k.startswith("mtp.0.") for k in weights)                  # held by the runner, ignored by transformers
    assert "layers.0.ffn.gate.tid2eid" in weights and "layers.0.ffn.gate.bias" not in weights
    assert weights["layers.0.ffn.gate.tid2eid"].dtype == torch.int32


def test_prompt_lengths_cover_every_boundary_and_ring_wrap():
    """The chosen lengths really cross the window, both ratios, the block and each ring's capacity."""
    m = model()
    longest = max(PROMPT_LENS) + MAX_NEW
    for spec in m.cache_groups:
        if spec.is_ring:
            assert longest > spec.max_blocks_per_seq * spec.tokens_per_page, spec.name
    assert longest // csa_ratio(m.layout) > m.layout.index_topk          # the indexer has to choose
    hca = max(m.main_layer_ratios)
    assert any(n < hca <= n + MAX_NEW for n in PROMPT_LENS)                 # a first HCA row appears in decode


@pytest.mark.parametrize("garbage", ["zero", "nan", "random"])
def test_batched_greedy_matches_transformers(weights, reference, garbage):
    runner = make_runner(weights)
    runner.allocate_pools(blocks_for(len(PROMPT_LENS)), num_scratch=2)
    fill_pools(runner, garbage)
    results = run_paged(runner, PROMPT_LENS, lambda i, start: model().layout.tokens_in_flight,
                        blocks_for(len(PROMPT_LENS)), check_zeroed=garbage == "nan")
    assert_matches(reference, results)


def fits_rings(start: int, n: int) -> int:
    """The longest chunk <= n from `start` that every state ring holds (mid-window starts need a page more)."""
    from appliance.core.archs.deepseek_v4.cache_groups import state_span_pages
    m = model()
    csa = csa_ratio(m.layout)
    while n > 1 and state_span_pages(start, n, csa, m.group("csa_state").tokens_per_page, True) > \
            m.group("csa_state").max_blocks_per_seq:
        n -= 1
    return n


@pytest.mark.parametrize("name", ["by7", "random", "one_then_aligned", "token_by_token"])
def test_chunkings_give_the_transformers_tokens(weights, reference, name):
    tif = model().layout.tokens_in_flight
    block = model().layout.block_size
    rng = random.Random(3)
    chunk = {"by7": lambda i, s: 7,
             "random": lambda i, s: fits_rings(s, rng.randint(1, tif)),
             "one_then_aligned": lambda i, s: 1 if s == 0 else (block - s % block if s % block else tif),
             "token_by_token": lambda i, s: 1}[name]
    lengths = (17, 33) if name == "token_by_token" else (33, 70, 130)
    runner = make_runner(weights)
    runner.allocate_pools(blocks_for(len(lengths)), num_scratch=1)
    fill_pools(runner, "nan")
    assert_matches(reference, run_paged(runner, lengths, chunk, blocks_for(len(lengths)), seed=5))


def test_same_runner_two_pool_sizes_same_outputs(weights):
    runner = make_runner(weights)
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


def test_new_state_pages_are_zeroed_and_hold_only_written_rows(weights):
    runner = make_runner(weights)
    runner.allocate_pools(blocks_for(1), num_scratch=1)
    fill_pools(runner, "nan")
    alloc = PageAllocator(blocks_for(1), seed=0)
    n = 5
    tables, new = alloc.step("r", 0, n)
    runner.execute(StepBatch([SeqStep("r", prompt(n), 0, tables)], new))
    for name in runner.state_groups:
        spec = model().group(name)
        for lp in range(math.ceil(n / spec.tokens_per_page)):
            page = runner.pools[name][:, tables[name][spec.ring_slot(lp)]]   # [layers, rows, width]
            for row in range(spec.rows_per_block):
                token = lp * spec.tokens_per_page + row
                written = page[:, row]                                       # the full row: kv and score
                assert (written.eq(0).all() if token >= n else written.ne(0).all()), (name, token)
    # pages never assigned to anyone are left alone (no full-pool clears)
    assigned = set(new["csa_state"])
    untouched = [p for p in range(blocks_for(1)["csa_state"]) if p not in assigned]
    assert runner.pools["csa_state"][:, untouched].isnan().all()


def test_missing_page_is_a_clear_error(weights):
    runner = make_runner(weights)
    runner.allocate_pools(blocks_for(1), num_scratch=1)
    tables, new = PageAllocator(blocks_for(1), seed=0).step("r", 0, 20)
    tables["cmp_c4"] = tables["cmp_c4"][:1]          # tokens 16..19 have no cmp_c4 page
    with pytest.raises(ValueError, match="'r'.*cmp_c4.*row 4"):
        runner.execute(StepBatch([SeqStep("r", prompt(20), 0, tables)], new))


def test_step_longer_than_tokens_in_flight_is_rejected(weights):
    runner = make_runner(weights)
    runner.allocate_pools(blocks_for(1), num_scratch=1)
    n = model().layout.tokens_in_flight + 1
    tables, new = PageAllocator(blocks_for(1), seed=0).step("r", 0, n)
    with pytest.raises(ValueError, match="tokens_in_flight"):
        runner.execute(StepBatch([SeqStep("r", prompt(n), 0, tables)], new))


def test_mid_window_step_the_state_ring_cannot_hold_is_rejected(weights):
    """From mid-window, a full tokens_in_flight chunk needs one page more than the CSA state ring keeps (the
    overlapping compressor reads the previous window): a clear error, never a read of a reused slot."""
    runner = make_runner(weights)
    runner.allocate_pools(blocks_for(1), num_scratch=1)
    alloc = PageAllocator(blocks_for(1), seed=0)
    tables, new = alloc.step("r", 0, 7)
    runner.execute(StepBatch([SeqStep("r", prompt(7), 0, tables)], new))
    n = model().layout.tokens_in_flight
    tables, new = alloc.step("r", 7, n)
    with pytest.raises(ValueError, match="'r'.*touches 10 pages of ring 'csa_state', which keeps 9"):
        runner.execute(StepBatch([SeqStep("r", prompt(7 + n)[7:], 7, tables)], new))


def test_roles_follow_the_layout():
    for overrides in ([], ["+model=dsv4"]):
        m = load_runtime_config(overrides).model
        runner = DeepseekV4Runner(m, "cpu")           # no weights, no pools: cheap even for the full model
        nonzero = sorted({r for r in m.main_layer_ratios if r})
        assert (runner.csa_ratio, runner.hca_ratio) == (nonzero[0], nonzero[-1])
        assert runner.kinds[runner.csa_ratio].overlap and not runner.kinds[runner.hca_ratio].overlap


def test_missing_cache_group_is_a_clear_error():
    m = model()
    broken = dataclasses.replace(m, cache_groups=tuple(g for g in m.cache_groups if g.name != "idx"))
    with pytest.raises(ValueError, match="needs cache group 'idx'"):
        DeepseekV4Runner(broken, "cpu")


def int8_idx_model():
    """The tiny model with idx rows stored as full dsv4 stores them: int8 values plus an fp32 scale."""
    m = model()
    groups = tuple(dataclasses.replace(g, row_dtype="int8", row_extra_bytes=4) if g.name == "idx" else g
                   for g in m.cache_groups)
    return dataclasses.replace(m, cache_groups=groups)


def test_int8_indexer_rows_hold_values_and_scale(weights):
    n, di = model().layout.tokens_in_flight, model().layout.index_head_dim
    pools = []
    for runner in (make_runner(weights), make_runner(weights, int8_idx_model())):
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


def test_int8_indexer_rows_serve(weights, reference):
    """Where the indexer has no choice (every visible row fits in index_topk), quantized keys cannot
    change the output; longer prompts still serve (their selection may differ by quantization)."""
    runner = make_runner(weights, int8_idx_model())
    runner.allocate_pools(blocks_for(len(PROMPT_LENS)), num_scratch=1)
    fill_pools(runner, "random")
    results = run_paged(runner, PROMPT_LENS, lambda i, s: 32, blocks_for(len(PROMPT_LENS)))
    no_choice = {n: r for n, r in results.items()
                 if (n + MAX_NEW - 1) // runner.csa_ratio <= model().layout.index_topk}
    assert len(no_choice) >= 5
    assert_matches(reference, no_choice)
    for tokens, logits in results.values():
        assert len(tokens) == MAX_NEW and torch.isfinite(logits).all()


@pytest.mark.parametrize("gemm", ["torch_grouped_mm", "masked", "triton"])
def test_the_accelerator_moe_path_matches_transformers(weights, reference, gemm):
    """On an accelerator the routed experts run stacked (npu.deepseek_v4.moe.grouped_experts: no host sync) through
    the device's grouped GEMM; here on the CPU, forced, each of the three, so their sums are checked against the
    oracle where a GPU is not at hand (the Triton kernel in Triton's interpreter)."""
    from npu.deepseek_v4.expert_stacks import stack_experts
    from npu.deepseek_v4.moe import masked_grouped_gemm, torch_grouped_gemm
    if gemm == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("runs in Triton's interpreter")
        from npu.grouped_gemm_triton import triton_grouped_gemm
    runner = make_runner(weights)
    runner.expert_stacks = stack_experts(runner.params)
    runner.expert_gemm = {"torch_grouped_mm": torch_grouped_gemm, "masked": masked_grouped_gemm}.get(gemm) \
        or triton_grouped_gemm
    assert runner.expert_stacks and not any(".experts." in name for name in runner.params)
    runner.allocate_pools(blocks_for(len(PROMPT_LENS)), num_scratch=2)
    results = run_paged(runner, PROMPT_LENS, lambda i, start: model().layout.tokens_in_flight,
                        blocks_for(len(PROMPT_LENS)))
    assert_matches(reference, results)
