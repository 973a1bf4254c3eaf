"""Reasoning and tool-call parsing of chat answers, on answers written by hand in each model's format (DeepSeek's
released DSV4 encoding, Qwen3's chat template instructions): the whole answer, the answer fed at every character
boundary (two deltas) and one character at a time, all give the same message; markers never leak into content;
unfinished and malformed calls come back as content."""

from __future__ import annotations

import json

import pytest

from appliance.serve.chat_output import ChatOutputParser
from appliance.serve.reasoning import DSV4_REASONING, QWEN3_REASONING
from appliance.serve.tool_parsers import DSML_TOOL_CALLS, QWEN3_TOOL_CALLS

DSV4_THINKING_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris?<｜Assistant｜><think>"
DSV4_CHAT_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris?<｜Assistant｜></think>"
QWEN3_PROMPT = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINK_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"

DSV4_CALLS = (
    "\n\n<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">Paris, \"FR\"</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"units\" string=\"false\">{\"temp\": \"C\", \"wind\": [1, 2]}</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"get_time\">\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>")
DSV4_ARGS = [{"city": "Paris, \"FR\"", "days": 3, "units": {"temp": "C", "wind": [1, 2]}}, {}]
QWEN3_CALLS = ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris, \\\"FR\\\"\", \"days\": 3, "
               "\"units\": {\"temp\": \"C\", \"wind\": [1, 2]}}}\n</tool_call>\n"
               "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>")

# name: (prompt, reasoning format, tool format, answer, expected reasoning, content, [(name, arguments)])
CASES = {
    "dsv4 thinking, calls": (DSV4_THINKING_PROMPT, DSV4_REASONING, DSML_TOOL_CALLS,
                             "The user wants <b>weather</b>.</think>Let me check." + DSV4_CALLS,
                             "The user wants <b>weather</b>.", "Let me check.",
                             [("get_weather", DSV4_ARGS[0]), ("get_time", DSV4_ARGS[1])]),
    "dsv4 thinking, no calls": (DSV4_THINKING_PROMPT, DSV4_REASONING, DSML_TOOL_CALLS,
                                "Hmm.\nSunny? </thin k></think>It is < 20 degrees.\n", "Hmm.\nSunny? </thin k>",
                                "It is < 20 degrees.\n", []),
    "dsv4 thinking, calls without </think>": (DSV4_THINKING_PROMPT, DSV4_REASONING, DSML_TOOL_CALLS,
                                              "I must call the tool." + DSV4_CALLS, "I must call the tool.\n\n", None,
                                              [("get_weather", DSV4_ARGS[0]), ("get_time", DSV4_ARGS[1])]),
    "dsv4 chat, calls only": (DSV4_CHAT_PROMPT, DSV4_REASONING, DSML_TOOL_CALLS, DSV4_CALLS.lstrip(), None, None,
                              [("get_weather", DSV4_ARGS[0]), ("get_time", DSV4_ARGS[1])]),
    "dsv4 chat, <think> is text": (DSV4_CHAT_PROMPT, DSV4_REASONING, DSML_TOOL_CALLS, "<think>x</think>y", None,
                                   "<think>x</think>y", []),
    "dsv4 truncated reasoning": (DSV4_THINKING_PROMPT, DSV4_REASONING, DSML_TOOL_CALLS, "Still thinking </thi",
                                 "Still thinking </thi", None, []),
    "qwen3 thinking, calls": (QWEN3_PROMPT, QWEN3_REASONING, QWEN3_TOOL_CALLS,
                              "<think>\nNeed the tool.\n</think>\n\nChecking.\n" + QWEN3_CALLS + "\n",
                              "\nNeed the tool.\n", "\n\nChecking.",
                              [("get_weather", DSV4_ARGS[0]), ("get_time", DSV4_ARGS[1])]),
    "qwen3 no thinking": (QWEN3_NO_THINK_PROMPT, QWEN3_REASONING, QWEN3_TOOL_CALLS, "  Paris is <b>sunny</b>.  ",
                          None, "  Paris is <b>sunny</b>.  ", []),
    "qwen3 answer mentioning a tag": (QWEN3_PROMPT, QWEN3_REASONING, QWEN3_TOOL_CALLS, "Use <tool_call> tags.",
                                      None, "Use <tool_call> tags.", []),
    "qwen3 malformed call": (QWEN3_PROMPT, QWEN3_REASONING, QWEN3_TOOL_CALLS,
                             "Ok.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n</tool_call>", None,
                             "Ok.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n</tool_call>", []),
    "qwen3 unfinished call": (QWEN3_PROMPT, QWEN3_REASONING, QWEN3_TOOL_CALLS,
                              "<tool_call>\n{\"name\": \"f\", \"argu", None,
                              "<tool_call>\n{\"name\": \"f\", \"argu", []),
    "dsv4 malformed second call": (DSV4_CHAT_PROMPT, DSV4_REASONING, DSML_TOOL_CALLS,
                                   "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"a\">\n</｜DSML｜invoke>\n"
                                   "<｜DSML｜invoke name=\"b\">\n<｜DSML｜parameter name=\"x\" string=\"false\">"
                                   "not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>", None,
                                   "<｜DSML｜invoke name=\"b\">\n<｜DSML｜parameter name=\"x\" string=\"false\">"
                                   "not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
                                   [("a", {})]),
    "dsv4 unfinished parameter": (DSV4_CHAT_PROMPT, DSV4_REASONING, DSML_TOOL_CALLS,
                                  "Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"a\">\n<｜DSML｜para", None,
                                  "Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"a\">\n<｜DSML｜para", []),
    "dsv4 calls, end of block cut": (DSV4_CHAT_PROMPT, DSV4_REASONING, DSML_TOOL_CALLS,
                                     "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"a\">\n</｜DSML｜invoke>\n</｜DS",
                                     None, None, [("a", {})]),
    "dsv4 duplicate parameter": (DSV4_CHAT_PROMPT, DSV4_REASONING, DSML_TOOL_CALLS,
                                 "<｜DSML｜tool_calls><｜DSML｜invoke name=\"a\"><｜DSML｜parameter name=\"x\" "
                                 "string=\"true\">1</｜DSML｜parameter><｜DSML｜parameter name=\"x\" string=\"true\">"
                                 "2</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>", None,
                                 "<｜DSML｜tool_calls><｜DSML｜invoke name=\"a\"><｜DSML｜parameter name=\"x\" "
                                 "string=\"true\">1</｜DSML｜parameter><｜DSML｜parameter name=\"x\" string=\"true\">"
                                 "2</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>", []),
}


def parse(case: tuple, deltas: list[str]) -> tuple[dict, list[dict]]:
    prompt, reasoning, tools, *_ = case
    parser = ChatOutputParser(prompt, reasoning, tools)
    stream = [d for text in deltas for d in parser.feed(text)] + parser.finish()
    return parser.message.body(), stream


def reassembled(stream: list[dict]) -> dict:
    """The message a client puts together from the stream's deltas (as the openai client's helpers do)."""
    content, reasoning, calls = "", None, {}
    for delta in stream:
        content += delta.get("content", "")
        if "reasoning_content" in delta:
            assert delta["reasoning"] == delta["reasoning_content"]
            reasoning = (reasoning or "") + delta["reasoning_content"]
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                assert call["index"] == len(calls) and call["function"]["arguments"] == ""
                calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"], "arguments": ""}
            else:
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return {"content": content, "reasoning": reasoning,
            "tool_calls": [(c["name"], json.loads(c["arguments"])) for c in calls.values()]}


def splits(text: str):
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


@pytest.mark.parametrize("name", CASES)
def test_answer_splits_into_reasoning_content_and_calls_however_it_is_streamed(name):
    case = CASES[name]
    answer, reasoning, content, calls = case[3:]
    for deltas in splits(answer):
        message, stream = parse(case, deltas)
        assert message.get("reasoning_content") == reasoning and message.get("reasoning") == reasoning, deltas
        assert message["content"] == (content if content is not None else None if calls else ""), deltas
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
        assert got == calls, deltas
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in message.get("tool_calls", []))
        again = reassembled(stream)
        assert again == {"content": content or "", "reasoning": reasoning, "tool_calls": calls}, deltas


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][6] and "｜DSML｜" not in (CASES[n][5] or "")])
def test_no_partial_marker_reaches_content_while_a_call_streams(name):
    """Content streamed around well-formed calls never holds any part of their markup."""
    case = CASES[name]
    answer = case[3]
    for deltas in splits(answer):
        _, stream = parse(case, deltas)
        streamed = "".join(d.get("content", "") for d in stream)
        assert "｜DSML｜" not in streamed and "<tool_call" not in streamed and not streamed.endswith("<"), deltas


def test_arguments_stream_in_pieces_after_the_name():
    case = CASES["dsv4 chat, calls only"]
    _, stream = parse(case, [case[3]])
    first = [d["tool_calls"][0] for d in stream if d["tool_calls"][0]["index"] == 0]
    assert first[0]["function"] == {"name": "get_weather", "arguments": ""}
    pieces = [d["function"]["arguments"] for d in first[1:]]
    assert len(pieces) == 4 and json.loads("".join(pieces)) == DSV4_ARGS[0]


def test_without_parsers_the_text_is_the_content():
    parser = ChatOutputParser("prompt<think>", None, None)
    assert parser.feed("<think>a</think><tool_call>") == [{"content": "<think>a</think><tool_call>"}]
    assert parser.finish() == [] and parser.message.body() == {"role": "assistant",
                                                              "content": "<think>a</think><tool_call>"}


def test_parallel_tool_calls_false_keeps_the_first_call_streamed_or_not():
    case = CASES["qwen3 thinking, calls"]
    parser = ChatOutputParser(case[0], case[1], case[2], max_calls=1)
    stream = [d for ch in case[3] for d in parser.feed(ch)] + parser.finish()
    assert [c["function"]["name"] for c in parser.message.body()["tool_calls"]] == ["get_weather"]
    assert reassembled(stream)["tool_calls"] == [("get_weather", DSV4_ARGS[0])]


def test_a_long_argument_streams_in_linear_time():
    """A call's text is parsed again only when a delta may close a tag (every tag ends with ">"): a 200k-character
    argument fed 4 characters at a time takes about as many parse passes as it has tags."""
    value = "x" * 200_000
    answer = ("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"w\">\n<｜DSML｜parameter name=\"t\" string=\"true\">"
              f"{value}</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    parser = ChatOutputParser(DSV4_CHAT_PROMPT, DSV4_REASONING, DSML_TOOL_CALLS)
    calls = []
    read_block = parser.tools.fmt.read_block

    class Counting(type(parser.tools.fmt)):
        def read_block(self, text):
            calls.append(len(text))
            return read_block(text)
    parser.tools.fmt = Counting(parser.tools.fmt.name, parser.tools.fmt.start)
    for i in range(0, len(answer), 4):
        parser.feed(answer[i:i + 4])
    parser.finish()
    assert json.loads(parser.message.tool_calls[0].arguments) == {"t": value}
    assert len(calls) < 20
