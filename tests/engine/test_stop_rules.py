"""Stop conditions of the real engine (appliance/engine/scheduler.py update_from_output, output.py): stop strings,
EOS, stop token ids, max_tokens and max_model_len, with the model replaced by a scripted runner so the generated
text is known.

Expected texts are computed here with the tokenizer's plain decode of the scripted ids and str.find, never
read back from the engine; streamed deltas must concatenate to exactly the final text, so no delta ever
carries characters that are later withdrawn.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.request import FinishReason, RequestOutput, SamplingParams
from tests.engine.instrumented import HookedEngine, ScriptedRunner
from tests.support.kv import free_blocks, total_blocks

TEXT = " Memory is the scarce resource. A page holds the rows of many layers for a fixed number"
PROMPT_TEXT = "The appliance"
MAX_MODEL_LEN = 64
_ids = itertools.count()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request):
    """The scripted engine, stepping synchronously and with async scheduling (its next step scheduled while the
    current one runs, appliance/engine/core.py): every rule must end a request at the same token either way."""
    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", f"max_model_len={MAX_MODEL_LEN}",
                              "kv_cache.num_slots_override=4", "max_num_seqs=4",
                              f"async_scheduling={str(request.param).lower()}"])
    runner = ScriptedRunner(rc.model)
    eng = HookedEngine(rc, runner)
    eng.start()
    yield eng
    eng.shutdown()


def generate(engine, outputs: list[int], params: SamplingParams, prompt: list[int] | None = None,
             ) -> list[RequestOutput]:
    """Run one scripted request to its end; the deltas in order."""
    prompt = prompt if prompt is not None else engine.tokenizer.encode(PROMPT_TEXT)
    request_id = f"scripted-{next(_ids)}"
    engine.test_runner.script(request_id, prompt, outputs)
    handle = engine.submit(request_id, prompt, params)
    deltas = []
    while not deltas or not deltas[-1].finished:
        deltas.append(handle.outputs.get(timeout=60))
    assert engine.num_in_flight() == 0
    assert free_blocks(engine) == total_blocks(engine)
    return deltas


def pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds, from plain decodes of growing prefixes."""
    return [tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):] for i in range(len(ids))]


def deltas_touched_by(tokenizer, ids: list[int], start: int, length: int) -> int:
    """How many tokens' texts the span [start, start + length) of the decoded text overlaps."""
    ends = list(itertools.accumulate(len(p) for p in pieces(tokenizer, ids)))
    first = next(i for i, end in enumerate(ends) if end > start)
    last = next(i for i, end in enumerate(ends) if end >= start + length)
    return last - first + 1


@pytest.mark.parametrize("stop, spans", [
    (("mor",), 1),                 # inside one token's text
    (("scar",), 2),                # split across two deltas
    (("resour",), 4),              # across four
    (("the ro",), 2),              # "the " occurs earlier: a false start is held back, then released
    ((" Mem",), 3),                # at the very start: no text at all
    (("page", "scarce"), 3),       # the earliest match of any stop string wins
])
def test_text_is_cut_exactly_before_the_stop_string(engine, stop, spans):
    tok = engine.tokenizer
    ids = tok.encode(TEXT)
    text = tok.decode(ids)
    cut = min(i for i in (text.find(s) for s in stop) if i >= 0)
    first = next(s for s in stop if text.find(s) == cut)
    assert deltas_touched_by(tok, ids, cut, len(first)) == spans
    deltas = generate(engine, ids, SamplingParams(max_tokens=len(ids), stop=stop))
    streamed = "".join(d.new_text for d in deltas)
    assert streamed == text[:cut]
    assert deltas[-1].finish_reason is FinishReason.STOP
    # Generation stops at the token that completes the stop string.
    ends = list(itertools.accumulate(len(p) for p in pieces(tok, ids)))
    completing = next(i for i, end in enumerate(ends) if end >= cut + len(first))
    assert [t for d in deltas for t in d.new_token_ids] == ids[:completing + 1]


def test_text_without_a_stop_match_is_streamed_in_full(engine):
    tok = engine.tokenizer
    ids = tok.encode(TEXT)
    deltas = generate(engine, ids, SamplingParams(max_tokens=len(ids), stop=("zebra", "ro!")))
    assert "".join(d.new_text for d in deltas) == tok.decode(ids)
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert [t for d in deltas for t in d.new_token_ids] == ids


def test_eos_ends_the_request_and_adds_no_text(engine):
    tok = engine.tokenizer
    eos = tok.token_to_id("<|eos|>")        # by name, not the engine's own eos_token_id
    ids = tok.encode(TEXT)[:6]
    deltas = generate(engine, ids + [eos] + ids, SamplingParams(max_tokens=20))
    assert deltas[-1].finish_reason is FinishReason.EOS
    assert [t for d in deltas for t in d.new_token_ids] == ids + [eos]
    assert deltas[-1].new_token_ids == (eos,) and deltas[-1].new_text == ""
    assert "".join(d.new_text for d in deltas) == tok.decode(ids)
    assert deltas[-1].usage.completion_tokens == len(ids) + 1


def test_ignore_eos_generates_past_eos_until_max_tokens(engine):
    tok = engine.tokenizer
    eos = tok.token_to_id("<|eos|>")
    ids = tok.encode(TEXT)[:6]
    deltas = generate(engine, ids + [eos] + ids, SamplingParams(max_tokens=10, ignore_eos=True))
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert [t for d in deltas for t in d.new_token_ids] == (ids + [eos] + ids)[:10]


def test_stop_token_id_ends_with_stop_and_adds_no_text(engine):
    tok = engine.tokenizer
    ids = tok.encode(TEXT)
    stop_token = ids[7]
    deltas = generate(engine, ids, SamplingParams(max_tokens=len(ids), stop_token_ids=(stop_token,)))
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert [t for d in deltas for t in d.new_token_ids] == ids[:ids.index(stop_token) + 1]
    assert "".join(d.new_text for d in deltas) == tok.decode(ids[:ids.index(stop_token)])


def test_prompt_plus_max_tokens_reaching_max_model_len_ends_with_length(engine):
    tok = engine.tokenizer
    prompt = tok.encode(PROMPT_TEXT)
    room = MAX_MODEL_LEN - len(prompt)
    ids = (tok.encode(TEXT) * 3)[:room]
    deltas = generate(engine, ids, SamplingParams(max_tokens=room), prompt=prompt)
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert [t for d in deltas for t in d.new_token_ids] == ids
    assert deltas[-1].usage.prompt_tokens + deltas[-1].usage.completion_tokens == MAX_MODEL_LEN


def test_max_model_len_ends_a_request_whose_max_tokens_reach_further(engine):
    """The max_model_len rule on its own: validation is loosened so max_tokens reaches past max_model_len,
    and the engine must still end the request with LENGTH at max_model_len (never ask for a page beyond)."""
    tok = engine.tokenizer
    prompt = tok.encode(PROMPT_TEXT)
    ids = (tok.encode(TEXT) * 3)[:MAX_MODEL_LEN]
    strict = engine.limits
    engine.limits = dataclasses.replace(strict, max_model_len=4 * MAX_MODEL_LEN)
    try:
        deltas = generate(engine, ids, SamplingParams(max_tokens=2 * MAX_MODEL_LEN), prompt=prompt)
    finally:
        engine.limits = strict
    assert deltas[-1].finish_reason is FinishReason.LENGTH and deltas[-1].error is None
    assert [t for d in deltas for t in d.new_token_ids] == ids[:MAX_MODEL_LEN - len(prompt)]

