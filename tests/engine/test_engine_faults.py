"""The engine when its runner fails for one request: the others go on, with every page they were given.

StepBatch.new_pages announces the pages that received a new logical page since the previous step; a runner
zeroes the state pages among them before use. When a step fails and the engine retries its sequences one
by one, the pages announced to the failed step must reach the runner again, or the survivors' new state
pages would start with another request's stale rows.
"""

from __future__ import annotations

import random

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.request import FinishReason, SamplingParams
from appliance.offline import Appliance
from tests.engine.instrumented import HookedEngine, hooked_runner, loop_held, runner_for_engine
from tests.support.kv import free_blocks, total_blocks

NEW_TOKENS = 12


def finish(handle) -> list:
    deltas = []
    while not deltas or not deltas[-1].finished:
        deltas.append(handle.outputs.get(timeout=120))
    return deltas


@pytest.mark.expects_failed_steps
def test_pages_announced_to_a_failed_step_reach_the_next_step_that_runs():
    rc = load_runtime_config(["+model=dsv4_tiny", "device=cpu", "max_model_len=128", "kv_cache.num_slots_override=6"])
    runner = hooked_runner(rc.model)
    engine = HookedEngine(rc, runner)
    engine.start()
    try:
        rng = random.Random(3)
        greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        gate = engine.submit("gate", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))   # (runs past the hold)
        gate.outputs.get(timeout=120)
        runner.fail_from["poison"] = 0
        with loop_held(runner):           # all of them are admitted together in the step after the hold
            handles = [engine.submit(f"n{i}", [rng.randrange(3, 512) for _ in range(rng.randint(5, 30))], greedy)
                       for i in range(3)]
            poison = engine.submit("poison", [rng.randrange(3, 512) for _ in range(20)], greedy)
        finals = [finish(h)[-1] for h in handles]
        failed = finish(poison)[-1]
        finish(gate)
        assert failed.finish_reason is FinishReason.ABORTED and "injected runner failure" in failed.error
        assert all(f.finish_reason is FinishReason.LENGTH and f.error is None for f in finals)
        assert [f.usage.completion_tokens for f in finals] == [NEW_TOKENS] * 3
        assert engine.num_in_flight() == 0 and free_blocks(engine) == total_blocks(engine)

        states = {s.name for s in rc.model.cache_groups if s.is_ring}
        failures = [i for i, (_, raised) in enumerate(runner.announced) if raised]
        assert failures and any(runner.announced[failures[0]][0].get(g) for g in states)
        for i in failures:
            pages = runner.announced[i][0]
            after = next(announced for announced, raised in runner.announced[i + 1:] if not raised)
            for group, announced in pages.items():
                missing = set(announced) - set(after.get(group, []))
                assert not missing, f"{group} pages {sorted(missing)} were announced only to a step that failed"
    finally:
        engine.shutdown()


class FailNth(dict):
    """StepHooks.fail_from that fails the n-th request id the runner asks about (ids the test cannot know in
    advance: the offline API names its requests), from its first token."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.seen: list[str] = []

    def get(self, request_id, default=None):
        if request_id not in self.seen:
            self.seen.append(request_id)
        return 0 if self.seen.index(request_id) == self.n else default


@pytest.mark.expects_failed_steps
def test_offline_generate_names_a_failed_request_after_every_request_finished():
    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", "max_model_len=128"])
    runner = hooked_runner(rc.model)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    with runner_for_engine(runner), Appliance.from_config(rc) as app:
        expected = app.generate(prompts, greedy)
        runner.fail_from = FailNth(1)                 # the second prompt of the next call
        with pytest.raises(RuntimeError, match="injected runner failure") as failure:
            app.generate(prompts, greedy)
        failed_id = runner.fail_from.seen[1]
        assert failed_id in str(failure.value)
        # generate returned only once the engine had finished every request (none left holding pages)
        assert app.engine.num_in_flight() == 0 and free_blocks(app.engine) == total_blocks(app.engine)
        assert [r.finish_reason for r in expected] == [FinishReason.LENGTH] * 3
        assert all(len(r.token_ids) == NEW_TOKENS and r.usage.completion_tokens == NEW_TOKENS for r in expected)
