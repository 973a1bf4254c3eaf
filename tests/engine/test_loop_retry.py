"""A failing engine step and its one-by-one retry (appliance/engine/core.py `_run_step`), on the scripted runner
with step hooks, so what each request receives is known. Written against the mutants docs/TESTING.md lists.

- The failure is logged once, at ERROR with its traceback, naming how many sequences the failed step held
  (what an operator reads to tell one bad request from a broken device).
- The failing request ends ABORTED with the runner's error as the client sees it: the exception's type and
  message, exactly.
- Requests that finished in the retries are forgotten like any finished request: shutting the engine down
  gives them no second final output.
- engine.steps (the step count bench/bench_engine.py reports) counts one per runner step.
"""

from __future__ import annotations

import logging
import threading

import pytest

import appliance.engine.core as engine_core
from appliance.config.compose import load_runtime_config
from appliance.core.request import FinishReason, SamplingParams
from tests.conftest import failed_steps_since_last_look
from tests.engine.instrumented import HookedEngine, ScriptedRunner, StepHooks


class HookedScriptedRunner(StepHooks, ScriptedRunner):
    """The scripted model with StepHooks: record steps, fail chosen requests, hold the loop inside a step."""

    def __init__(self, model):
        super().__init__(model)
        self.steps, self.announced, self.fail_from = [], [], {}
        self.hold, self.held, self.release = threading.Event(), threading.Event(), threading.Event()


def final(handle):
    deltas = []
    while not deltas or not deltas[-1].finished:
        deltas.append(handle.outputs.get(timeout=60))
    return deltas


@pytest.mark.expects_failed_steps
@pytest.mark.parametrize("setting", ["false", "true"], ids=["sync", "async"])
def test_a_failed_step_is_logged_and_retried_and_its_finished_requests_are_forgotten(caplog, setting):
    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", "max_model_len=64", "kv_cache.num_slots_override=4",
                              "max_num_seqs=4", f"async_scheduling={setting}"])
    runner = HookedScriptedRunner(rc.model)
    engine = HookedEngine(rc, runner)
    engine.start()
    caplog.set_level(logging.ERROR, logger=engine_core.__name__)
    try:
        for rid, outputs in {"gate": [8, 9, 10, 11, 12], "a": [20], "b": [21], "poison": [22]}.items():
            runner.script(rid, [5, 6, 7], outputs)
        runner.fail_from["poison"] = 0
        runner.hold.set()                   # the loop waits inside the gate's first step ...
        gate = engine.submit("gate", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
        while not runner.held.wait(0.1):    # or the gate ended before its step reached the runner
            assert gate.outputs.empty(), gate.outputs.get()
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        handles = {rid: engine.submit(rid, [5, 6, 7], one) for rid in ("a", "b", "poison")}
        runner.hold.clear()                 # ... so a, b and poison share the next step with it, which fails
        runner.release.set()
        finals = {rid: final(h)[-1] for rid, h in handles.items()}
        final(gate)
        failed_steps = engine.stats().failed_steps
    finally:
        engine.shutdown()
    # The batch step and poison's retry failed: counted (Stats, /metrics) and told to the suite's check
    # (tests/conftest.py), which this test, marked, reads itself.
    assert failed_steps == 2
    assert failed_steps_since_last_look() == ["RuntimeError: injected runner failure for ['poison']"] * 2
    assert finals["poison"].finish_reason is FinishReason.ABORTED
    assert finals["poison"].error == "RuntimeError: injected runner failure for ['poison']"
    for rid, token in (("a", 20), ("b", 21)):
        assert finals[rid].finish_reason is FinishReason.LENGTH and finals[rid].error is None
        assert finals[rid].new_token_ids == (token,)
    assert all(h.outputs.empty() for h in handles.values()) and gate.outputs.empty()

    failed = [rows for rows, (_, raised) in zip(runner.steps, runner.announced) if raised]
    assert len(failed[0]) == 4 and {r[0] for r in failed[0]} == {"gate", "a", "b", "poison"}
    records = [r for r in caplog.records if r.name == engine_core.__name__]
    assert len(records) == 1 and records[0].levelno == logging.ERROR and records[0].exc_info
    assert records[0].getMessage() == "engine step failed; retrying its 4 sequences one by one"


def test_the_step_count_counts_each_runner_step():
    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", "max_model_len=64", "kv_cache.num_slots_override=2"])
    runner = HookedScriptedRunner(rc.model)
    engine = HookedEngine(rc, runner)
    engine.start()
    try:
        runner.script("r", [5, 6, 7], [8, 9, 10, 11])
        before, runs = engine.steps, len(runner.steps)
        final(engine.submit("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)))
        assert engine.steps - before == len(runner.steps) - runs == 4      # one prefill, three decodes
    finally:
        engine.shutdown()


def test_a_prefill_chunk_that_samples_nothing_takes_no_token_from_a_request_stepped_with_it():
    """Only the rows that sample get logits: a long prompt's non-final chunk, stepped before a new request's
    prefill, must not shift that request's token onto the chunk's row."""
    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", "max_model_len=64", "kv_cache.num_slots_override=2",
                              "max_num_batched_tokens=24"])
    runner = HookedScriptedRunner(rc.model)
    engine = HookedEngine(rc, runner)
    engine.start()
    try:
        long_prompt = [3 + i for i in range(48)]           # block-aligned chunks of 16 tokens
        runner.script("long", long_prompt, [50, 51])
        runner.script("short", [5, 6], [60, 61])
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        runs = len(runner.steps)            # the startup profile's steps come first
        runner.hold.set()                   # the loop waits inside the long prompt's first chunk ...
        long = engine.submit("long", long_prompt, params)
        while not runner.held.wait(0.1):
            assert long.outputs.empty(), long.outputs.get()
        short = engine.submit("short", [5, 6], params)
        runner.hold.clear()                 # ... so its second chunk and the short prefill share the next step
        runner.release.set()
        got = {rid: [t for d in final(h) for t in d.new_token_ids] for rid, h in (("long", long), ("short", short))}
    finally:
        engine.shutdown()
    assert got == {"long": [50, 51], "short": [60, 61]}
    assert [(rid, n, sample) for rid, _, n, sample in runner.steps[runs + 1]] == [("long", 16, False), ("short", 2, True)]
