"""The startup profile bounds every step the scheduler can issue.

With attention's explicit math path (what an accelerator without a fused kernel for the step runs: the full
score matrix is materialized) and the CPU allocation tracker, a runner started by the launcher is driven
through the scheduler's extreme steps, built here from the config's numbers, and through a real
Scheduler + KvCacheManager workload; every step, and the sampler after it, must peak at or below
peak_non_kv + scratch (plus the KV pages the step's pools hold). DeepSeek V4's MoE is profiled at its worst
routing (every token to the same experts), which a real step can reach too.
"""

import dataclasses
import math
import random

import pytest
import torch
import torch.nn.functional as F

import npu.qwen3.step_meta
from appliance.config.compose import load_runtime_config
from appliance.core.request import SamplingParams
from appliance.core.step_limits import SeqShape, StepShape, step_limits, worst_steps
from appliance.engine.kv_cache_manager import KvCacheManager
from appliance.engine.scheduler import Scheduler
from appliance.engine.sequence import Sequence
from npu.backends import CpuBackend
from npu.cpu_memory import AllocationTracker
from npu.launcher import launch
from npu.registry import build_runner
from npu.runner import ModelRunner
from npu.sampler import Sampler
from npu.step import SeqStep, StepBatch

MiB = 1 << 20
MODELS = [pytest.param("qwen3_tiny", id="qwen3"), pytest.param("dsv4_tiny", id="dsv4")]
LIMITS = ["max_model_len=256", "max_num_batched_tokens=64", "max_num_seqs=8", "decode_batch=4"]
TOP_K_TOP_P = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
EXTREMES = ("one sequence, whole chunk, full context", "the last chunk of the longest prompt", "largest decode gather",
            "decodes + one chunk at full context", "decodes + a long chunk and short ones (padded to the longest)",
            "budget spread evenly (the old profile)")


def math_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """scaled_dot_product_attention written out: scores, mask, softmax and the weighted sum all materialized."""
    if enable_gqa:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    scores = query @ key.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(query.shape[-1]))
    if is_causal:
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return scores.softmax(dim=-1) @ value


@pytest.fixture(scope="module", params=MODELS)
def started(request):
    """The model launched on the CPU with the math attention in place for the profile and every step after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", math_sdpa)
        rc = load_runtime_config([f"+model={request.param}", "device=cpu", f"device.memory_bytes_per_device={256 * MiB}",
                                  *LIMITS])
        runner, report = launch(rc, CpuBackend(memory_bytes_per_device=256 * MiB))
        yield rc, runner, report
        runner.free_pools()


# A step of a profiled shape peaks where the profile did, give or take allocations this process's history decides
# (caches earlier tests warmed, or not, before the profile ran): the same 8 x 8-token step once peaked 13.7 KB above
# the profile in the full suite, and 4.9 KB below it alone. What the bound guards is far larger: the long chunk the
# old profile missed costs 420 KB more than its spread-out budget (test_the_old_even_profile_...).
HISTORY_SLACK = 64 << 10


def bound(report) -> int:
    """What a step may peak at: peak_non_kv + scratch, plus the KV pages the pools hold beside the scratch (and
    HISTORY_SLACK)."""
    return (report.plan.devices[0].peak_non_kv_bytes + report.plan.scratch_bytes + report.plan.kv_cache_bytes
            + HISTORY_SLACK)


def step_peak(runner, batch: StepBatch, sample: bool = True) -> int:
    """Tracker peak of one step and of sampling its logits with temperature, top-k and top-p."""
    with torch.inference_mode(), AllocationTracker() as tracker:
        tracker.adopt([*runner.pools.values(), *runner.weight_tensors()])   # as a device holds them
        logits = runner.execute(batch)
        if sample and logits.shape[0]:
            Sampler(runner.device).sample(logits, [(f"s{i}", TOP_K_TOP_P) for i in range(logits.shape[0])])
        return tracker.peak_bytes


def build(rc, kv, seqs: list[tuple[int, int]], seed: int = 0) -> StepBatch:
    """A step of (tokens, start_pos) sequences with random token ids, on pages a KvCacheManager hands out as
    it would in the engine: each sequence's history is allocated and committed in chunks first."""
    rng, chunk, vocab = random.Random(seed), step_limits(rc).max_chunk, rc.model.layout.vocab_size
    steps = []
    for i, (n, start) in enumerate(seqs):
        rid, tokens = f"r{i}", [rng.randrange(3, vocab) for _ in range(start + n)]
        for done in range(0, start, chunk):
            kv.allocate(rid, tokens, min(chunk, start - done))
            kv.commit(rid, min(done + chunk, start))
        kv.allocate(rid, tokens, n)
        steps.append(SeqStep(rid, tokens[start:], start, kv.block_tables(rid)))
    return StepBatch(steps, new_pages=kv.take_new_pages())


def manager(rc, report) -> KvCacheManager:
    kv = KvCacheManager(rc.model.cache_groups, rc.block_size, enable_prefix_caching=False)
    kv.initialize(report.plan.num_blocks)
    return kv


def extreme_steps(rc) -> dict[str, list[tuple[int, int]]]:
    """The scheduler's extremes, from the config's numbers (not from worst_steps): every one is legal, so a
    chunk of 2+ tokens starts on a block boundary (the scheduler ends every partial prefill chunk on one)."""
    m, t, s, d = rc.max_model_len, rc.max_num_batched_tokens, rc.max_num_seqs, rc.decode_batch
    chunk = min(rc.model.layout.tokens_in_flight or t, t)
    last = m - 1                                   # the last token a request computes is at position m - 2

    def at_end(n: int) -> tuple[int, int]:
        return n, (last - n) // rc.block_size * rc.block_size

    rest = t - d
    few_small = [at_end(min(chunk, rest - 2 * (s - d - 1)))] + [(2, 0)] * (s - d - 1)
    longest = at_end(chunk)
    return dict(zip(EXTREMES, [
        [longest],
        [at_end(last - (longest[1] + rc.block_size))],
        [(1, last - 1)] * d,
        [(1, last - 1)] * d + [at_end(min(rest, chunk))],
        [(1, last - 1)] * d + few_small,
        [at_end(t // s)] * s,
    ]))


@pytest.mark.parametrize("name", EXTREMES)
def test_extreme_steps_peak_within_the_profiled_bound(started, name):
    rc, runner, report = started
    seqs = extreme_steps(rc)[name]
    limits = step_limits(rc)
    assert sum(n for n, _ in seqs) <= limits.max_tokens and len(seqs) <= limits.max_seqs
    assert sum(1 for n, _ in seqs if n == 1) <= limits.max_decode_rows
    assert all(n <= limits.max_chunk and start + n < rc.max_model_len for n, start in seqs)
    assert all(start % rc.block_size == 0 for n, start in seqs if n > 1)
    assert step_peak(runner, build(rc, manager(rc, report), seqs)) <= bound(report)


@pytest.mark.parametrize("started", ["qwen3_tiny"], indirect=True)
def test_the_old_even_profile_would_not_have_bounded_the_long_chunk(started, monkeypatch):
    """Guards the test itself: the whole budget in one sequence costs more than the budget spread out (Qwen3
    attending to cached chunks one at a time, whose attention peaks at the longest chunk; DeepSeek V4's guard
    is its MoE routing, below). With its default grouping the runner gathers the spread chunks' pages together,
    which costs more than the long chunk, and both are profiled."""
    monkeypatch.setattr(npu.qwen3.step_meta, "GROUP_GATHER_TOKENS", 0)
    rc, runner, report = started
    steps = extreme_steps(rc)
    long_chunk = step_peak(runner, build(rc, manager(rc, report), steps["one sequence, whole chunk, full context"]),
                           sample=False)
    spread = step_peak(runner, build(rc, manager(rc, report), steps["budget spread evenly (the old profile)"]),
                       sample=False)
    assert long_chunk > spread


def test_scheduled_workload_stays_within_the_bound(started):
    """A real Scheduler and KvCacheManager: long and short prompts arriving together, chunked prefills next to
    decodes, up to max_model_len; every step and its sampling peak within the bound."""
    rc, runner, report = started
    kv = manager(rc, report)
    sched = Scheduler(rc, kv)
    rng = random.Random(3)
    vocab = rc.model.layout.vocab_size
    for i, (prompt, new) in enumerate([(255, 1), (240, 15), (120, 12), (60, 10), (33, 8), (7, 12), (2, 10), (1, 9),
                                       (90, 8), (17, 10)]):
        params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=new)
        sched.add(Sequence(f"w{i}", [rng.randrange(3, vocab) for _ in range(prompt)], params, lambda out: None))
    sampler, limit, steps, mixed = Sampler(runner.device), bound(report), 0, 0
    while sched.has_work():
        scheduled = sched.schedule()
        batch = StepBatch([SeqStep(s.seq.request_id, s.seq.token_ids[s.seq.num_computed_tokens:
                                                                      s.seq.num_computed_tokens + s.num_new_tokens],
                                   s.seq.num_computed_tokens, kv.block_tables(s.seq.request_id), sample=s.samples)
                           for s in scheduled], new_pages=kv.take_new_pages())
        with torch.inference_mode(), AllocationTracker() as tracker:
            tracker.adopt([*runner.pools.values(), *runner.weight_tensors()])   # as a device holds them
            logits = runner.execute(batch)
            samplers = [s for s in scheduled if s.samples]
            tokens = sampler.sample(logits, [(s.seq.request_id, s.seq.params) for s in samplers]) if samplers else []
            assert tracker.peak_bytes <= limit, f"step {steps}: {[(len(s.token_ids), s.start_pos) for s in batch.seqs]}"
        mixed += any(len(s.token_ids) == 1 for s in batch.seqs) and any(len(s.token_ids) > 1 for s in batch.seqs)
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            kv.commit(s.seq.request_id, s.seq.num_computed_tokens)
        for s, token in zip(samplers, tokens):
            s.seq.append_token(token)
            if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                sched.remove(s.seq)
        steps += 1
    assert mixed >= 3, "the workload must mix decodes with prefill chunks"


@pytest.mark.parametrize("model", ["qwen3_tiny", "dsv4_tiny"])
def test_every_worst_step_runs_on_scratch_pages_only(model):
    """scratch_batch turns each worst step into a batch on scratch pages: real pages are never touched."""
    rc = load_runtime_config([f"+model={model}", *LIMITS])
    runner = build_runner(rc.model, torch.device("cpu"))
    runner.load_weights()
    blocks = {s.name: 4 for s in rc.model.cache_groups}
    runner.allocate_pools(blocks, rc.decode_batch)
    for pool in runner.pools.values():
        pool[:, :4].fill_(float("nan"))
    steps = worst_steps(step_limits(rc))
    assert steps[0].name == "decode_gather"
    for step in steps:
        batch = runner.scratch_batch(step)
        assert [(len(s.token_ids), s.start_pos) for s in batch.seqs] == [(s.num_tokens, s.start_pos) for s in step.seqs]
        for s in batch.seqs:
            for name, pages in s.block_tables.items():
                assert pages and all(4 <= p < 4 + rc.decode_batch for p in pages)
        logits = runner.execute(batch)
        assert logits.shape == (len(step.seqs), rc.model.layout.vocab_size) and torch.isfinite(logits).all()
    for name, pool in runner.pools.items():
        assert pool[:, :4].isnan().all(), name


def test_scratch_batch_needs_scratch_pages():
    rc = load_runtime_config(["+model=qwen3_tiny"])
    runner = build_runner(rc.model, torch.device("cpu"))
    runner.allocate_pools({"kv": 4}, 0)
    with pytest.raises(RuntimeError, match="scratch_batch needs scratch pages"):
        runner.scratch_batch(StepShape("x", (SeqShape(3, 0),)))


def test_the_sampler_at_its_largest_batch_is_within_the_bound():
    """A vocabulary large next to the step's activations: sampling every sequence of a step with top-k and
    top-p (a full sort of each row) peaks above the model step, so the profile must have run the sampler."""
    rc = load_runtime_config(["+model=qwen3_tiny", "model.layout.vocab_size=32768", "device=cpu",
                              f"device.memory_bytes_per_device={256 * MiB}", *LIMITS])
    runner, report = launch(rc, CpuBackend(memory_bytes_per_device=256 * MiB))
    rows = step_limits(rc).max_sampled_rows
    batch = build(rc, manager(rc, report), [(2, 0)] * rows)          # every sequence of the step samples
    assert step_peak(runner, batch, sample=False) < step_peak(runner, batch) <= bound(report)
    runner.free_pools()


# DeepSeek V4 with an MoE whose activations outweigh attention's, routing 8 of 32 experts: a token-spread routing
# gives each expert about a quarter of the tokens; the shared expert computes all of them either way.
MOE_HEAVY = ["+model=dsv4_tiny", "model.layout.num_experts=32", "model.layout.num_experts_per_tok=8",
             "model.layout.moe_intermediate_size=512"]


def recorded_routings(monkeypatch) -> list[list[set[int]]]:
    """The experts each token picks in each routed MoE call of the DeepSeek V4 runner, from now on (as Python
    sets: no tensor is kept alive to add to a tracked peak)."""
    import npu.deepseek_v4.runner as dsv4
    seen, real = [], dsv4.routed_experts

    def recording(h, weights, experts, expert, limit):
        seen.append([set(row) for row in experts.tolist()])
        return real(h, weights, experts, expert, limit)

    monkeypatch.setattr(dsv4, "routed_experts", recording)
    return seen


def test_profile_steps_route_every_token_to_the_same_experts(monkeypatch):
    rc = load_runtime_config(["+model=dsv4_tiny", *LIMITS])
    runner = build_runner(rc.model, torch.device("cpu"))
    runner.load_weights()
    runner.allocate_pools({s.name: 0 for s in rc.model.cache_groups}, rc.decode_batch)
    seen, k = recorded_routings(monkeypatch), rc.model.layout.num_experts_per_tok
    for step in worst_steps(step_limits(rc)):
        batch = runner.scratch_batch(step)
        assert batch.worst_case
        runner.execute(batch)
        assert len(seen) == len(rc.model.main_layer_ratios), step.name                 # one routing per layer
        assert all(rows == [set(range(k))] * len(rows) for rows in seen), step.name
        seen.clear()
        runner.execute(dataclasses.replace(batch, worst_case=False))                  # the router's own choice
        if step.num_tokens > 8:
            assert any(len(set().union(*rows)) > k for rows in seen), step.name
        seen.clear()


def route_everything_to(runner, experts: list[int]) -> None:
    """Make the runner's routers send every token to `experts`: hash tables name them for every token, the
    top-k layers' selection bias favours them by far."""
    lay = runner.model.layout
    for layer in range(len(runner.model.main_layer_ratios)):
        p = f"layers.{layer}.ffn.gate."
        if layer < lay.num_hash_layers:
            runner.params[p + "tid2eid"][:] = torch.tensor(experts)
        else:
            runner.params[p + "bias"][:] = 0.0
            runner.params[p + "bias"][experts] = 1e4


def test_a_step_whose_tokens_all_pick_the_same_experts_is_within_the_bound(monkeypatch):
    """A real step whose router sends every token to the same experts peaks above the same step routed as the
    random weights route it, and within the bound: the profile routes its steps that way. Profiled with
    random tokens routed by the router instead (spread over the experts), the bound would be exceeded."""
    overrides = [*MOE_HEAVY, "device=cpu", f"device.memory_bytes_per_device={256 * MiB}", *LIMITS]
    rc = load_runtime_config(overrides)
    runner, report = launch(rc, CpuBackend(memory_bytes_per_device=256 * MiB))
    for pool in runner.pools.values():      # the steps attend to histories allocated but never computed (build):
        pool.zero_()                        # zeros stand for them, or uninitialized rows would decide the routing
    seqs = extreme_steps(rc)["budget spread evenly (the old profile)"]
    natural = step_peak(runner, build(rc, manager(rc, report), seqs), sample=False)
    route_everything_to(runner, list(range(rc.model.layout.num_experts_per_tok)))
    seen = recorded_routings(monkeypatch)
    concentrated = step_peak(runner, build(rc, manager(rc, report), seqs), sample=False)
    assert all(rows == [set(range(rc.model.layout.num_experts_per_tok))] * len(rows) for rows in seen)
    assert natural < concentrated <= bound(report)
    runner.free_pools()

    scratch_batch, rng = ModelRunner.scratch_batch, random.Random(5)

    def routed_by_the_router(self, step):
        batch = scratch_batch(self, step)
        seqs = [dataclasses.replace(s, token_ids=[rng.randrange(3, 500) for _ in s.token_ids]) for s in batch.seqs]
        return dataclasses.replace(batch, seqs=seqs, worst_case=False)

    monkeypatch.setattr(ModelRunner, "scratch_batch", routed_by_the_router)
    _, spread = launch(load_runtime_config(overrides), CpuBackend(memory_bytes_per_device=256 * MiB))
    assert concentrated - report.plan.kv_cache_bytes > spread.plan.devices[0].peak_non_kv_bytes + spread.plan.scratch_bytes
