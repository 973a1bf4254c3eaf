"""HTTP front end against the fake engine, in-process: the lifecycle (503 while starting and draining, /health),
bearer token and TLS like gRPC, bind errors, disconnects that abort, engine failures, the Stats RPC."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import socket
import ssl
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.errors import ConfigError
from appliance.serve.api import appliance_pb2 as pb
from appliance.serve.ports import ServerBindError
from appliance.serve.server import ApplianceServer
from tests.serve import test_server
from tests.serve.certs import needs_openssl, self_signed_cert
from tests.serve.fake_engine import FakeEngine, fail_submit, fake_token
from tests.serve.test_server import Running, wait_for

running = test_server.running       # the fake-engine server fixture, here with this module's base_rc

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def base_rc():
    return load_runtime_config(["server.port=0", "server.http_port=0", "server.grace_period_s=5"])


def with_server(rc, **changes):
    return dataclasses.replace(rc, server=dataclasses.replace(rc.server, **changes))


def http_port(srv: Running, serving: bool = True) -> int:
    """The HTTP port of a fake-engine server (the `running` fixture, with this module's base_rc), once bound and,
    unless told otherwise, once serving."""
    wait_for(lambda: srv.server.http is not None and srv.server.http.port is not None, 10, "HTTP to bind")
    if serving:
        wait_for(lambda: srv.server.state == "serving", 10, "serving")
    return srv.server.http.port


def request(port: int, path: str, body: dict | None = None, headers: dict | None = None,
            context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    scheme = "https" if context else "http"
    req = urllib.request.Request(f"{scheme}://localhost:{port}{path}", method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=20, context=context) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def test_health_and_requests_follow_the_lifecycle(running):
    start_gate, drain_gate = threading.Event(), threading.Event()
    srv = running(start_gate=start_gate, drain_gate=drain_gate)
    port = http_port(srv, serving=False)
    assert request(port, "/health") == (503, {"status": "starting"})
    status, body = request(port, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 503 and "starting" in body["error"]["message"]
    start_gate.set()
    wait_for(lambda: request(port, "/health")[0] == 200, 10, "serving")
    status, body = request(port, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == "".join(chr(t) for t in _fake_tokens("hi", 3))
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}

    srv.server.request_shutdown()
    wait_for(lambda: srv.server.state == "draining", 10, "draining")
    assert request(port, "/health") == (503, {"status": "draining"})
    status, body = request(port, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 503 and body["error"]["type"] == "service_unavailable"
    drain_gate.set()
    srv.thread.join(20)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def _fake_tokens(prompt: str, n: int) -> list[int]:
    return [fake_token(list(prompt.encode()), i) for i in range(n)]


def test_bearer_token_like_grpc(base_rc, running):
    srv = running(with_server(base_rc, auth_token="s3cret"))
    port = http_port(srv)
    assert request(port, "/health")[0] == 200                              # probes need no token
    for path in ("/v1/models", "/metrics"):
        status, body = request(port, path)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert request(port, "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert request(port, "/v1/models", headers={"Authorization": "Bearer s3cret"})[0] == 200
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="s3cret", max_retries=0) as c:
        assert c.completions.create(model="deepseek-v4-tiny", prompt="ab", max_tokens=2).usage.completion_tokens == 2
        stats = srv.client(token="s3cret").stub.Stats(pb.StatsRequest(), timeout=5,
                                                      metadata=(("authorization", "Bearer s3cret"),))
    assert stats.state == "serving" and {g.name for g in stats.cache_groups} == \
        {s.name for s in base_rc.model.cache_groups}


@needs_openssl
def test_tls_like_grpc(base_rc, running, tmp_path):
    key, cert = self_signed_cert(tmp_path)
    srv = running(with_server(base_rc, tls_cert_file=str(cert), tls_key_file=str(key)))
    context = ssl.create_default_context(cafile=str(cert))
    assert request(http_port(srv), "/health", context=context) == (200, {"status": "serving"})
    with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError, urllib.error.URLError)):
        request(http_port(srv), "/health")                                 # plaintext is refused


def test_busy_http_port_is_a_bind_error_naming_the_key(base_rc):
    busy = socket.create_server(("127.0.0.1", 0))
    rc = with_server(base_rc, http_port=busy.getsockname()[1])
    server = ApplianceServer(rc, FakeEngine(rc))
    with pytest.raises(ServerBindError, match="server.host:server.http_port 127.0.0.1:"):
        asyncio.run(server.run())
    busy.close()


def test_http_port_null_serves_grpc_only(base_rc):
    rc = with_server(base_rc, http_port=None)
    srv = Running(rc, FakeEngine(rc))
    try:
        assert srv.server.http is None and srv.client().health() in ("NOT_SERVING", "SERVING")
    finally:
        srv.stop()


def _stream(port: int, body: dict) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                               "x-request-id": body["prompt"]})
    return conn


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(running, stream):
    srv = running(step_s=0.05)                  # 490 tokens take 25 s: only the abort ends the request early
    conn = _stream(http_port(srv), {"prompt": f"endless-{stream}", "max_tokens": 490, "stream": stream})
    wait_for(lambda: f"endless-{stream}" in srv.engine.requests, 10, "the request to be submitted")
    if stream:
        assert conn.getresponse().read(6) == b"data: "
    conn.close()
    wait_for(lambda: f"endless-{stream}" in srv.engine.aborted, 10, "the abort")
    wait_for(lambda: srv.engine.kv_free_blocks() == srv.engine.kv_total_blocks(), 10, "blocks back")


def test_engine_failure_is_500_or_an_error_event(running):
    port = http_port(running())
    status, body = request(port, "/v1/completions", {"prompt": "boom", "max_tokens": 5})
    assert status == 500 and "injected kernel failure" in body["error"]["message"]
    conn = _stream(port, {"prompt": "boom", "max_tokens": 5, "stream": True})
    events = [line for line in conn.getresponse().read().decode().split("\n\n") if line]
    assert "injected kernel failure" in events[-2] and events[-1] == "data: [DONE]"


def test_chat_without_a_template_is_400_naming_messages(running):
    """Random-weight Qwen3 has no template (its chat format comes with a checkpoint); DeepSeek V4 always has its
    released encoding."""
    qwen3 = load_runtime_config(["+model=qwen3_tiny", "server.port=0", "server.http_port=0"])
    status, body = request(http_port(running(qwen3)), "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "messages" and "no chat template" in body["error"]["message"]
    status, body = request(http_port(running()), "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


def test_queue_full_is_429(running):
    port = http_port(running(max_requests=1, step_s=0.05))
    conn = _stream(port, {"prompt": "holder", "max_tokens": 490, "stream": True})
    assert conn.getresponse().status == 200
    status, body = request(port, "/v1/completions", {"prompt": "next", "max_tokens": 2})
    assert status == 429 and "wait queue full" in body["error"]["message"]
    conn.close()


def test_a_broken_chat_template_stops_startup_naming_the_file(base_rc, tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    model = dataclasses.replace(base_rc.model, tokenizer=str(tmp_path / "tokenizer.json"))
    rc = dataclasses.replace(base_rc, model=model)
    server = ApplianceServer(rc, FakeEngine(rc))
    with pytest.raises(ConfigError, match="tokenizer_config.json .chat_template. does not compile"):
        asyncio.run(server.run())


def _abort_once_running(srv: Running, request_id: str) -> threading.Thread:
    """The server side aborts the request once it runs (what a drain past its grace period does)."""
    def abort():
        wait_for(lambda: request_id in srv.engine.requests, 10, "the request to run")
        srv.engine.abort(request_id)
    thread = threading.Thread(target=abort, daemon=True)
    thread.start()
    return thread


def test_a_stream_the_server_aborts_ends_with_an_error_event_not_a_finish_reason(running):
    """OpenAI has no finish_reason for "cut short by the server" ("abort" is vLLM's, outside the spec): the stream
    ends with an error event, which the openai client raises as APIError, so the partial text is not taken as whole."""
    srv = running(step_s=0.05)
    port = http_port(srv)
    _abort_once_running(srv, "cut-short-stream")
    chunks = []
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.APIError) as info:
            for chunk in c.completions.create(model="deepseek-v4-tiny", prompt="hi", max_tokens=400, stream=True,
                                              extra_headers={"x-request-id": "cut-short-stream"}):
                chunks.append(chunk)
    assert "aborted" in info.value.message and info.value.body["code"] == "request_aborted"
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks)

    _abort_once_running(srv, "cut-short-raw")
    conn = _stream(port, {"prompt": "cut-short-raw", "max_tokens": 400, "stream": True})
    events = [e for e in conn.getresponse().read().decode().split("\n\n") if e]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "request_aborted"
    assert events[-1] == "data: [DONE]" and '"abort"' not in "".join(events)


def test_a_request_the_server_aborts_is_a_503_not_a_200(running):
    srv = running(step_s=0.05)
    _abort_once_running(srv, "cut-short")
    status, body = request(http_port(srv), "/v1/completions", {"prompt": "hi", "max_tokens": 400},
                           headers={"x-request-id": "cut-short"})
    assert status == 503 and body["error"]["code"] == "request_aborted"


def test_a_kept_alive_connection_answers_without_nagles_delay(running):
    """Issue 32 item 5: a response goes out as two writes (headers, then body); without TCP_NODELAY the body
    waited for the client's delayed ACK, 40 ms on every request but a connection's first. The best of five
    round trips after the first: Nagle's delay is a floor under all five, machine load is not."""
    conn = http.client.HTTPConnection("127.0.0.1", http_port(running()), timeout=20)

    def round_trip() -> float:
        start = time.perf_counter()
        conn.request("GET", "/v1/models")
        assert conn.getresponse().read()
        return time.perf_counter() - start
    round_trip()                          # a fresh connection is not delayed (its first ACK is not)
    assert min(round_trip() for _ in range(5)) < 0.020
    conn.close()


def test_detokenize_decodes_off_the_event_loop(running):
    """Decoding a million ids takes a second: /health must answer while it runs (here: while it is held)."""
    srv = running()
    port = http_port(srv)
    decoding, release, decode = threading.Event(), threading.Event(), srv.engine.tokenizer.decode

    def held_decode(ids):
        decoding.set()
        release.wait(30)
        return decode(ids)
    srv.engine.tokenizer.decode = held_decode
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(request, port, "/detokenize", {"tokens": [104, 105]})
        try:
            assert decoding.wait(20)
            assert request(port, "/health") == (200, {"status": "serving"})
        finally:
            release.set()
        assert answer.result() == (200, {"prompt": "hi"})
    assert request(port, "/detokenize", {"tokens": [104, 999]})[1]["error"]["param"] == "tokens"


def test_an_unexpected_submit_failure_is_a_json_500_and_the_connection_goes_on(running):
    """A fault inside submit that is not a refusal (e.g. a library's ValueError) was a plain-text 500 that closed
    the kept-alive connection."""
    srv = running()
    conn = http.client.HTTPConnection("127.0.0.1", http_port(srv), timeout=20)
    fail_submit(srv.engine, "fail", ValueError("can't determine decoder type: None"))
    for prompt, status in (("fail", 500), ("hi", 200)):
        conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 2}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        body = json.loads(response.read())
        assert response.status == status, body
    assert body["choices"][0]["text"] == "".join(chr(t) for t in _fake_tokens("hi", 2))


@pytest.mark.parametrize("parameters, param", [
    ({"type": "object", "properties": [1, 2]}, "tools[1].function.parameters.properties"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": 5},
     "tools[1].function.parameters.required"),
])
def test_tool_parameters_the_call_grammar_cannot_read_are_400_naming_them(running, parameters, param):
    """tool_choice required builds a grammar from every tool's parameters (DeepSeek V4's DSML format here)."""
    tools = [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "bad", "parameters": parameters}}]
    status, body = request(http_port(running()), "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "tools": tools, "tool_choice": "required"})
    assert status == 400 and body["error"]["param"] == param, body
