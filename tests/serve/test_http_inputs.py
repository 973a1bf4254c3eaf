"""Every HTTP input the OpenAI routes can be sent, against the fake engine with a chat template: bad input is a 400
naming the field as the client wrote it (never a 500), types are strict where OpenAI's are, and a chat too big to
fit is refused before it is rendered or tokenized (issue 24 items 2, 5 and 7)."""

from __future__ import annotations

import dataclasses
import http.client
import json

import pytest

from appliance.config.compose import load_runtime_config
from appliance.serve.chat_template import ChatTemplate
from appliance.serve.openai.protocol import MAX_CHAT_MESSAGES
from tests.serve.fake_engine import FakeEngine
from tests.serve.test_server import Running, wait_for

openai = pytest.importorskip("openai")

TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


class RecordingTokenizer:
    """The fake engine's byte tokenizer, recording the length of every text it encodes."""

    eos_token_id, max_token_bytes = 0, 1

    def __init__(self):
        self.encoded: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        return list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")


@dataclasses.dataclass
class Served:
    srv: Running
    port: int
    renders: list[int]              # the number of messages of every chat rendered

    @property
    def tokenizer(self) -> RecordingTokenizer:
        return self.srv.engine.tokenizer


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok_dir = tmp_path_factory.mktemp("tokenizer")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "chat_template": TEMPLATE}))
    # A 16 MB chat must pass the body limit (server.http_max_body_bytes) to reach the chat bound tested here.
    rc = load_runtime_config(["server.port=0", "server.http_port=0", "server.grace_period_s=5",
                              f"server.http_max_body_bytes={32 << 20}"])
    rc = dataclasses.replace(rc, model=dataclasses.replace(rc.model, tokenizer=str(tok_dir / "tokenizer.json")))
    engine = FakeEngine(rc)
    engine.tokenizer = RecordingTokenizer()
    renders: list[int] = []
    render = ChatTemplate.render

    def recording_render(self, messages, **kw):
        renders.append(len(messages))
        return render(self, messages, **kw)
    ChatTemplate.render = recording_render
    srv = Running(rc, engine)
    try:
        srv.wait_serving()
        wait_for(lambda: srv.server.http is not None and srv.server.http.port is not None, 10, "HTTP to bind")
        yield Served(srv, srv.server.http.port, renders)
    finally:
        ChatTemplate.render = render
        srv.stop()


def post(port: int, path: str, body: dict | str | bytes, content_type: str = "application/json") -> tuple[int, dict]:
    """POST a body (a dict is sent as JSON with \\u escapes, so lone surrogates travel as JSON allows)."""
    raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, raw.encode() if isinstance(raw, str) else raw, {"Content-Type": content_type})
        resp = conn.getresponse()
        data = resp.read()
        if resp.getheader("content-type", "").startswith("text/event-stream"):
            return resp.status, {"events": data.decode()}
        return resp.status, json.loads(data or b"null")
    finally:
        conn.close()


def chat(*messages: dict, **fields) -> dict:
    return {"messages": list(messages) or [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def user(content, **fields) -> dict:
    return {"role": "user", "content": content, **fields}


# (route, body, the field the 400 names): each was a 500 or a 200 before issue 24, or named the field wrongly.
BAD_INPUTS = {
    # lone surrogates, wherever text reaches the tokenizer or the template
    "surrogate prompt": (COMPLETIONS, {"prompt": "\ud800", "max_tokens": 2}, "prompt"),
    "surrogate in a prompt list": (COMPLETIONS, {"prompt": ["ok \udfff"], "max_tokens": 2}, "prompt"),
    "surrogate stop string": (COMPLETIONS, {"prompt": "hi", "stop": ["a", "\ud800"]}, "stop[1]"),
    "surrogate chat content": (CHAT, chat(user("\ud800")), "messages[0].content"),
    "surrogate chat role": (CHAT, chat(user("hi"), {"role": "\ud800", "content": "x"}), "messages[1].role"),
    "surrogate chat name": (CHAT, chat(user("hi", name="\ud83d")), "messages[0].name"),
    "surrogate text part": (CHAT, chat(user([{"type": "text", "text": "\ud800"}])), "messages[0].content[0].text"),
    "surrogate in tools": (CHAT, chat(tools=[{"type": "function", "function": {"name": "\ud800"}}]),
                           "tools[0].function.name"),
    "surrogate in chat_template_kwargs": (CHAT, chat(chat_template_kwargs={"lang": ["\ud800"]}),
                                          "chat_template_kwargs.lang[0]"),
    # names the renderer sets itself
    **{f"chat_template_kwargs {key}": (CHAT, chat(chat_template_kwargs={key: "x"}), "chat_template_kwargs")
       for key in ("tools", "messages", "add_generation_prompt", "documents", "bos_token", "eos_token",
                   "raise_exception")},
    # content parts
    "text part with a number": (CHAT, chat(user([{"type": "text", "text": 123}])), "messages[0].content[0].text"),
    "text part with null": (CHAT, chat(user([{"type": "text", "text": None}])), "messages[0].content[0].text"),
    "text part without text": (CHAT, chat(user([{"type": "text"}])), "messages[0].content[0].text"),
    "null content part": (CHAT, chat(user(["hi", None])), "messages[0].content[0]"),
    "image part": (CHAT, chat(user([{"type": "image_url", "image_url": {"url": "x"}}])), "messages[0].content[0].type"),
    # integer ranges the engine step cannot take
    "top_k 2**63": (COMPLETIONS, {"prompt": "hi", "top_k": 2**63, "temperature": 1}, "top_k"),
    "seed 2**64": (COMPLETIONS, {"prompt": "hi", "seed": 2**64, "temperature": 1}, "seed"),
    "chat seed 2**64": (CHAT, chat(seed=2**64, temperature=1), "seed"),
    "negative seed": (COMPLETIONS, {"prompt": "hi", "seed": -1}, "seed"),
    # strict types where OpenAI's are strict
    "stream yes": (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, "stream"),
    "max_tokens true": (COMPLETIONS, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    "max_tokens 2.5": (COMPLETIONS, {"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    "temperature true": (COMPLETIONS, {"prompt": "hi", "temperature": True}, "temperature"),
    "ignore_eos 1": (COMPLETIONS, {"prompt": "hi", "ignore_eos": 1}, "ignore_eos"),
    "include_usage yes": (COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": "yes"}},
                          "stream_options.include_usage"),
    "add_generation_prompt 1": (CHAT, chat(add_generation_prompt=1), "add_generation_prompt"),
    # the field as the client wrote it
    "prompt a number": (COMPLETIONS, {"prompt": 5}, "prompt"),
    "prompt a null token id": (COMPLETIONS, {"prompt": [[1, None]]}, "prompt[0][1]"),
    "stop a number": (COMPLETIONS, {"prompt": "hi", "stop": 5}, "stop"),
    "max_completion_tokens too many": (CHAT, {**chat(), "max_tokens": None, "max_completion_tokens": 5000},
                                       "max_completion_tokens"),
    "max_completion_tokens a string": (CHAT, chat(max_completion_tokens="many"), "max_completion_tokens"),
    "null message": (CHAT, {"messages": [None]}, "messages[0]"),
    "null role": (CHAT, chat(user("hi"), {"role": None, "content": "x"}), "messages[1].role"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_400_naming_the_field(served, name):
    route, body, param = BAD_INPUTS[name]
    status, answer = post(served.port, route, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    assert answer["error"]["message"].startswith(f"{param}: ")


@pytest.mark.parametrize("raw", ['{"prompt": "hi"', '{"prompt": "hi",}', "{'prompt': 1}"])
def test_malformed_json_is_400_saying_so(served, raw):
    """Not `"34": JSON decode error`: what the parser found, and no param (no field is at fault)."""
    status, answer = post(served.port, COMPLETIONS, raw)
    assert status == 400 and answer["error"]["param"] is None
    assert answer["error"]["message"].startswith("malformed JSON (at character ")
    assert json.JSONDecodeError.__name__ not in answer["error"]["message"]


@pytest.mark.parametrize("raw", [b'{"prompt": "\xff"}', b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                 b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}"],
                         ids=["not UTF-8", "nested 100,000 deep", "a 5001-digit number"])
def test_a_body_json_cannot_parse_is_400_saying_malformed_json(served, raw):
    status, answer = post(served.port, COMPLETIONS, raw)
    assert status == 400 and answer["error"]["message"].startswith("malformed JSON: ")


@pytest.mark.parametrize("raw, content_type", [("", "application/json"), ('{"prompt": "hi"}', "text/plain"),
                                               ("[1, 2]", "application/json")])
def test_a_body_that_is_not_a_json_object_says_what_to_send(served, raw, content_type):
    status, answer = post(served.port, COMPLETIONS, raw, content_type)
    assert status == 400 and answer["error"]["param"] is None
    assert "send a JSON object with Content-Type: application/json" in answer["error"]["message"]


def test_ints_are_still_numbers(served):
    status, answer = post(served.port, COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "temperature": 1, "top_p": 1})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


FIELDS = {
    COMPLETIONS: ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                  "ignore_eos", "stream", "stream_options", "n", "logprobs", "presence_penalty", "frequency_penalty",
                  "logit_bias", "user", "echo", "suffix"],
    CHAT: ["messages", "max_tokens", "max_completion_tokens", "add_generation_prompt", "chat_template_kwargs",
           "tools", "temperature", "seed", "stop", "stream", "stream_options"],
}
ODD_VALUES = [None, True, False, "x", "", "\ud800", 0, -1, 1.5, 2**64, -(2**64), 10**400, [], {}, [None], {"a": None},
              [[None]], [{"type": None}], [{"role": "user", "content": None}], "NaN", "Infinity", "1e400"]


def test_no_value_of_any_field_is_a_server_error(served):
    """Every field with values of every JSON type (huge ints, NaN and inf, nested nulls, lone surrogates): the
    answer is 200, 400 naming that field, or 404 for a model name; never a 500."""
    base = {COMPLETIONS: {"prompt": "hi", "max_tokens": 2}, CHAT: chat()}
    seen = set()
    for route, fields in FIELDS.items():
        for field in fields:
            for value in ODD_VALUES:
                raw = json.dumps({**base[route], field: value})
                if isinstance(value, str) and value in ("NaN", "Infinity", "1e400"):     # JSON's number extremes
                    raw = raw.replace(f'"{value}"', value)
                status, answer = post(served.port, route, raw)
                seen.add(status)
                assert status in (200, 400, 404), (route, field, value, answer)
                if status == 400:
                    param = answer["error"]["param"] or ""
                    assert param.split(".")[0].split("[")[0] == field, (route, field, value, answer)
    assert seen == {200, 400, 404}


def test_deeply_nested_values_are_not_a_server_error(served):
    deep = json.loads("[" * 500 + "]" * 500)
    for body in (chat(tools=[{"function": deep}]), chat(chat_template_kwargs={"x": deep})):
        status, _ = post(served.port, CHAT, body)
        assert status in (200, 400)


# -- item 5: the chat is bounded like a prompt, cheaply ----------------------------------------------------

def test_message_text_past_the_byte_bound_is_refused_before_rendering(served):
    bound = served.srv.engine.limits.max_prompt_bytes
    renders, encoded = len(served.renders), len(served.tokenizer.encoded)
    for body in (chat(user("x" * (bound + 1))),
                 chat(*[user("x" * (bound // 4)) for _ in range(5)]),
                 chat(user([{"type": "text", "text": "x" * bound}, {"type": "text", "text": "y"}])),
                 chat(user("x" * (16 << 20)))):
        status, answer = post(served.port, CHAT, body)
        assert status == 400 and answer["error"]["param"] == "messages", answer
        assert f"at most {bound:,} bytes" in answer["error"]["message"]
    assert len(served.renders) == renders and len(served.tokenizer.encoded) == encoded


def test_a_rendered_chat_past_the_byte_bound_is_refused_before_tokenizing(served):
    """The message text fits but the template's additions push the chat past the bound."""
    bound = served.srv.engine.limits.max_prompt_bytes
    content = "x" * (bound - len("user"))
    renders, encoded = len(served.renders), len(served.tokenizer.encoded)
    status, answer = post(served.port, CHAT, chat(user(content)))
    assert status == 400 and answer["error"]["param"] == "messages", answer
    assert "bytes of text" in answer["error"]["message"]
    assert len(served.renders) == renders + 1 and len(served.tokenizer.encoded) == encoded


def test_more_messages_than_the_limit_are_refused_before_rendering(served):
    renders = len(served.renders)
    status, answer = post(served.port, CHAT, chat(*[{"role": "user", "content": ""}] * (MAX_CHAT_MESSAGES + 1)))
    assert status == 400 and answer["error"]["param"] == "messages"
    assert answer["error"]["message"] == f"messages: {MAX_CHAT_MESSAGES + 1:,} messages; at most {MAX_CHAT_MESSAGES}"
    status, answer = post(served.port, CHAT, chat(*[{"role": "user", "content": ""}] * 200_000))
    assert status == 400 and answer["error"]["param"] == "messages"
    assert len(served.renders) == renders


# -- the official client -----------------------------------------------------------------------------------

def test_the_openai_client_gets_400s_naming_the_field(served):
    """(The openai client cannot send a lone surrogate: it fails to encode the body itself.)"""
    with openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="x", max_retries=0) as client:
        for call, param in [
            (lambda: client.completions.create(model="deepseek-v4-tiny", prompt="hi", seed=2**64), "seed"),
            (lambda: client.completions.create(model="deepseek-v4-tiny", prompt="hi",
                                               extra_body={"top_k": 2**63}), "top_k"),
            (lambda: client.chat.completions.create(model="deepseek-v4-tiny", messages=[user("hi")],
                                                    extra_body={"chat_template_kwargs": {"tools": []}}),
             "chat_template_kwargs"),
            (lambda: client.chat.completions.create(
                model="deepseek-v4-tiny", messages=[user([{"type": "text", "text": 123}])]),
             "messages[0].content[0].text"),
            (lambda: client.chat.completions.create(model="deepseek-v4-tiny", messages=[user("hi")],
                                                    max_completion_tokens=5000), "max_completion_tokens"),
        ]:
            with pytest.raises(openai.BadRequestError) as info:
                call()
            assert info.value.body["param"] == param
