"""Async scheduling (appliance/engine/core.py, Scheduler.commit / resolve): step N+1 is scheduled while step N runs, and
launched before N's tokens are read (its rows fed them on the device) or, where N's logits are still needed, after,
on the real tiny runners.

- The overlap happens: with it on, the next step is scheduled while one is in flight (engine.steps_ahead counts
  them), and a runner that takes fed tokens has it launched before the one in flight is read; with it off, never.
- It changes no output: greedy tokens, finish reasons, usage and seeded sampled tokens equal the synchronous loop's
  (logprobs to float rounding, as batches may be composed differently), under preemption, prefix hits and chunked
  prefill, with rows ending by max_tokens, max_model_len, a stop token id and a stop string.
- At most one row is computed past a row's end, and only for an end a token's value makes (a stop token id: the next
  step was fed it before it was read; a stop string, found in the text while the next step runs), never for a length
  limit; every page is free after.
- The setting: null is on for accelerators and off on the CPU and with speculative decoding; true with speculative
  decoding is a config error naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.errors import ConfigError
from appliance.core.request import CompletionResult, FinishReason, SamplingParams
from appliance.engine.core import async_scheduling
from appliance.engine.scheduler import Scheduler
from appliance.offline import Appliance
from tests.engine.instrumented import hooked_runner, runner_for_engine
from tests.support.kv import free_blocks, total_blocks

# Small pools and step budget: two capacity slots for nine requests, 32-token steps (preemption, chunked prefill).
PRESSURE = ["device=cpu", "max_model_len=128", "max_num_seqs=16", "decode_batch=4", "max_num_batched_tokens=32",
            "kv_cache.num_slots_override=2"]


def prompts(vocab: int) -> list[list[int]]:
    """Prompts sharing a 40-token prefix (prefix hits), a long one (chunked prefill), short ones."""
    rng = random.Random(5)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    tails = [[rng.randrange(3, vocab) for _ in range(n)] for n in (9, 30, 1)]
    others = [[rng.randrange(3, vocab) for _ in range(n)] for n in (70, 3, 12, 25, 5, 120)]
    return [shared + tail for tail in tails] + others


def params_for(n: int, logprobs: bool) -> list[SamplingParams]:
    """Greedy rows of different max_tokens, a seeded sampling row, one more greedy row, with logprobs (and prompt
    logprobs for the latter) or not; the last prompt (120 tokens) ends at max_model_len (128). A step with logprobs to
    read is read before the next launches (its logits are needed); without, the next is launched first, fed."""
    params = [SamplingParams(max_tokens=10 + (i * 5) % 13, ignore_eos=True) for i in range(n)]
    params[4] = SamplingParams(max_tokens=11, temperature=1.0, top_k=20, seed=7, logprobs=2 if logprobs else None,
                               ignore_eos=True)
    params[5] = SamplingParams(max_tokens=6, prompt_logprobs=1 if logprobs else None, logprobs=0 if logprobs else None,
                               ignore_eos=True)
    params[-1] = SamplingParams(max_tokens=8, ignore_eos=True)
    return params


def run(name: str, overrides: list[str], ps: list[list[int]], params: list[SamplingParams]):
    """The first prompt alone (it fills the prefix cache), then the rest at once. The results, the rows the runner
    computed (request id, start, tokens, sample), the preemptions and steps scheduled ahead."""
    rc = load_runtime_config([f"+model={name}", *PRESSURE, *overrides])
    runner = hooked_runner(rc.model)
    with runner_for_engine(runner), Appliance.from_config(rc) as app:
        results = app.generate(ps[:1], params[:1]) + app.generate(ps[1:], params[1:])
        preemptions, ahead = app.engine.scheduler.num_preemptions, app.engine.steps_ahead
        noted = any(n.startswith("async scheduling: on") for n in app.engine.report.notes)   # the startup table's
        assert noted == ("async_scheduling=true" in overrides)
        assert free_blocks(app.engine) == total_blocks(app.engine)
    rows = [row for step in runner.steps for row in step if not row[0].startswith("profile")]
    return results, rows, preemptions, ahead


def assert_same_results(sync: list[CompletionResult], overlapped: list[CompletionResult]) -> None:
    for a, b in zip(sync, overlapped, strict=True):
        assert (b.token_ids, b.finish_reason, b.usage, b.text) == (a.token_ids, a.finish_reason, a.usage, a.text), \
            f"prompt of {len(a.prompt_token_ids)} tokens"
        assert len(b.logprobs) == len(a.logprobs) and len(b.prompt_logprobs) == len(a.prompt_logprobs)
        for x, y in zip(a.logprobs + a.prompt_logprobs, b.logprobs + b.prompt_logprobs):
            if x is None or y is None:
                assert x is y
                continue
            assert (y.token_id, y.rank, [t for t, _ in y.top]) == (x.token_id, x.rank, [t for t, _ in x.top])
            assert math.isclose(y.logprob, x.logprob, rel_tol=1e-5, abs_tol=1e-5)


def last_fed_position(rows, request_id: str) -> int:
    """The furthest position the runner computed for a request (its rows are named by the offline API's ids)."""
    return max(start + n for rid, start, n, _ in rows if rid == request_id) - 1


@pytest.mark.parametrize("name, logprobs", [("qwen3_tiny", False), ("qwen3_tiny", True), ("dsv4_tiny", False)],
                         ids=["qwen3", "qwen3_logprobs", "dsv4"])
def test_async_scheduling_changes_no_output_and_computes_at_most_one_row_past_a_rows_end(name, logprobs,
                                                                                        one_torch_thread):
    vocab = load_runtime_config([f"+model={name}"]).model.layout.vocab_size
    ps = prompts(vocab)
    params = params_for(len(ps), logprobs)
    first, _, _, _ = run(name, ["async_scheduling=false"], ps, params)
    # End two greedy rows early with what they generated: a stop token id at output 2, a stop string at output 3.
    by_token, by_text = 1, 6
    params[by_token] = dataclasses.replace(params[by_token], stop_token_ids=(first[by_token].token_ids[2],))
    text = first[by_text].text
    stop_text = text[len(text) // 2:][:2]
    assert len(stop_text) == 2, text
    params[by_text] = dataclasses.replace(params[by_text], stop=(stop_text,))

    sync, sync_rows, sync_preempted, sync_ahead = run(name, ["async_scheduling=false"], ps, params)
    ours, rows, preempted, ahead = run(name, ["async_scheduling=true"], ps, params)

    assert sync_ahead == 0 and ahead > 0, (sync_ahead, ahead)
    assert sync_preempted > 0 and preempted > 0, "the workload must preempt"
    assert any(r.usage.cached_prompt_tokens > 0 for r in ours), "no prefix-cache hit"
    assert any(not sample for _, _, _, sample in rows), "no prompt was prefilled in several chunks"
    assert sync[by_token].finish_reason is FinishReason.STOP and len(sync[by_token].token_ids) == 3
    assert sync[by_text].finish_reason is FinishReason.STOP and len(sync[by_text].token_ids) < params[by_text].max_tokens
    assert sync[-1].finish_reason is FinishReason.LENGTH and len(ps[-1]) + len(sync[-1].token_ids) == 128
    assert_same_results(sync, ours)

    # The last token is sampled, never fed. Async: a row that ends by its token's value (a stop token id) may be
    # computed once more, fed that token before it is read, and a stop string is found in the text while the next
    # step runs; a length limit is known ahead, so such a row never is.
    extra = {"sync": {}, "async": {by_token: 1, by_text: 1}}
    for label, results, got in (("sync", sync, sync_rows), ("async", ours, rows)):
        for i, r in enumerate(results):
            last = len(r.prompt_token_ids) + len(r.token_ids) - 2
            assert last_fed_position(got, r.request_id) <= last + extra[label].get(i, 0), (label, i)


@pytest.mark.parametrize("feeds", [True, False], ids=["fed", "read_first"])
def test_the_next_step_is_scheduled_and_launched_while_one_runs(feeds, monkeypatch, one_torch_thread):
    """Steps in flight (executed, tokens not resolved) when each step is scheduled and at most. Synchronous: none
    and one. Async: the next step is scheduled while one is in flight; a runner that takes fed tokens (one process)
    also has the next launched before the one in flight is read (two in flight); one that does not (ranks) reads it
    first (one)."""
    schedule, resolve = Scheduler.schedule, Scheduler.resolve
    state = {"in_flight": 0, "most": 0, "scheduled_while_in_flight": 0}

    def scheduling(self):
        state["scheduled_while_in_flight"] += state["in_flight"] > 0
        return schedule(self)

    def resolving(self, samplers, sampled, refused):
        state["in_flight"] -= 1
        return resolve(self, samplers, sampled, refused)
    monkeypatch.setattr(Scheduler, "schedule", scheduling)
    monkeypatch.setattr(Scheduler, "resolve", resolving)

    def run_with(setting: str) -> dict[str, int]:
        rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", f"async_scheduling={setting}"])
        runner = hooked_runner(rc.model)
        runner.feeds_tokens = feeds
        execute = runner.execute

        def executing(batch):
            state["in_flight"] += any(s.sample for s in batch.seqs)
            state["most"] = max(state["most"], state["in_flight"])
            return execute(batch)
        runner.execute = executing
        with runner_for_engine(runner), Appliance.from_config(rc) as app:
            state.update(in_flight=0, most=0, scheduled_while_in_flight=0)
            app.generate([[5, 6, 7], [9, 10]], SamplingParams(max_tokens=6, ignore_eos=True))
            return dict(state)

    sync = run_with("false")
    assert sync["scheduled_while_in_flight"] == 0 and sync["most"] == 1 and sync["in_flight"] == 0, sync
    ahead = run_with("true")
    assert ahead["scheduled_while_in_flight"] >= 4 and ahead["in_flight"] == 0, ahead
    assert ahead["most"] == (2 if feeds else 1), ahead


def test_the_setting_defaults_by_device_and_refuses_speculative_decoding():
    rc = load_runtime_config(["device=cpu"])
    assert rc.async_scheduling is None
    assert async_scheduling(rc, torch.device("cpu")) is False
    assert async_scheduling(rc, torch.device("cuda", 0)) is True
    assert async_scheduling(dataclasses.replace(rc, async_scheduling=True), torch.device("cpu")) is True
    mtp = load_runtime_config(["device=cpu", "speculative.method=mtp"])
    assert async_scheduling(mtp, torch.device("cuda", 0)) is False
    with pytest.raises(ConfigError) as err:
        load_runtime_config(["device=cpu", "speculative.method=mtp", "async_scheduling=true"])
    assert "async_scheduling" in str(err.value) and "speculative.method" in str(err.value)
