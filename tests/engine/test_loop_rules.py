"""Stop-string matching and hold-back of the real engine at their edges (appliance/engine/output.py),
written against the mutants docs/TESTING.md lists. The model is the scripted runner of test_stop_rules.py,
so the text is known; expected figures come from the tokenizer's plain decode and str.find.

- A stop string whose last character is the first character of a new delta (its start lies as far back as
  a new match can start) still ends the request there.
- Streaming holds back at most (longest stop string - 1) characters: anything further back can no longer
  become part of a stop string, so it must have been streamed.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.request import FinishReason, RequestOutput, SamplingParams
from tests.engine.instrumented import HookedEngine, ScriptedRunner, loop_held
from tests.engine.test_loop_retry import HookedScriptedRunner
from tests.engine.test_stop_rules import PROMPT_TEXT, TEXT, engine, generate, pieces  # noqa: F401 - a fixture
from tests.support.kv import free_blocks, total_blocks


def delta_boundaries(tokenizer, ids: list[int]) -> list[int]:
    """Where each token's text starts in the decoded text."""
    return [0, *itertools.accumulate(len(p) for p in pieces(tokenizer, ids))][:-1]


def test_a_stop_string_completed_by_the_first_character_of_a_delta_ends_the_request(engine):  # noqa: F811
    tok = engine.tokenizer
    ids = tok.encode(TEXT)
    text, parts, starts = tok.decode(ids), pieces(tok, ids), delta_boundaries(tok, ids)
    # Two characters straddling a delta boundary, found nowhere earlier in the text.
    i = next(i for i in range(1, len(ids)) if parts[i - 1] and parts[i]
             and text.find(parts[i - 1][-1] + parts[i][0]) == starts[i] - 1)
    stop = parts[i - 1][-1] + parts[i][0]
    deltas = generate(engine, ids, SamplingParams(max_tokens=len(ids), stop=(stop,)))
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert "".join(d.new_text for d in deltas) == text[:starts[i] - 1]
    assert [t for d in deltas for t in d.new_token_ids] == ids[:i + 1]


@pytest.mark.parametrize("stop", [("zebra",), ("q", "zebra!!"), ("Z",)])
def test_streaming_holds_back_no_more_than_a_stop_string_could_still_need(engine, stop):  # noqa: F811
    tok = engine.tokenizer
    ids = tok.encode(TEXT)
    text = tok.decode(ids)
    assert not any(s in text for s in stop)
    hold = max(len(s) for s in stop) - 1
    deltas = generate(engine, ids, SamplingParams(max_tokens=len(ids), stop=stop))
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    streamed = ""
    for n, delta in enumerate(deltas[:-1], start=1):
        streamed += delta.new_text
        so_far = tok.decode(ids[:n])
        assert so_far.startswith(streamed)
        assert len(streamed) >= len(so_far) - hold, (n, streamed, so_far)
    assert streamed + deltas[-1].new_text == text


def test_the_earliest_of_two_overlapping_matches_in_one_window_is_the_cut(engine):  # noqa: F811
    """'o' then 'oo': the text ends 'ooo' and the stop string 'oo' occurs at both of the last two offsets; the
    text is cut before the first."""
    tok = engine.tokenizer
    texts = {i: tok.decode([i]) for i in range(tok.vocab_size)}
    doubled = next(i for i, t in texts.items() if len(t) >= 2 and t[0] == t[1] and t[0].isalpha())
    c = texts[doubled][0]
    before = next(i for i, t in texts.items() if len(t) >= 2 and t.endswith(c) and c not in t[:-1]
                  and pieces(tok, [i, doubled]) == [t, texts[doubled]])
    deltas = generate(engine, [before, doubled], SamplingParams(max_tokens=2, stop=(c + c,)))
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert "".join(d.new_text for d in deltas) == texts[before][:-1]


def test_an_abort_sent_from_the_first_delta_ends_the_request_at_the_next_step(engine):  # noqa: F811
    """The abort is queued before the next step (the delta callback runs on the loop thread), so the request
    ends ABORTED there with no further token, and gives every block back."""
    tok = engine.tokenizer
    ids = tok.encode(TEXT)
    prompt = tok.encode(PROMPT_TEXT)
    engine.test_runner.script("aborted-early", prompt, ids)
    deltas: list[RequestOutput] = []
    done = threading.Event()

    def on_output(out: RequestOutput) -> None:
        deltas.append(out)
        if len(deltas) == 1:
            engine.abort("aborted-early")
        if out.finished:
            done.set()

    engine.submit("aborted-early", prompt, SamplingParams(max_tokens=len(ids)), on_output)
    assert done.wait(timeout=60)
    assert [d.finish_reason for d in deltas] == [None, FinishReason.ABORTED]
    assert deltas[-1].new_text == "" and deltas[-1].new_token_ids == ()
    assert [t for d in deltas for t in d.new_token_ids] == ids[:1]
    assert engine.num_in_flight() == 0 and free_blocks(engine) == total_blocks(engine)


@pytest.mark.parametrize("setting", ["false", "true"], ids=["sync", "async"])
def test_a_finished_request_gets_no_second_final_output_at_shutdown(setting):
    """The loop forgets a request once it finished: shutting the engine down aborts only what still runs."""
    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", "max_model_len=64", "kv_cache.num_slots_override=2",
                              f"async_scheduling={setting}"])
    eng = HookedEngine(rc, ScriptedRunner(rc.model))
    eng.start()
    try:
        prompt = eng.tokenizer.encode(PROMPT_TEXT)
        ids = eng.tokenizer.encode(TEXT)[:3]
        eng.test_runner.script("finished", prompt, ids)
        handle = eng.submit("finished", prompt, SamplingParams(max_tokens=len(ids)))
        deltas = [handle.outputs.get(timeout=60)]
        while not deltas[-1].finished:
            deltas.append(handle.outputs.get(timeout=60))
        assert deltas[-1].finish_reason is FinishReason.LENGTH
    finally:
        eng.shutdown()
    assert handle.outputs.empty()


@pytest.mark.parametrize("setting", ["false", "true"], ids=["sync", "async"])
def test_a_request_still_running_at_shutdown_ends_aborted_and_gives_back_its_blocks(setting):
    """Shutdown during a step: once the step ends, the loop stops and ends what it still holds (ABORTED, no error),
    freeing its blocks (a server's drain relies on it: tests/serve/test_server_engine_drain.py)."""
    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", "max_model_len=64", "kv_cache.num_slots_override=2",
                              f"async_scheduling={setting}"])
    runner = HookedScriptedRunner(rc.model)
    eng = HookedEngine(rc, runner)
    eng.start()
    stopping = threading.Thread(target=eng.shutdown)
    try:
        prompt = eng.tokenizer.encode(PROMPT_TEXT)
        # the loop waits inside the request's first step (armed before the submit: a fast loop cannot finish all
        # 40 tokens while this thread is descheduled, which a busy machine once did)
        with loop_held(runner, lambda: eng.submit("running", prompt, SamplingParams(max_tokens=40,
                                                                                    ignore_eos=True))) as handle:
            stopping.start()
            while eng.ready:
                time.sleep(0.01)
            time.sleep(0.2)                # (shutdown stops the loop right after it stops admitting)
        deltas = [handle.outputs.get(timeout=60)]
        while not deltas[-1].finished:
            deltas.append(handle.outputs.get(timeout=60))
        stopping.join(60)
    finally:
        if not stopping.is_alive():
            eng.shutdown()
    assert deltas[-1].finish_reason is FinishReason.ABORTED and deltas[-1].error is None
    assert 1 <= deltas[-1].usage.completion_tokens < 40
    assert free_blocks(eng) == total_blocks(eng) and handle.outputs.empty()


def test_a_seeded_request_draws_the_same_tokens_when_its_id_is_reused(engine):  # noqa: F811
    """A finished request's generator is dropped: the same id with the same seed starts the same stream again.
    Unscripted, the runner's logits are flat but for one token, so temperature 100 draws all over the vocabulary."""
    prompt = engine.tokenizer.encode(PROMPT_TEXT)
    params = SamplingParams(max_tokens=8, temperature=100.0, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        handle = engine.submit("reused-id", prompt, params)
        deltas = [handle.outputs.get(timeout=60)]
        while not deltas[-1].finished:
            deltas.append(handle.outputs.get(timeout=60))
        runs.append([t for d in deltas for t in d.new_token_ids])
    assert len(set(runs[0])) > 1 and runs[0] == runs[1]


def test_each_finished_request_is_counted_under_its_finish_reason(engine):  # noqa: F811
    """/metrics' finished-requests counter, by reason: one stop string, one length; and their end-to-end
    latencies, which together cannot exceed the time both requests took."""
    tok = engine.tokenizer
    ids = tok.encode(TEXT)
    before = engine.stats()
    started = time.monotonic()
    generate(engine, ids, SamplingParams(max_tokens=len(ids), stop=("scarce",)))
    generate(engine, ids[:2], SamplingParams(max_tokens=2))
    elapsed = time.monotonic() - started
    after = engine.stats()
    counted = {reason: n - before.finished.get(reason, 0) for reason, n in after.finished.items()}
    assert {reason: n for reason, n in counted.items() if n} == {"stop": 1, "length": 1}
    assert after.e2e_request_latency.count - before.e2e_request_latency.count == 2
    assert 0 < after.e2e_request_latency.sum - before.e2e_request_latency.sum <= elapsed
