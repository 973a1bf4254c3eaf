"""The tool-call grammar (tool_choice required / named), run by llguidance on the tiny tokenizer: what the formats
write for valid calls is accepted; a wrong name, a missing required argument or a mistyped one is refused; and a
"model" that picks random allowed tokens always ends with calls the parsers read back, valid under the schema."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from appliance.core import tokenizer as tokenizer_module
from appliance.core.tokenizer import Tokenizer
from appliance.serve.chat_output import ChatOutputParser
from appliance.serve.dsv4_chat import dsml_tool_calls
from appliance.serve.reasoning import DSV4_REASONING, QWEN3_REASONING
from appliance.serve.tool_grammar import marker_tokens, tool_call_grammar
from appliance.serve.tool_parsers import DSML_TOOL_CALLS, QWEN3_TOOL_CALLS

llguidance = pytest.importorskip("llguidance")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                     "note": {"type": "string"},
                                     "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
DSV4_CHAT_PROMPT = "<｜User｜>x<｜Assistant｜></think>"
DSV4_THINKING_PROMPT = "<｜User｜>x<｜Assistant｜><think>"
QWEN3_PROMPT = "<|im_start|>assistant\n"
QWEN3_NO_THINK = QWEN3_PROMPT + "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module", params=["markers as tokens", "markers as text"])
def tokenizer(request):
    """The tiny tokenizer (each marker one token: a special token to llguidance), and one without those tokens."""
    if request.param == "markers as text":
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tokenizer_module, "CHAT_TOKENS", ())
            tok = Tokenizer.build(512)
        assert tok.token_to_id("<think>") is None
    else:
        tok = Tokenizer.build(512)
    return tok, llguidance.LLTokenizer(tok.tk.to_str(), n_vocab=512, eos_token=tok.eos_token_id)


def grammar(tokenizer, fmt, tools, **kwargs) -> str:
    tok, _ = tokenizer
    specials = marker_tokens(fmt, kwargs["reasoning"], tok.token_to_id)
    return tool_call_grammar(fmt, tools, specials=specials, **kwargs)


def matcher(tokenizer, grammar: str):
    _, ll = tokenizer
    m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not m.is_error(), m.get_error()
    return m


def accepts(tokenizer, grammar: str, text: str) -> bool:
    tok, _ = tokenizer
    m = matcher(tokenizer, grammar)
    return all(m.consume_token(t) for t in tok.encode(text)) and m.is_accepting()


def dsml(calls) -> str:
    return "\n\n" + dsml_tool_calls([{"function": {"name": n, "arguments": a}} for n, a in calls])


def qwen3(calls) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, separators=(',', ':'))}\n</tool_call>"
                     for n, a in calls)


GOOD = [("get_weather", {"city": "Paris", "days": 3, "note": "any <b> text\nhere", "unit": "C"}),
        ("get_time", {})]


@pytest.mark.parametrize("fmt, write, prompt, reasoning", [
    (DSML_TOOL_CALLS, dsml, DSV4_CHAT_PROMPT, DSV4_REASONING),
    (QWEN3_TOOL_CALLS, qwen3, QWEN3_NO_THINK, QWEN3_REASONING)], ids=["dsml", "qwen3"])
def test_valid_calls_are_accepted_and_invalid_ones_refused(tokenizer, fmt, write, prompt, reasoning):
    required = grammar(tokenizer, fmt, TOOLS, single=False, reasoning=reasoning, prompt=prompt)
    named = grammar(tokenizer, fmt, [WEATHER], single=True, reasoning=reasoning, prompt=prompt)
    assert accepts(tokenizer, required, write(GOOD))
    assert accepts(tokenizer, required, write(GOOD[1:]))
    assert accepts(tokenizer, named, write(GOOD[:1]))
    assert not accepts(tokenizer, named, write(GOOD))                                # one call only
    assert not accepts(tokenizer, named, write(GOOD[1:]))                            # another function
    assert not accepts(tokenizer, required, write([("get_weather", {"city": "Paris"})]))         # days missing
    assert not accepts(tokenizer, required, write([("get_weather", {"city": "Paris", "days": "3"})]))  # mistyped
    assert not accepts(tokenizer, required, write([("get_weather", {"city": "Paris", "days": 3, "unit": "K"})]))
    assert not accepts(tokenizer, required, "Sure! " + write(GOOD))                 # nothing but calls


def test_a_dsml_string_value_may_be_written_as_json(tokenizer):
    required = grammar(tokenizer, DSML_TOOL_CALLS, TOOLS, single=False, reasoning=DSV4_REASONING,
                       prompt=DSV4_CHAT_PROMPT)
    text = dsml([("get_weather", {"city": "Paris", "days": 3, "note": "<b>bold</b>"})])
    as_json = text.replace('string="true">&lt;b>bold&lt;/b>'.replace("&lt;", "<"), 'string="false">"<b>bold</b>"')
    assert as_json != text and accepts(tokenizer, required, as_json)


def test_reasoning_comes_first_where_the_prompt_opens_it(tokenizer):
    thinking = grammar(tokenizer, DSML_TOOL_CALLS, TOOLS, single=False, reasoning=DSV4_REASONING,
                                 prompt=DSV4_THINKING_PROMPT)
    assert accepts(tokenizer, thinking, "Weather <i>needed</i>, call it.</think>" + dsml(GOOD[1:]))
    assert not accepts(tokenizer, thinking, dsml(GOOD[1:]))
    qwen_thinking = grammar(tokenizer, QWEN3_TOOL_CALLS, TOOLS, single=True, reasoning=QWEN3_REASONING,
                                      prompt=QWEN3_PROMPT)
    assert accepts(tokenizer, qwen_thinking, "<think>\nhmm\n</think>\n\n" + qwen3(GOOD[1:]))
    assert accepts(tokenizer, qwen_thinking, qwen3(GOOD[1:]))
    no_think = grammar(tokenizer, QWEN3_TOOL_CALLS, TOOLS, single=True, reasoning=QWEN3_REASONING,
                       prompt=QWEN3_NO_THINK)
    assert not accepts(tokenizer, no_think, "<think>\nhmm\n</think>\n\n" + qwen3(GOOD[1:]))


def random_answer(tokenizer, grammar: str, seed: int, max_tokens: int = 400) -> tuple[str, bool]:
    """A "model" sampling uniformly among the tokens the grammar allows (EOS when it may stop, then it stops)."""
    tok, ll = tokenizer
    m = matcher(tokenizer, grammar)
    rng = random.Random(seed)
    ids: list[int] = []
    for _ in range(max_tokens):
        if m.is_stopped():
            break
        mask = m.compute_bitmask()
        allowed = [t for t in range(512) if mask[t // 8] >> (t % 8) & 1]
        token = rng.choice(allowed)
        if token == tok.eos_token_id:
            break
        assert m.consume_token(token)
        ids.append(token)
    return tok.decode(ids), m.is_accepting()


@pytest.mark.parametrize("fmt, prompt, reasoning", [
    (DSML_TOOL_CALLS, DSV4_CHAT_PROMPT, DSV4_REASONING),
    (QWEN3_TOOL_CALLS, QWEN3_NO_THINK, QWEN3_REASONING)], ids=["dsml", "qwen3"])
def test_any_model_under_the_grammar_makes_valid_calls(tokenizer, fmt, prompt, reasoning):
    schema = dict(WEATHER["function"]["parameters"])
    schema["properties"] = {k: v for k, v in schema["properties"].items() if k != "note"}   # free text: unbounded
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": schema}}
    forced = grammar(tokenizer, fmt, [tool], single=True, reasoning=reasoning, prompt=prompt)
    for seed in range(8):
        text, complete = random_answer(tokenizer, forced, seed)
        assert complete, text
        parser = ChatOutputParser(prompt, reasoning, fmt)
        parser.feed(text)
        parser.finish()
        message = parser.message.body()
        assert message["content"] is None and len(message["tool_calls"]) == 1, text
        call = message["tool_calls"][0]["function"]
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), schema)
