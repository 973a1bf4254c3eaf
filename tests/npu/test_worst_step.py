"""The startup profile bounds every step the scheduler can issue.

With attention's explicit math path (what an accelerator without a fused kernel for the step runs: the full
score matrix is materialized) and the CPU allocation tracker, a runner started by the launcher is driven
through the scheduler's extreme steps, built here from the config's numbers, and through a real
Scheduler + KvCacheManager workload; every step, and the sampler after it, must peak at or below
peak_non_kv + scratch (plus the KV pages the step's pools hold). Written over runners: deepseek_v4 joins
MODELS once its runner is the released architecture.
"""

import math
import random

import pytest
import torch
import torch.nn.functional as F

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
from npu.sampler import Sampler
from npu.step import SeqStep, StepBatch

MiB = 1 << 20
MODELS = [pytest.param("qwen3_tiny", id="qwen3")]
LIMITS = ["max_model_len=256", "max_num_batched_tokens=64", "max_num_seqs=8", "decode_batch=4"]
TOP_K_TOP_P = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
EXTREMES = ("one sequence, whole budget, full context", "largest decode gather", "decodes + one chunk at full context",
            "decodes + a long chunk and short ones (padded to the longest)", "budget spread evenly (the old profile)")


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


def bound(report) -> int:
    """What a step may peak at: peak_non_kv + scratch, plus the KV pages the pools hold beside the scratch."""
    return report.plan.devices[0].peak_non_kv_bytes + report.plan.scratch_bytes + report.plan.kv_cache_bytes


def step_peak(runner, batch: StepBatch, sample: bool = True) -> int:
    """Tracker peak of one step and of sampling its logits with temperature, top-k and top-p."""
    with torch.inference_mode(), AllocationTracker() as tracker:
        tracker.adopt(runner.pools.values())
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
    kv.initialize_from_plan(report.plan)
    return kv


def extreme_steps(rc) -> dict[str, list[tuple[int, int]]]:
    """The scheduler's extremes, from the config's numbers (not from worst_steps): every one is legal."""
    m, t, s, d = rc.max_model_len, rc.max_num_batched_tokens, rc.max_num_seqs, rc.decode_batch
    chunk = min(rc.model.layout.tokens_in_flight or t, t)
    last = m - 1                                   # the last token a request computes is at position m - 2
    rest = t - d
    few_small = [(rest - 2 * (s - d - 1), last - (rest - 2 * (s - d - 1)))] + [(2, 0)] * (s - d - 1)
    return dict(zip(EXTREMES, [
        [(chunk, last - chunk)],
        [(1, last - 1)] * d,
        [(1, last - 1)] * d + [(min(rest, chunk), last - min(rest, chunk))],
        [(1, last - 1)] * d + few_small,
        [(t // s, last - t // s)] * s,
    ]))


@pytest.mark.parametrize("name", EXTREMES)
def test_extreme_steps_peak_within_the_profiled_bound(started, name):
    rc, runner, report = started
    seqs = extreme_steps(rc)[name]
    limits = step_limits(rc)
    assert sum(n for n, _ in seqs) <= limits.max_tokens and len(seqs) <= limits.max_seqs
    assert sum(1 for n, _ in seqs if n == 1) <= limits.max_decode_rows
    assert all(n <= limits.max_chunk and start + n < rc.max_model_len for n, start in seqs)
    assert step_peak(runner, build(rc, manager(rc, report), seqs)) <= bound(report)


def test_the_old_even_profile_would_not_have_bounded_the_long_chunk(started):
    """Guards the test itself: the whole budget in one sequence costs more than the budget spread out."""
    rc, runner, report = started
    steps = extreme_steps(rc)
    long_chunk = step_peak(runner, build(rc, manager(rc, report), steps["one sequence, whole budget, full context"]),
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
    for i, (prompt, new) in enumerate([(255, 1), (190, 65), (120, 40), (60, 30), (33, 20), (7, 25), (2, 12), (1, 9),
                                       (90, 10), (17, 17)]):
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
            tracker.adopt(runner.pools.values())
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
