"""The complexity bounds a constraint meets before it is compiled (appliance/core/grammar_bounds.py), and JSON read
within bounds (appliance/core/bounded_json.py): each bound accepted exactly at its value and refused one past it,
naming the request field and the bound; the inputs of issue 32 that crashed or stalled the server are refused."""

from __future__ import annotations

import json

import pytest

from appliance.core import bounded_json
from appliance.core.constraint import OutputConstraint
from appliance.core.grammar_bounds import (
    MAX_GRAMMAR_RULES,
    MAX_JSON_NESTING,
    MAX_REPETITION_PRODUCT,
    MAX_SCHEMA_DEPTH,
    repetition_product,
    schema_depth,
)
from appliance.core.request import RequestError, RequestLimits, SamplingParams, validate_request

LIMITS = RequestLimits(vocab_size=512, max_model_len=64, max_token_bytes=8)


def refusal(constraint: OutputConstraint) -> str | None:
    """validate_request's refusal of the constraint (its field checked), or None when it passes."""
    try:
        validate_request("r", [5, 6], SamplingParams(constraint=constraint), LIMITS, lambda text: [])
    except RequestError as exc:
        assert exc.field == constraint.field
        return str(exc)
    return None


def rule_chain(n: int) -> str:
    """`start` then n rules, each naming the next: n + 1 definitions."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n - 1)) + f'r{n - 1}: "x"\n'


def ref_chain(n: int) -> dict:
    """A schema whose $defs chain a0 -> a1 -> ... by $ref, n links."""
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)}
    return {"$ref": "#/$defs/a0", "$defs": {**defs, f"a{n}": {"type": "string"}}}


@pytest.mark.parametrize("regex, product", [
    ("a{500}{500}", 250_000), ("(a{100}){100}", 10_000), ("a{100}b{100}", 100), ("(ab){20000}", 20_000),
    (r"\d{4}-\d{2}", 4), ("[a-z]{1,5}(x{3}){2}", 6), (r"[\]a{5}]{3}", 3), ("(?i)a{5}", 5), ("(?:a{10}){10}", 100),
    ("(?P<n>a{10}){10}", 100), (r"\p{L}{10}", 10), ("x{3,}", 3), ("a{2,7}", 7), ("{", 1), ("(a", 1),
    ("a{" + "9" * 5000 + "}", 10**10),                   # a count of 5,000 digits is refused, not parsed
])
def test_repetition_product_multiplies_nested_counts(regex, product):
    assert repetition_product(regex) == product


def test_issue_32_inputs_are_refused_naming_field_and_bound():
    assert refusal(OutputConstraint.grammar(rule_chain(3001))) == \
        f"structured_outputs.grammar: defines 3,002 rules and terminals; at most {MAX_GRAMMAR_RULES:,}"
    assert refusal(OutputConstraint.json_schema(ref_chain(3000))) == \
        (f"response_format.json_schema.schema: nests schemas 3,003 deep following $ref; at most "
         f"{MAX_SCHEMA_DEPTH:,}")
    assert refusal(OutputConstraint.regex("a{500}{500}")) == \
        (f"structured_outputs.regex: the regex repeats 250,000 times counting nested repetitions ({{m,n}}); at most "
         f"{MAX_REPETITION_PRODUCT:,}")
    deep = OutputConstraint.json_schema("[" * 100_000 + "]" * 100_000, field="structured_outputs.json")
    assert refusal(deep) == "structured_outputs.json: nests JSON arrays and objects 100,000 deep; at most 128"
    assert "is not valid JSON" in refusal(OutputConstraint.json_schema('{"a": ' + "7" * 5000 + "}"))


def test_each_bound_is_accepted_at_its_value_and_refused_one_past_it():
    assert refusal(OutputConstraint.grammar(rule_chain(MAX_GRAMMAR_RULES - 1))) is None
    assert "defines 2,001 rules" in refusal(OutputConstraint.grammar(rule_chain(MAX_GRAMMAR_RULES)))
    at = MAX_SCHEMA_DEPTH - 3          # ref_chain(n) nests n + 3 deep: the root, $defs, n links, the last schema
    assert schema_depth(ref_chain(at)) == MAX_SCHEMA_DEPTH
    assert refusal(OutputConstraint.json_schema(ref_chain(at))) is None
    assert "1,001 deep" in refusal(OutputConstraint.json_schema(ref_chain(at + 1)))
    assert refusal(OutputConstraint.regex(f"a{{{MAX_REPETITION_PRODUCT}}}")) is None
    assert "10,001 times" in refusal(OutputConstraint.regex(f"a{{{MAX_REPETITION_PRODUCT + 1}}}"))
    nested = "[" * MAX_JSON_NESTING + "]" * MAX_JSON_NESTING
    assert "nests" not in (refusal(OutputConstraint.json_schema('{"enum": [%s]}' % nested[2:-2])) or "")
    assert "129 deep" in refusal(OutputConstraint.json_schema('{"enum": [%s]}' % nested[1:-1]))


def test_a_recursive_schema_is_not_deep_and_a_self_reference_adds_nothing():
    tree = {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}
    assert schema_depth(tree) == 4 and refusal(OutputConstraint.json_schema(tree)) is None
    assert schema_depth({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}) == 3


def test_bounds_reach_inside_grammars_and_schemas():
    """A Lark grammar's regex terminals, counted rule repetitions and embedded %json schemas; a schema's patterns."""
    terminal = OutputConstraint.grammar("start: /a{200}{200}/")
    assert "the terminal /a{200}{200}/ repeats 40,000 times" in refusal(terminal)
    assert "repeats 250,000 times" in refusal(OutputConstraint.grammar('start: ("a"{500}){500}'))
    assert "repeats 20,000 times" in refusal(OutputConstraint.grammar('start: ("a" ~ 100){200}'))
    embedded = 'start: "<" item ">"\nitem: %json ' + json.dumps(ref_chain(2000))
    assert "%json at character 26: nests schemas 2,003 deep" in refusal(OutputConstraint.grammar(embedded))
    pattern = OutputConstraint.json_schema({"properties": {"code": {"type": "string", "pattern": "[0-9]{100}{200}"}}})
    assert "the pattern at properties.code.pattern repeats 20,000 times" in refusal(pattern)
    # Text in strings, regexes and comments is no definition; a `%json` block spanning lines is one value.
    quiet = 'start: "a: b" /c: d/ x  // e: f\nx: %json {\n"type": "integer"\n}\n'
    assert refusal(OutputConstraint.grammar(quiet)) is None


@pytest.mark.parametrize("text, message", [
    ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "arrays and objects nested more than 64 deep: line 1 column 70"),
    ('{"a": ' + "7" * 5000 + "}", "a number of 5,000 digits in a row (at most 100): line 1 column 7"),
], ids=["nested", "digits"])
def test_bounded_json_refuses_deep_nesting_and_long_numbers_with_their_position(text, message):
    with pytest.raises(json.JSONDecodeError) as info:
        bounded_json.loads(text)
    assert str(info.value).startswith(message)


def test_bounded_json_reads_what_json_reads_within_the_bounds():
    text = json.dumps({"model_max_length": 1000000000000000019884624838656, "a": [[["[{x"]]], "b": -1.5e300})
    assert bounded_json.loads(text) == json.loads(text)
