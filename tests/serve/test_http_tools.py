"""Reasoning and tool calls through the HTTP front end with the official openai client, on an engine stand-in
that answers a recorded DeepSeek V4 answer (thinking, then DSML calls): the message's reasoning_content and
tool_calls, the same put together from the stream, tool_choice none / required / named (the grammar is attached
to the engine request), tool results and earlier calls rendered into the prompt, and refusals naming the field."""

from __future__ import annotations

import json

import pytest

from appliance.config.compose import load_runtime_config
from tests.serve import test_server
from tests.serve.test_http import http_port, request

openai = pytest.importorskip("openai")
running = test_server.running

REASONING = "The user wants the weather; I'll call the tool."
CALLS = ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
         "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
         "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
         "</｜DSML｜tool_calls>")
REPLY = REASONING + "</think>Checking." + CALLS
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
THINKING = {"chat_template_kwargs": {"thinking": True}}


@pytest.fixture(scope="module")
def base_rc():
    return load_runtime_config(["+model=dsv4_tiny", "server.port=0", "server.http_port=0",
                                "model.layout.max_model_len_cap=16384", "max_model_len=16384"])


@pytest.fixture
def served(running):
    srv = running(reply=REPLY)
    port = http_port(srv)
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30) as client:
        yield srv, port, client


def streamed(chunks) -> tuple[dict, str]:
    """The message the stream's deltas put together, and the last finish reason."""
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or ():
                if call.id is not None:
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                calls[call.index]["arguments"] += call.function.arguments or ""
            reason = choice.finish_reason or reason
    return {"content": content or None, "reasoning": reasoning or None, "calls": list(calls.values())}, reason


def test_thinking_answer_with_calls_is_split_streamed_or_not(served):
    _, _, client = served
    r = client.chat.completions.create(model="deepseek-v4-tiny", messages=MESSAGES, tools=[WEATHER],
                                       extra_body=THINKING)
    message, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert message.model_extra["reasoning_content"] == REASONING == message.model_extra["reasoning"]
    assert message.content == "Checking."
    [call] = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    whole, reason = streamed(client.chat.completions.create(model="deepseek-v4-tiny", messages=MESSAGES,
                                                            tools=[WEATHER], extra_body=THINKING, stream=True))
    assert reason == "tool_calls"
    assert whole == {"content": "Checking.", "reasoning": REASONING, "calls": [
        {"id": whole["calls"][0]["id"], "name": "get_weather", "arguments": call.function.arguments}]}


def test_without_thinking_there_is_no_reasoning_and_tool_choice_none_parses_no_calls(served):
    _, _, client = served
    r = client.chat.completions.create(model="deepseek-v4-tiny", messages=MESSAGES, tools=[WEATHER],
                                       tool_choice="none")
    message = r.choices[0].message
    assert message.content == REPLY and message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert "reasoning_content" not in (message.model_extra or {})


def test_forced_calls_attach_the_grammar_to_the_engine_request(served):
    srv, port, client = served
    seen = []
    submit = srv.engine.submit

    def record(request_id, prompt, params, on_output=None):
        seen.append(params.constraint)
        return submit(request_id, prompt, params, on_output)
    srv.engine.submit = record
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model="deepseek-v4-tiny", messages=MESSAGES, tools=[WEATHER],
                                           tool_choice=choice, extra_body=THINKING)
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert [c.field for c in seen] == ["tool_choice", "tool_choice"]
    assert all('｜DSML｜invoke name=\\"get_weather\\">' in c.text for c in seen)
    assert seen[0].text.startswith("start: reasoning")        # thinking mode: reasoning first, then calls


def test_tool_results_and_earlier_calls_render_into_the_prompt(served):
    _, port, _ = served
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 3}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "15C and sunny"}]
    status, body = request(port, "/tokenize", {"messages": messages, "tools": [WEATHER]})
    assert status == 200
    prompt = bytes(body["tokens"]).decode()                   # the stand-in's tokens are the prompt's bytes
    assert CALLS in prompt
    assert prompt.endswith("<｜User｜><tool_result>15C and sunny</tool_result><｜Assistant｜></think>")
    assert "\"name\": \"get_weather\"" in prompt             # the tool's schema in the tools section


@pytest.mark.parametrize("body, param, why", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice",
     "'nope' is not among the tools ('get_weather')"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice", "'none', 'auto' or 'required'"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name",
     "Field required"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with response_format"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "valid boolean"),
])
def test_bad_tool_requests_are_400_naming_the_field(served, body, param, why):
    _, port, _ = served
    status, answer = request(port, "/v1/chat/completions", {"messages": MESSAGES, **body})
    assert status == 400 and answer["error"]["param"] == param and why in answer["error"]["message"], answer


def test_a_call_with_arguments_that_are_not_json_is_400_naming_them(served):
    _, port, _ = served
    messages = [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]
    status, answer = request(port, "/v1/chat/completions", {"messages": messages})
    assert status == 400 and answer["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


def test_a_malformed_call_comes_back_as_content_streamed_or_not(running):
    bad_call = ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                "<｜DSML｜parameter name=\"days\" string=\"false\">three</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                "</｜DSML｜tool_calls>")
    port = http_port(running(reply="Sure." + bad_call))
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30) as client:
        r = client.chat.completions.create(model="deepseek-v4-tiny", messages=MESSAGES, tools=[WEATHER])
        assert r.choices[0].message.content == "Sure." + bad_call and r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "stop"
        whole, reason = streamed(client.chat.completions.create(model="deepseek-v4-tiny", messages=MESSAGES,
                                                                tools=[WEATHER], stream=True))
        assert whole == {"content": "Sure." + bad_call, "reasoning": None, "calls": []} and reason == "stop"
