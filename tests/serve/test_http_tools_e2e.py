"""Tool calls and reasoning end to end: the real server process (`python -m appliance`) on the random-weight tiny
DeepSeek V4 (its released chat format) and a tiny Qwen3 checkpoint (Qwen3's released template), driven by the
official openai client. tool_choice named / required makes even random weights answer with calls whose arguments
are valid under the schema (the grammar engine masks everything else); thinking on / off changes the rendered
prompt as the format says; the stream puts together the same message as the whole answer."""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from appliance.config.compose import load_runtime_config  # noqa: E402
from appliance.core.tokenizer import load_tokenizer_for  # noqa: E402
from appliance.serve.dsv4_chat import Dsv4ChatFormat  # noqa: E402
from tests.serve.qwen3_template import QWEN3_CHAT_TEMPLATE  # noqa: E402
from tests.serve.test_http_tools import streamed as assemble_stream  # noqa: E402
from tests.serve.test_server_e2e import ServerProcess, wait_for  # noqa: E402
from tests.support.checkpoints import write_tiny_checkpoint  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}       # (else random weights may add keys for ever: the schema allows them)
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
COMMON = ["device=cpu", "max_num_seqs=4", "kv_cache.num_slots_override=8", "server.port=0", "server.http_port=0",
          "server.grace_period_s=5"]


def serve(tmp_path_factory, *overrides: str):
    srv = ServerProcess(*overrides, *COMMON, run_dir=tmp_path_factory.mktemp("run"))
    srv.wait_address()
    wait_for(lambda: "SERVING on" in srv.output or srv.proc.poll() is not None, 300, "SERVING")
    assert srv.proc.poll() is None, srv.output
    port = int(re.search(r"^http listening on 127\.0\.0\.1:(\d+) ", srv.output, re.M).group(1))
    return srv, port


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    srv, port = serve(tmp_path_factory, "+model=dsv4_tiny")     # its default max_model_len holds the tools prompt
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300) as c:
            yield c, load_runtime_config(["+model=dsv4_tiny"]).model
    finally:
        srv.proc.terminate()
        srv.proc.wait(60)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    model = load_runtime_config(["+model=qwen3_tiny"]).model
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), model, seed=5, std=0.1)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": QWEN3_CHAT_TEMPLATE}))
    srv, port = serve(tmp_path_factory, "+model=hf", f"model.weights={path}", "model.name=qwen3-tiny",
                      "max_model_len=2048")
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300) as c:
            yield c
    finally:
        srv.proc.terminate()
        srv.proc.wait(60)


def streamed(chunks) -> tuple[dict, str | None]:
    """The stream put together (as test_http_tools does), its calls as (name, arguments): ids differ per answer."""
    whole, reason = assemble_stream(chunks)
    return {**whole, "calls": [(c["name"], c["arguments"]) for c in whole["calls"]]}, reason


def as_streamed(message) -> dict:
    return {"content": message.content, "reasoning": (message.model_extra or {}).get("reasoning_content"),
            "calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]}


def forced_call_checks(client, model: str, extra: dict) -> None:
    """Named and required choices return one schema-valid call; streamed, the same call."""
    for choice, name in (({"type": "function", "function": {"name": "get_time"}}, "get_time"),
                         ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
                         ("required", None)):
        kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                      temperature=0, max_tokens=200, extra_body=extra)
        r = client.chat.completions.create(**kwargs)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", message
        [call] = message.tool_calls
        assert name is None or call.function.name == name
        tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        whole, reason = streamed(client.chat.completions.create(**kwargs, stream=True))
        assert reason == "tool_calls" and whole == as_streamed(message)


def test_dsv4_forced_tool_calls_are_valid_calls(dsv4):
    client, _ = dsv4
    forced_call_checks(client, "deepseek-v4-tiny", {})


def test_dsv4_thinking_switch_changes_the_prompt_as_the_format_says(dsv4):
    client, model = dsv4
    tokenizer = load_tokenizer_for(model)
    base = str(client.base_url).removesuffix("/v1/")
    for kwargs, ending in (({"thinking": True}, "<｜Assistant｜><think>"), ({}, "<｜Assistant｜></think>"),
                           ({"enable_thinking": False}, "<｜Assistant｜></think>")):
        r = client.post(f"{base}/tokenize", cast_to=object, body={"messages": MESSAGES, "tools": TOOLS,
                                                                   "chat_template_kwargs": kwargs})
        expected = Dsv4ChatFormat().render(MESSAGES, tools=TOOLS, **kwargs)
        assert expected.endswith(ending) and r["tokens"] == tokenizer.encode(expected)


def test_dsv4_thinking_answer_is_reasoning_streamed_or_not(dsv4):
    """In thinking mode the answer starts inside <think>: random weights never close it, so it is all reasoning."""
    client, _ = dsv4
    kwargs = dict(model="deepseek-v4-tiny", messages=MESSAGES, temperature=0, max_tokens=16,
                  extra_body={"chat_template_kwargs": {"thinking": True}, "ignore_eos": True})
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and not message.content
    whole, reason = streamed(client.chat.completions.create(**kwargs, stream=True))
    assert reason == "length" and whole == {"content": None, "reasoning": reasoning, "calls": []}
    plain = client.chat.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True}}).choices[0].message
    assert plain.content and "reasoning_content" not in (plain.model_extra or {})


def test_qwen3_forced_tool_calls_are_valid_calls(qwen3):
    forced_call_checks(qwen3, "qwen3-tiny", {"chat_template_kwargs": {"enable_thinking": False}})


def test_qwen3_thinking_switch_and_tool_turns_render_through_the_template(qwen3):
    base = str(qwen3.base_url).removesuffix("/v1/")
    messages = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "15C"}]
    texts = {}
    for thinking in (True, False):
        r = qwen3.post(f"{base}/tokenize", cast_to=object, body={
            "messages": messages, "tools": TOOLS, "return_token_strs": True,
            "chat_template_kwargs": {"enable_thinking": thinking}})
        texts[thinking] = "".join(r["token_strs"])
    assert texts[False] == texts[True] + "<think>\n\n</think>\n\n"
    assert "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>" \
        in texts[True]
    assert "<|im_start|>user\n<tool_response>\n15C\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in texts[True]
