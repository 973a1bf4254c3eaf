"""Structured output in the engine (appliance/engine/grammar.py, core.py, scheduler.py): constrained requests produce only what
their grammar allows and finish with stop when it is complete; unconstrained requests beside them keep their
greedy tokens; a matcher survives preemption and is freed when its request finishes or is aborted."""

from __future__ import annotations

import json
import random
import re
import threading

import pytest
import torch

import appliance.engine.engine as engine_module
from appliance.config.compose import load_runtime_config
from appliance.core.constraint import OutputConstraint
from appliance.core.request import FinishReason, RequestError, SamplingParams
from appliance.core.tokenizer import Tokenizer
from appliance.engine.grammar import GrammarCompiler
from appliance.offline import Appliance
from npu.sampler import forbidden_tokens
from tests.engine.instrumented import HookedEngine
from tests.engine.test_loop_partitions import PartitionedScriptedRunner

MODELS = {
    "qwen3_tiny": ["+model=qwen3_tiny", "device=cpu", "max_model_len=256"],
    "dsv4_tiny": ["+model=dsv4_tiny", "device=cpu", "max_model_len=256"],
}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "kind": {"enum": ["cat", "dog", "bird"]},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"type": "object", "additionalProperties": False, "required": ["n"],
                                            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}}}}
REGEX = r"[a-z]{2,5}-[0-9]{2}"
CHOICES = ["sunny", "light rain", "cold and bright"]


def prompts(n, lo, hi, seed=0, vocab=512):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def constrained(constraint, temperature=0.0, seed=None, max_tokens=96):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, constraint=constraint)


def schema_valid(value) -> bool:
    """SCHEMA checked by hand (an independent reading of it, not the grammar library)."""
    return (isinstance(value, dict) and set(value) == {"name", "kind", "tags"} and isinstance(value["name"], str)
            and len(value["name"]) <= 6 and value["kind"] in ("cat", "dog", "bird")
            and isinstance(value["tags"], list) and len(value["tags"]) <= 2
            and all(isinstance(t, dict) and set(t) == {"n"} and type(t["n"]) is int and 0 <= t["n"] <= 99
                    for t in value["tags"]))


@pytest.fixture(scope="module", params=list(MODELS))
def app(request):
    with Appliance.from_config(MODELS[request.param] + ["max_num_seqs=8"]) as a:
        yield a


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_yields_output_its_grammar_accepts(app, temperature):
    batch = prompts(3, 4, 30, seed=2)
    params = [constrained(OutputConstraint.json_schema(SCHEMA), temperature, seed=11),
              constrained(OutputConstraint.regex(REGEX), temperature, seed=12),
              constrained(OutputConstraint.choice(CHOICES), temperature, seed=13)]
    schema_out, regex_out, choice_out = app.generate(batch, params)
    assert all(r.finish_reason is FinishReason.STOP for r in (schema_out, regex_out, choice_out))
    assert schema_valid(json.loads(schema_out.text)), schema_out.text
    assert re.fullmatch(REGEX, regex_out.text), regex_out.text
    assert choice_out.text in CHOICES
    assert app.engine.grammars.num_live == 0


def test_unconstrained_rows_keep_their_greedy_tokens_beside_constrained_ones(app):
    plain = prompts(4, 3, 40, seed=3)
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    alone = [r.token_ids for r in app.generate(plain, greedy)]
    mixed_prompts = plain + prompts(3, 3, 40, seed=4)
    mixed_params = [greedy] * 4 + [constrained(OutputConstraint.json_schema(SCHEMA)),
                                   constrained(OutputConstraint.regex(REGEX), temperature=1.0, seed=5),
                                   constrained(OutputConstraint.choice(CHOICES))]
    together = app.generate(mixed_prompts, mixed_params)
    assert [r.token_ids for r in together[:4]] == alone


def test_greedy_logprobs_are_of_the_masked_distribution(app):
    """The chosen token is the most likely one the grammar allows, and its logprob is of the masked logits, as
    vLLM reports (the bitmask is applied before logprobs are taken): every listed candidate is allowed."""
    params = SamplingParams(max_tokens=8, logprobs=5, constraint=OutputConstraint.choice(CHOICES))
    out = app.generate(prompts(1, 5, 10, seed=6), params)[0]
    assert out.text in CHOICES
    first = out.logprobs[0]
    assert first.rank == 1
    listed = [app.engine.tokenizer.decode([t]) for t, v in first.top if v > float("-inf")]
    assert listed and all(any(c.startswith(piece) for c in CHOICES) for piece in listed), listed
    assert len(first.top) == 5 and all(v == float("-inf") for _, v in first.top[len(listed):])


def test_an_aborted_request_frees_its_matcher(app):
    engine = app.engine
    started = threading.Event()
    handle = engine.submit("structured-abort", prompts(1, 5, 10, seed=7)[0],
                           constrained(OutputConstraint.grammar('start: "x" /[a-z]+/'), max_tokens=200),
                           on_output=lambda out: started.set())
    assert engine.grammars.num_live >= 1
    assert started.wait(60)
    handle.abort()
    assert engine.grammars.num_live == 0 or _wait_until(lambda: engine.grammars.num_live == 0)
    assert handle.seq.matcher is None


def _wait_until(condition, timeout_s=60.0) -> bool:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        done.wait(0.01)
    return condition()


def test_a_refused_submit_frees_its_matcher(app):
    engine = app.engine
    params = constrained(OutputConstraint.regex(REGEX), max_tokens=200)
    first = engine.submit("structured-dup", prompts(1, 5, 10, seed=8)[0], params)
    with pytest.raises(RequestError):
        engine.submit("structured-dup", prompts(1, 5, 10, seed=8)[0], params)     # the id is in flight
    first.abort()
    assert _wait_until(lambda: engine.grammars.num_live == 0)


def run_all(app, batch, params):
    """Submit every prompt at once; (each request's output tokens and text, each one's Sequence) once all finish."""
    handles = [app.engine.submit(f"preempt-{i}", p, sp) for i, (p, sp) in enumerate(zip(batch, params))]
    outs = []
    for handle in handles:
        deltas = list(handle)
        outs.append(([t for d in deltas for t in d.new_token_ids], "".join(d.new_text for d in deltas),
                     deltas[-1].finish_reason))
    return outs, [h.seq for h in handles]


@pytest.mark.parametrize("model", list(MODELS))
def test_preemption_keeps_each_matchers_state(model):
    """Preempted sequences re-prefill their outputs; their matchers are not advanced again, so the outputs
    equal the unpreempted run's and still match the grammar."""
    batch = prompts(8, 20, 50, seed=9)
    regex = r"[a-z ]{40}\."
    params = [constrained(OutputConstraint.regex(regex), max_tokens=64) if i % 2 else
              SamplingParams(max_tokens=40, ignore_eos=True) for i in range(len(batch))]
    with Appliance.from_config(MODELS[model] + ["enable_prefix_caching=false"]) as a:
        reference, _ = run_all(a, batch, params)
    small = MODELS[model] + ["max_model_len=128", "max_num_seqs=16", "kv_cache.num_slots_override=2"]
    with Appliance.from_config(small) as a:
        results, seqs = run_all(a, batch, params)
        assert a.engine.grammars.num_live == 0
    assert any(seqs[i].num_preemptions for i in range(1, len(batch), 2))     # a constrained one was preempted
    assert [r[0] for r in results] == [r[0] for r in reference]
    for i in range(1, len(batch), 2):
        assert re.fullmatch(regex, results[i][1]) and results[i][2] is FinishReason.STOP


def test_eos_is_allowed_only_where_the_grammar_may_end():
    tokenizer = Tokenizer.build(512)
    compiler = GrammarCompiler(tokenizer, 512)
    matcher = compiler.matcher(OutputConstraint.regex("[a-z]{3,}"))
    eos = tokenizer.eos_token_id

    def eos_allowed() -> bool:
        bitmask = torch.from_numpy(compiler.fill_bitmask([matcher]))
        return not forbidden_tokens(bitmask, 512, torch.device("cpu"))[0, eos].item()

    assert not eos_allowed()
    for token in tokenizer.encode("ab"):
        assert matcher.accept(token)
    assert not eos_allowed() and not matcher.accepting
    assert matcher.accept(tokenizer.encode("c")[0])
    assert eos_allowed() and matcher.accepting and not matcher.terminated
    assert matcher.accept(eos) and matcher.terminated
    matcher.close()
    assert compiler.num_live == 0


def test_masks_land_on_their_own_rows_across_data_parallel_ranks(monkeypatch):
    """Two data-parallel ranks (one process stands for both, as in test_loop_partitions): the logits come back in
    rank order, and each constrained request's mask must fall on its own row. Every request follows a script; the
    constrained ones' scripts spell their one choice, so a mask on the wrong row would force an unconstrained
    request off its script (the scripted runner fails the step) or leave a constrained one unfinished."""
    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", "device.count=2", "max_model_len=64",
                              "parallel.data_parallel_size=2", "kv_cache.num_slots_override=4", "max_num_seqs=8",
                              "enable_prefix_caching=false"])
    runner = PartitionedScriptedRunner(rc.model)
    monkeypatch.setattr(engine_module, "start_ranks", lambda rc, backend, _runner: engine_module.launch(rc, backend))
    engine = HookedEngine(rc, runner)
    runner.engine = engine
    engine.start()
    try:
        words = ["sunny", "light rain", "frost", "cold"]
        handles = {}
        for i in range(8):
            rid, prompt = f"r{i}", [3 + i, 40 + i]
            if i % 2:
                word = words[i // 2]
                runner.script(rid, prompt, engine.tokenizer.encode(word))
                params = SamplingParams(max_tokens=12, constraint=OutputConstraint.choice([word]))
            else:
                runner.script(rid, prompt, [(50 + 7 * i + k) % 500 + 5 for k in range(6)])
                params = SamplingParams(max_tokens=6, ignore_eos=True)
            handles[rid] = (engine.submit(rid, prompt, params), params)
        for rid, (handle, params) in handles.items():
            deltas = list(handle)
            assert deltas[-1].error is None, deltas[-1]
            if params.constraint is not None:
                assert "".join(d.new_text for d in deltas) == params.constraint.choices[0]
                assert deltas[-1].finish_reason is FinishReason.STOP
            else:
                assert deltas[-1].finish_reason is FinishReason.LENGTH
        assert engine.grammars.num_live == 0
    finally:
        engine.shutdown()
    ranks = [{rid for rid, _ in batch} for step in runner.rank_batches for batch in step]
    assert set().union(*ranks[0::2]) and set().union(*ranks[1::2])          # requests on both ranks
