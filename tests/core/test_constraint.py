"""Structured-output constraints (appliance/core/constraint.py): each kind becomes an llguidance grammar that
accepts exactly what it should, and a bad one is refused by validate_request naming the field it came from (what
only the grammar compiler can tell is refused by the engine's compile: tests/engine/test_grammar_limits.py)."""

from __future__ import annotations

import json

import llguidance
import pytest

from appliance.core.constraint import MAX_CHOICES, MAX_CONSTRAINT_CHARS, OutputConstraint, constraint_grammar
from appliance.core.request import RequestError, RequestLimits, SamplingParams, validate_request
from appliance.core.tokenizer import Tokenizer

LIMITS = RequestLimits(vocab_size=512, max_model_len=64, max_token_bytes=8)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.build(512)


def matches(constraint: OutputConstraint, text: str, tokenizer: Tokenizer) -> bool:
    """Whether the grammar takes `text` (tokenized by the model's tokenizer) as a complete output."""
    ll = llguidance.LLTokenizer(tokenizer.tk.to_str(), n_vocab=512, eos_token=tokenizer.eos_token_id)
    matcher = llguidance.LLMatcher(ll, constraint_grammar(constraint), log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()


@pytest.mark.parametrize("constraint, text, expected", [
    (OutputConstraint.choice(["yes", 'a "quoted" \\ tab\there', "\u00fcber"]), 'a "quoted" \\ tab\there', True),
    (OutputConstraint.choice(["yes", "no"]), "yes", True),
    (OutputConstraint.choice(["yes", "no"]), "yesno", False),
    (OutputConstraint.choice(["yes", "no"]), "maybe", False),
    (OutputConstraint.choice(["tab\there"]), "tab\\there", False),      # the escape is the tab, not backslash-t
    (OutputConstraint.regex(r"[a-z]{3}-[0-9]{2}"), "abc-12", True),
    (OutputConstraint.regex(r"[a-z]{3}-[0-9]{2}"), "abc-123", False),
    (OutputConstraint.json_object(), '{"a":[1,{"b":null}]}', True),
    (OutputConstraint.json_object(), "[1]", False),
    (OutputConstraint.json_schema({"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                                   "required": ["kind"], "additionalProperties": False}), '{"kind":"dog"}', True),
    (OutputConstraint.json_schema({"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                                   "required": ["kind"], "additionalProperties": False}), '{"kind":"cow"}', False),
    (OutputConstraint.grammar('start: "<" item ">"\nitem: %json {"type": "integer"}'), "<42>", True),
    (OutputConstraint.grammar('start: "<" item ">"\nitem: %json {"type": "integer"}'), "<4.5>", False),
])
def test_each_kind_accepts_exactly_its_language(constraint, text, expected, tokenizer):
    assert matches(constraint, text, tokenizer) is expected


def test_a_schema_given_as_text_equals_one_given_as_a_dict():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert OutputConstraint.json_schema(json.dumps(schema)).text == OutputConstraint.json_schema(schema).text


@pytest.mark.parametrize("constraint, field", [
    (OutputConstraint.regex(""), "structured_outputs.regex"),
    (OutputConstraint.json_schema("[1, 2]", field="structured_outputs.json"), "structured_outputs.json"),
    (OutputConstraint.json_schema("{not json", field="structured_outputs.json"), "structured_outputs.json"),
    (OutputConstraint.choice([]), "structured_outputs.choice"),
    (OutputConstraint.choice(["a", ""]), "structured_outputs.choice"),
    (OutputConstraint.choice([str(i) for i in range(MAX_CHOICES + 1)]), "structured_outputs.choice"),
    (OutputConstraint.regex("a" * (MAX_CONSTRAINT_CHARS + 1)), "structured_outputs.regex"),
    (OutputConstraint.regex("a\ud800"), "structured_outputs.regex"),
    (OutputConstraint.choice(["ok", "\udfff"]), "structured_outputs.choice"),
    (OutputConstraint.json_schema({"enum": ["\ud800"]}), "response_format.json_schema.schema"),
    (OutputConstraint.grammar('start: "\ud800"'), "structured_outputs.grammar"),
])
def test_a_bad_constraint_is_refused_naming_its_field(constraint, field):
    with pytest.raises(RequestError) as info:
        validate_request("r", "a prompt", SamplingParams(constraint=constraint), LIMITS, lambda text: [5, 6])
    assert info.value.field == field


def test_a_good_constraint_passes_validate_request():
    params = SamplingParams(constraint=OutputConstraint.regex("[ab]+"))
    assert validate_request("r", [5, 6], params, LIMITS, lambda text: []) == [5, 6]
