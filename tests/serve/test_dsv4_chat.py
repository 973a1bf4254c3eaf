"""DeepSeek V4's chat format: prompts written out by hand from DeepSeek's released encoder (encoding_dsv4, as vLLM
mirrors it in vllm/tokenizers/deepseek_v4_encoding.py) for thinking on and off, earlier reasoning dropped or kept,
tools, tool calls and tool results; and the model's format chosen for random-weight DeepSeek V4."""

from __future__ import annotations

import json

import pytest

from appliance.config.compose import load_runtime_config
from appliance.serve.chat_formats import load_chat_format
from appliance.serve.chat_template import ChatTemplateError
from appliance.serve.dsv4_chat import Dsv4ChatFormat
from appliance.serve.reasoning import DSV4_REASONING, QWEN3_REASONING
from appliance.serve.tool_parsers import DSML_TOOL_CALLS, QWEN3_TOOL_CALLS, ToolCallParser

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
        {"role": "user", "content": "2+2?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                                            "days": {"type": "integer"}}}}}
TOOL_CHAT = [{"role": "user", "content": "Paris and Rome?"},
             {"role": "assistant", "content": "", "reasoning_content": "Both cities.", "tool_calls": [
                 {"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                                    "arguments": {"city": "Paris", "days": 2}}},
                 {"id": "call_b", "type": "function", "function": {"name": "get_weather",
                                                                    "arguments": {"city": "Rome"}}}]},
             {"role": "tool", "tool_call_id": "call_b", "content": "12C"},
             {"role": "tool", "tool_call_id": "call_a", "content": "15C"}]


def render(messages, tools=None, **kwargs) -> str:
    return Dsv4ChatFormat().render(messages, tools=tools, **kwargs)


def test_chat_mode_closes_thinking_and_drops_reasoning():
    assert render(CHAT) == f"{B}Be brief.{U}hi{A}</think>Hello.{E}{U}2+2?{A}</think>"


@pytest.mark.parametrize("kwargs", [{"thinking": True}, {"enable_thinking": True}])
def test_thinking_mode_opens_thinking_and_drops_earlier_reasoning(kwargs):
    assert render(CHAT, **kwargs) == f"{B}Be brief.{U}hi{A}</think>Hello.{E}{U}2+2?{A}<think>"


def test_thinking_mode_keeps_reasoning_when_asked():
    assert render(CHAT, thinking=True, drop_thinking=False) == \
        f"{B}Be brief.{U}hi{A}<think>Greet back.</think>Hello.{E}{U}2+2?{A}<think>"


def test_max_reasoning_effort_leads_in_thinking_mode_only():
    assert render(CHAT, thinking=True, reasoning_effort="max").startswith(B + "Reasoning Effort: Absolute maximum")
    assert render(CHAT, reasoning_effort="max") == render(CHAT)


def test_tools_calls_and_results_render_as_released():
    prompt = render(TOOL_CHAT, tools=[WEATHER], thinking=True)
    schema = json.dumps(WEATHER["function"], ensure_ascii=False)
    system, rest = prompt.split(U, 1)
    assert system.startswith(B + "\n\n## Tools\n\nYou have access to a set of tools")
    assert f"### Available Tool Schemas\n\n{schema}\n\nYou MUST strictly follow" in system
    calls = ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
             "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
             "<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
             "<｜DSML｜invoke name=\"get_weather\">\n"
             "<｜DSML｜parameter name=\"city\" string=\"true\">Rome</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
             "</｜DSML｜tool_calls>")
    # With tools the reasoning of earlier turns is kept; results come in the order of the calls.
    assert rest == (f"Paris and Rome?{A}<think>Both cities.</think>{calls}{E}"
                    f"{U}<tool_result>15C</tool_result>\n\n<tool_result>12C</tool_result>{A}<think>")


def test_rendered_calls_parse_back_to_the_same_calls():
    """What the encoder writes for an assistant's calls is what the DSML parser reads."""
    prompt = render(TOOL_CHAT)
    block = prompt[prompt.index("<｜DSML｜tool_calls>"):prompt.index(E)]
    parser = ToolCallParser(DSML_TOOL_CALLS)
    parser.feed(block)
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]


def test_an_unknown_role_is_refused_naming_it():
    with pytest.raises(ChatTemplateError, match="no role 'robot'"):
        render([{"role": "robot", "content": "x"}])


def test_chat_formats_by_architecture():
    dsv4 = load_chat_format(load_runtime_config([]).model)
    assert isinstance(dsv4.renderer, Dsv4ChatFormat)
    assert (dsv4.reasoning, dsv4.tool_calls) == (DSV4_REASONING, DSML_TOOL_CALLS)
    qwen3 = load_chat_format(load_runtime_config(["+model=qwen3_tiny"]).model)
    assert qwen3.renderer is None and (qwen3.reasoning, qwen3.tool_calls) == (QWEN3_REASONING, QWEN3_TOOL_CALLS)


def test_the_tiny_tokenizer_holds_each_marker_as_one_token_kept_in_text():
    """The embedded tiny models' built tokenizer, like the released ones: each marker of the chat formats is one
    token, and decoding keeps it (the parsers read it from the text)."""
    from appliance.core.tokenizer import Tokenizer
    from appliance.serve.dsv4_chat import MARKERS

    tok = Tokenizer.build(512)
    for marker in (*MARKERS, "<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>"):
        [token] = tok.encode(marker)
        assert tok.decode([token]) == marker
