"""Item 5 of issue 26 on the fake-engine server: /tokenize and /detokenize in vLLM's shapes, /v1/models with
max_model_len, and a field this server does not support refused with a 400 naming it (never silently ignored)."""

from __future__ import annotations

import http.client
import json

import pytest

from tests.serve.test_http_inputs import CHAT, COMPLETIONS, post, served  # noqa: F401


def get_json(port: int, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_tokenize_a_prompt_as_vllm_answers(served):  # noqa: F811
    status, answer = post(served.port, "/tokenize", {"prompt": "Hi there", "return_token_strs": True})
    assert status == 200, answer
    ids = list(b"Hi there")                         # the fake engine's byte tokenizer
    assert answer == {"count": len(ids), "max_model_len": served.srv.engine.rc.max_model_len, "tokens": ids,
                      "token_strs": [chr(i) for i in ids]}


def test_tokenize_messages_renders_the_chat_template(served):  # noqa: F811
    messages = [{"role": "user", "content": "Hi"}]
    status, answer = post(served.port, "/tokenize", {"messages": messages})
    assert status == 200, answer
    assert answer["count"] == len(answer["tokens"]) > len(b"Hi") and answer["token_strs"] is None
    assert "Hi" in bytes(answer["tokens"]).decode()          # the message inside the template's text


def test_detokenize_as_vllm_answers(served):  # noqa: F811
    status, answer = post(served.port, "/detokenize", {"tokens": list(b"Hello")})
    assert (status, answer) == (200, {"prompt": "Hello"})


@pytest.mark.parametrize("path, body, field", [
    ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
    ("/tokenize", {}, None),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenize_requests_name_the_field(served, path, body, field):  # noqa: F811
    status, answer = post(served.port, path, body)
    assert status == 400 and answer["error"]["param"] == field, answer


def test_models_lists_max_model_len(served):  # noqa: F811
    status, answer = get_json(served.port, "/v1/models")
    assert status == 200
    assert answer["data"][0]["max_model_len"] == served.srv.engine.rc.max_model_len


@pytest.mark.parametrize("route, field, value", [
    (COMPLETIONS, "best_of", 2), (COMPLETIONS, "min_p", 0.1), (COMPLETIONS, "repetition_penalty", 1.2),
    (CHAT, "guided_json", {"type": "object"}), (CHAT, "function_call", "auto"),
    (CHAT, "functions", [{"name": "f"}]), (CHAT, "reasoning_effort", "low"), (CHAT, "no_such_field", 1),
])
def test_unsupported_fields_are_refused_naming_them(served, route, field, value):  # noqa: F811
    base = {"prompt": "hi", "max_tokens": 2} if route == COMPLETIONS else \
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, answer = post(served.port, route, json.dumps({**base, field: value}))
    assert status == 400, answer
    assert answer["error"]["param"] == field and "not supported" in answer["error"]["message"], answer


@pytest.mark.parametrize("route, field, fix", [
    (COMPLETIONS, "max_token", "did you mean max_tokens? Otherwise remove it"),
    (COMPLETIONS, "min_p", "send top_p or top_k instead, or remove it"),
    (CHAT, "functions", "send tools instead, or remove it"),
    (CHAT, "no_such_field", "remove it"),
])
def test_a_refused_field_says_what_to_send_instead(served, route, field, fix):  # noqa: F811
    """A typo gets the field it is closest to, a field of OpenAI's or vLLM's API its counterpart here."""
    base = {"prompt": "hi"} if route == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
    status, answer = post(served.port, route, json.dumps({**base, field: 1}))
    assert status == 400 and answer["error"]["param"] == field, answer
    assert answer["error"]["message"] == \
        f"{field}: not supported by this server (the field is refused, not ignored: {fix})", answer

