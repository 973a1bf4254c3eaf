"""No constraint can crash the process, hang the loop or stall the other streams (appliance/engine/grammar.py):
compiles run on a large-stack thread under a time bound, a grammar that matches nothing or whose mask costs over
the budget is refused at submit, and at run time a row whose mask is over the budget, stuck, or stopped by the
library's limits ends its own request with an error naming its field while the others go on."""

from __future__ import annotations

import threading

import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import models, pre_tokenizers

import appliance.engine.grammar as grammar
from appliance.config.compose import load_runtime_config
from appliance.core.constraint import OutputConstraint
from appliance.core.request import FinishReason, RequestError, SamplingParams
from appliance.core.tokenizer import Tokenizer
from appliance.engine.engine import Engine
from appliance.engine.grammar import COMPILE_THREADS, GrammarCompiler
from tests.core.test_grammar_bounds import rule_chain

LITERAL = "x" * 200_000      # a forced literal: every mask walks it (tens of ms), far over a 1 ms budget
SIX_HUNDRED_OPTIONAL = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.build(512)


@pytest.fixture(scope="module")
def engine():
    engine = Engine(load_runtime_config(["+model=qwen3_tiny", "device=cpu", "max_model_len=128", "max_num_seqs=4"]))
    engine.start()
    yield engine
    engine.shutdown()


def refusal(compiler: GrammarCompiler, constraint: OutputConstraint) -> str:
    with pytest.raises(RequestError) as info:
        compiler.matcher(constraint)
    assert info.value.field == constraint.field
    return str(info.value)


def test_a_rule_chain_too_deep_for_a_default_thread_stack_compiles(tokenizer):
    """5,000 nested rules need ~15 MiB of stack (8 MiB overflowed at ~2,700: SIGSEGV). The bounds refuse such a
    grammar at submit; compiled anyway, it compiles on the large-stack thread."""
    compiler = GrammarCompiler(tokenizer, 512)
    matcher = compiler.matcher(OutputConstraint.grammar(rule_chain(5000)))
    assert matcher.accept(tokenizer.encode("x")[0]) and matcher.terminated
    matcher.close()


def test_a_compile_past_its_time_bound_is_refused_naming_the_field(tokenizer):
    compiler = GrammarCompiler(tokenizer, 512, compile_timeout_s=0.05)
    release = threading.Event()
    busy = [compiler.compile_threads.submit(lambda: release.wait(60)) for _ in range(COMPILE_THREADS)]
    try:
        message = refusal(compiler, OutputConstraint.regex("[a-z]+"))
    finally:
        release.set()
    assert message == ("structured_outputs.regex: did not compile within 0.05 s (the grammar is too complex, or the "
                       "server is compiling many others)")
    assert all(task.result(10) for task in busy) and compiler.num_live == 0
    compiler.matcher(OutputConstraint.regex("[a-z]+")).close()         # the threads compile again


def test_a_schema_that_only_refers_to_itself_matches_no_output(tokenizer):
    compiler = GrammarCompiler(tokenizer, 512)
    for schema in ({"$ref": "#"}, {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}):
        assert "matches no output" in refusal(compiler, OutputConstraint.json_schema(schema))


def test_a_mask_over_the_budget_is_refused_at_submit(tokenizer):
    compiler = GrammarCompiler(tokenizer, 512, mask_budget_s=0.001)
    message = refusal(compiler, OutputConstraint.grammar(f'start: "{LITERAL}"'))
    assert "ms of CPU to compute one token mask; at most 1 ms" in message
    assert compiler.num_live == 0


def test_masks_done_before_a_long_step_ends_are_used_however_long_it_took(tokenizer):
    """The wait bound counts from when the fills began (before the model step): a step longer than it must not
    refuse masks that were done in time."""
    compiler = GrammarCompiler(tokenizer, 512)
    matchers = [compiler.matcher(OutputConstraint.regex("[a-z]{3}")) for _ in range(3)]
    fill = compiler.start_fill(matchers)
    assert all(task.result(10) for task in fill.tasks)
    fill.began -= 10 * compiler.mask_wait_s                   # as if the model step had taken that long
    bitmask, refused = fill.result()
    assert refused == {} and bitmask.shape == (3, 16) and (bitmask != -1).all()
    for matcher in matchers:
        matcher.close()


def test_refusals_are_short_without_the_grammar(tokenizer):
    """The library quotes the grammar around a fault: the message keeps its first line, cut to 200 characters."""
    compiler = GrammarCompiler(tokenizer, 512)
    message = refusal(compiler, OutputConstraint.regex("a(" + "b" * 100_000))
    assert message.startswith("structured_outputs.regex: is refused by the grammar compiler:") and len(message) < 300


def test_a_tokenizer_the_library_cannot_read_refuses_structured_output():
    """A word-level tokenizer.json has no decoder (bench/make_tiny_qwen3.py writes one): llguidance cannot map its
    tokens to bytes. Every constrained request is refused naming its field; nothing else is affected."""
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"t{i}": i for i in range(2, 64)}}
    word_level = HfTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    compiler = GrammarCompiler(Tokenizer(word_level, eos_token_id=0, source="word-level"), 64)
    for constraint in (OutputConstraint.json_object(), OutputConstraint.regex("t[0-9]")):
        assert refusal(compiler, constraint) == (
            f"{constraint.field}: structured output is unavailable for this model: the grammar library cannot read "
            f"its tokenizer (word-level: can't determine decoder type: None)")


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    handles = {rid: engine.submit(rid, prompt, params) for rid, (prompt, params) in requests.items()}
    return {rid: list(handle) for rid, handle in handles.items()}


def assert_refused(outputs: list, field: str, *words: str) -> None:
    last = outputs[-1]
    assert last.finish_reason is FinishReason.ABORTED and last.error_field == field, last
    assert len(last.error) < 300 and all(w in last.error for w in words), last.error


def test_a_grammar_the_library_gives_up_on_ends_its_request_naming_the_field(engine):
    """600 optional properties: llguidance's row limit (2,000 items) stops the parser after the first token. The
    request ends with the library's reason (no grammar, no parser state), not as an engine failure."""
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    constraint = OutputConstraint.json_schema(SIX_HUNDRED_OPTIONAL)
    out = run(engine, {"bad": ([5, 6, 7], SamplingParams(max_tokens=20, constraint=constraint)),
                       "plain": ([8, 9, 10], plain)})
    assert_refused(out["bad"], constraint.field, "stopped it at output token 1", "Current row has 2407 items")
    assert sum(len(o.new_token_ids) for o in out["plain"]) == 12 and out["plain"][-1].error is None
    assert engine.grammars.num_live == 0 and engine.num_in_flight() == 0


def test_a_mask_over_the_budget_at_run_time_ends_its_request(engine, monkeypatch):
    """A grammar cheap at its start and costly after the first token (the literal is forced from then on) passes
    the submit check; its first costly mask ends it, and the step goes on for the others."""
    monkeypatch.setattr(engine.grammars, "mask_budget_s", 0.001)
    constraint = OutputConstraint.grammar(f'start: /[a-z]/ "{LITERAL}"')
    out = run(engine, {"late": ([5, 6, 7], SamplingParams(max_tokens=20, constraint=constraint)),
                       "plain": ([8, 9, 10], SamplingParams(max_tokens=12, ignore_eos=True))})
    assert_refused(out["late"], "structured_outputs.grammar", "its token mask took", "ms of CPU; at most 1 ms")
    assert sum(len(o.new_token_ids) for o in out["late"]) == 1              # the one token before the literal
    assert sum(len(o.new_token_ids) for o in out["plain"]) == 12
    assert engine.grammars.num_live == 0


def test_a_stuck_mask_is_abandoned_after_the_wait_and_the_loop_goes_on(engine, monkeypatch):
    """A mask that never finishes (held here) costs the loop mask_wait_s once: its request ends naming its field,
    an unconstrained request beside it and a constrained one after it complete."""
    monkeypatch.setattr(engine.grammars, "mask_wait_s", 0.2)
    release, fill_row = threading.Event(), grammar.fill_row
    stuck = OutputConstraint.regex("[a-z]{30}")

    def held_fill(matcher, bitmask, row, clocks):
        if matcher.compiler is engine.grammars and getattr(matcher, "stuck", False):
            release.wait(60)                                    # (waiting takes no CPU: only the wait bound ends it)
        return fill_row(matcher, bitmask, row, clocks)
    monkeypatch.setattr(grammar, "fill_row", held_fill)
    submit = engine.grammar_compiler().matcher

    def marked(constraint):
        matcher = submit(constraint)
        matcher.stuck = constraint is stuck
        return matcher
    monkeypatch.setattr(engine.grammars, "matcher", marked)
    try:
        out = run(engine, {"stuck": ([5, 6, 7], SamplingParams(max_tokens=20, constraint=stuck)),
                           "plain": ([8, 9, 10], SamplingParams(max_tokens=12, ignore_eos=True))})
        after = run(engine, {"after": ([11, 12], SamplingParams(max_tokens=40,
                                                                  constraint=OutputConstraint.regex("[a-z]{3}")))})
    finally:
        release.set()
    assert_refused(out["stuck"], "structured_outputs.regex", "was not computed within 0.2 s")
    assert sum(len(o.new_token_ids) for o in out["plain"]) == 12
    assert after["after"][-1].finish_reason is FinishReason.STOP and after["after"][-1].error is None
    kv = engine.kv_cache_manager
    assert all(kv.num_free_blocks(g.name) == kv.num_total_blocks(g.name) for g in engine.rc.model.cache_groups)
