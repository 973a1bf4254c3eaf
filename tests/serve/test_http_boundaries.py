"""Every HTTP size limit at its exact bound: the limit itself passes, one more is refused (an off-by-one either way
fails here). Body bytes declared by Content-Length and counted while a chunked body is read
(server.http_max_body_bytes), chat messages (MAX_CHAT_MESSAGES) and choices (`n`, MAX_CHOICES); against the fake
engine."""

from __future__ import annotations

import dataclasses
import json

import pytest

from appliance.config.compose import load_runtime_config
from appliance.serve.openai.protocol import MAX_CHAT_MESSAGES, MAX_CHOICES
from tests.serve import test_server
from tests.serve.fake_engine import FakeEngine
from tests.serve.test_http_inputs import CHAT, COMPLETIONS, TEMPLATE, RecordingTokenizer, chat, post
from tests.serve.test_http_limits import completion_headers, connect, http_port, read_response

LIMIT = 4096
running = test_server.running       # the fake-engine server fixture, here with this module's base_rc


@pytest.fixture(scope="module")
def base_rc():
    return load_runtime_config(["server.port=0", "server.http_port=0", "server.grace_period_s=5",
                                f"server.http_max_body_bytes={LIMIT}"])


def body_of(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (padded with JSON whitespace)."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


def send(port: int, body: bytes, chunked: bool, withheld: bool = False) -> int:
    """POST /v1/completions with the body declared by Content-Length (not sent when `withheld`: a refusal must not
    wait for it) or sent in chunks; the status."""
    with connect(port) as sock:
        sock.sendall(completion_headers(None if chunked else len(body), chunked=chunked))
        if withheld:
            pass
        elif chunked:
            for start in range(0, len(body), 1000):
                part = body[start:start + 1000]
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            sock.sendall(b"0\r\n\r\n")
        else:
            sock.sendall(body)
        status, _, _ = read_response(sock)
    return status


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_of_exactly_the_limit_is_served_and_one_byte_more_is_413(running, chunked):
    port = http_port(running())
    assert send(port, body_of(LIMIT), chunked) == 200
    assert send(port, body_of(LIMIT + 1), chunked, withheld=not chunked) == 413


@pytest.fixture(scope="module")
def long_context_port(tmp_path_factory):
    """The fake engine with a chat template and a context long enough for MAX_CHAT_MESSAGES messages; its HTTP
    port."""
    tok_dir = tmp_path_factory.mktemp("tokenizer")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "chat_template": TEMPLATE}))
    rc = load_runtime_config(["+model=qwen3_tiny", "model.layout.max_model_len_cap=32768", "max_model_len=32768",
                              "server.port=0", "server.http_port=0",
                              "server.grace_period_s=5", f"server.http_max_body_bytes={8 << 20}"])
    rc = dataclasses.replace(rc, model=dataclasses.replace(rc.model, tokenizer=str(tok_dir / "tokenizer.json")))
    engine = FakeEngine(rc)
    engine.tokenizer = RecordingTokenizer()
    srv = test_server.Running(rc, engine)
    try:
        srv.wait_serving()
        yield http_port(srv)
    finally:
        srv.stop()


def test_a_declared_length_is_judged_at_its_exact_bound_before_authentication(running, base_rc):
    """The Content-Length check runs before anything else (auth included): one byte over is 413 without a token,
    the bound itself goes on to authentication (401)."""
    port = http_port(running(test_server.with_server(base_rc, auth_token="secret-token")))
    assert send(port, body_of(LIMIT + 1), chunked=False, withheld=True) == 413
    assert send(port, body_of(LIMIT), chunked=False) == 401


def test_exactly_the_most_chat_messages_are_served(long_context_port):
    status, answer = post(long_context_port, CHAT, chat(*[{"role": "user", "content": ""}] * MAX_CHAT_MESSAGES))
    assert status == 200, answer
    status, answer = post(long_context_port, CHAT, chat(*[{"role": "user", "content": ""}] * (MAX_CHAT_MESSAGES + 1)))
    assert status == 400 and answer["error"]["param"] == "messages", answer


def test_exactly_the_most_choices_are_served(long_context_port):
    status, answer = post(long_context_port, COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "n": MAX_CHOICES})
    assert status == 200, answer
    assert sorted(c["index"] for c in answer["choices"]) == list(range(MAX_CHOICES))
    for n in (0, MAX_CHOICES + 1):
        status, answer = post(long_context_port, COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "n": n})
        assert status == 400 and answer["error"]["param"] == "n", answer
