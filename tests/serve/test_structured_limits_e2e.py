"""Issue 32's structured-output repros against a real server (real engine, in-process, HTTP and gRPC): each is a
400 / INVALID_ARGUMENT naming its field with a short message, never a crash, a 500 or a stall; the keep-alive
connection that carried them goes on; a checkpoint whose tokenizer the grammar library cannot read refuses
structured output the same way."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import models, pre_tokenizers

from appliance.config.compose import load_runtime_config
from appliance.core.constraint import OutputConstraint
from appliance.engine.engine import Engine
from appliance.serve.convert import generate_request
from tests.core.test_grammar_bounds import ref_chain, rule_chain
from tests.serve.test_server import Running, rpc_error, wait_for
from tests.support.checkpoints import write_tiny_checkpoint

OVERRIDES = ["+model=qwen3_tiny", "device=cpu", "max_model_len=256", "max_num_seqs=8", "server.port=0",
             "server.http_port=0", "server.grace_period_s=2"]
SIX_HUNDRED_OPTIONAL = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
# name: (constraint body of /v1/completions, the field the 400 names)
HTTP_REPROS = {
    "3,000 nested rules": ({"structured_outputs": {"grammar": rule_chain(3000)}}, "structured_outputs.grammar"),
    "3,000 chained $refs": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": ref_chain(3000)}}}, "response_format.json_schema.schema"),
    "a{500}{500}": ({"structured_outputs": {"regex": "a{500}{500}"}}, "structured_outputs.regex"),
    "a{1000}{1000}": ({"structured_outputs": {"regex": "a{1000}{1000}"}}, "structured_outputs.regex"),
    "600 optional properties": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SIX_HUNDRED_OPTIONAL}}}, "response_format.json_schema.schema"),
    "20,000 alternatives": ({"structured_outputs": {"grammar": "start: " + " | ".join(
        f'"w{i}"' for i in range(20_000))}}, "structured_outputs.grammar"),
    "json nested 100,000 deep": ({"structured_outputs": {"json": "[" * 100_000 + "]" * 100_000}},
                                 "structured_outputs.json"),
    "a schema that only refers to itself": ({"structured_outputs": {"json": {"$ref": "#"}}},
                                            "structured_outputs.json"),
}


def serve(rc) -> Running:
    srv = Running(rc, Engine(rc))
    wait_for(lambda: srv.server.state != "starting" or not srv.thread.is_alive(), 300, "engine start")
    assert srv.server.state == "serving", f"server did not start: {srv.error!r}"
    return srv


@pytest.fixture(scope="module")
def server():
    srv = serve(load_runtime_config(OVERRIDES))
    yield srv
    srv.stop(60)


def post(conn: http.client.HTTPConnection, body: dict) -> tuple[int, bytes]:
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "The weather", "max_tokens": 8, **body}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read()


def test_every_http_repro_is_a_short_400_naming_its_field_on_one_kept_alive_connection(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http.port, timeout=120)
    for name, (body, field) in HTTP_REPROS.items():
        status, raw = post(conn, body)
        error = json.loads(raw)["error"]
        assert (status, error["param"]) == (400, field), (name, raw[:300])
        assert error["message"].startswith(f"{field}: ") and len(raw) < 1024, (name, raw[:300])
    conn.request("GET", "/health")
    assert conn.getresponse().read() == b'{"status":"serving"}'
    assert server.engine.grammars.num_live == 0 and server.engine.num_in_flight() == 0


def test_a_refusal_while_streaming_is_an_error_event_naming_the_field(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http.port, timeout=120)
    body, field = HTTP_REPROS["600 optional properties"]
    status, raw = post(conn, {**body, "stream": True})
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["param"] == field and "Current row has 2407 items" in error["message"]


@pytest.mark.parametrize("constraint", [
    OutputConstraint.grammar(rule_chain(3000), field="sampling.constraint.grammar"),
    OutputConstraint.json_schema(ref_chain(3000), field="sampling.constraint.json_schema"),
    OutputConstraint.json_schema("[" * 100_000 + "]" * 100_000, field="sampling.constraint.json_schema"),
    OutputConstraint.regex("a{500}{500}", field="sampling.constraint.regex"),
    OutputConstraint.json_schema(SIX_HUNDRED_OPTIONAL, field="sampling.constraint.json_schema"),
    OutputConstraint.json_schema({"$ref": "#"}, field="sampling.constraint.json_schema"),
], ids=["rule chain", "$ref chain", "nested json", "a{500}{500}", "600 optional properties", "self reference"])
def test_every_grpc_repro_is_invalid_argument_with_short_details(server, constraint):
    with server.client() as client:
        err = rpc_error(lambda: list(client.stub.Generate(generate_request([5, 6, 7], max_tokens=8,
                                                                           constraint=constraint), timeout=120)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith(f"{constraint.field}: ") and len(err.details()) < 1024
    assert ("invalid-field", constraint.field) in tuple(err.trailing_metadata())


def test_sixteen_exploding_regexes_are_refused_without_stalling_a_stream(server):
    """Issue 32 item 2: 16 concurrent `a{500}{500}` took 44 s and stalled an unrelated stream 3-5 s at a time. Now
    each is refused before it reaches the engine; the stream gets every token. (The gap bound is generous: a
    busy 2-core machine still decodes the tiny model many times a second.)"""
    port = server.server.http.port
    gaps: list[float] = []

    def stream() -> str:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "The weather", "max_tokens": 150,
                                                            "ignore_eos": True, "stream": True, "temperature": 0}),
                     {"Content-Type": "application/json"})
        response, last, events = conn.getresponse(), None, []
        for line in response:
            if line.startswith(b"data: "):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                events.append(line)
        return events[-1].decode().strip()

    def exploding(i: int) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        return post(conn, {"prompt": f"x{i}", "structured_outputs": {"regex": "a{500}{500}"}})[0]

    with ThreadPoolExecutor(17) as pool:
        streamed = pool.submit(stream)
        wait_for(lambda: gaps, 120, "the stream's first tokens")
        assert list(pool.map(exploding, range(16))) == [400] * 16
        assert streamed.result() == "data: [DONE]"
    assert max(gaps) < 2.0, max(gaps)


def test_a_tokenizer_without_a_decoder_refuses_structured_output_and_keeps_the_connection(tmp_path):
    """bench/make_tiny_qwen3.py's word-level tokenizer.json has no decoder: llguidance cannot read it. A constrained
    request was a plain-text 500 and broke the keep-alive connection; now it is a 400 naming the field, and the
    connection serves the next request."""
    rc = load_runtime_config(OVERRIDES)
    ckpt = write_tiny_checkpoint(tmp_path, rc.model, seed=0)
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"t{i}": i for i in range(2, rc.model.layout.vocab_size)}}
    word_level = HfTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.save(str(ckpt / "tokenizer.json"))
    srv = serve(load_runtime_config([*OVERRIDES, f"model.weights={ckpt}"]))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.server.http.port, timeout=120)
        for body in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "t[0-9]"}},
                     {"structured_outputs": {"choice": ["t5", "t6"]}}):
            status, raw = post(conn, {"prompt": "t5 t6", **body})
            error = json.loads(raw)["error"]
            assert status == 400 and "structured output is unavailable for this model" in error["message"], raw
        status, raw = post(conn, {"prompt": "t5 t6", "max_tokens": 3, "ignore_eos": True})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    finally:
        srv.stop(60)


def test_structured_output_still_works_beside_the_refusals(server):
    """The bounds refuse nothing ordinary: a schema, a regex and a grammar at once, each matched."""
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http.port, timeout=120)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    results = []
    for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}},
                 {"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}},
                 {"structured_outputs": {"grammar": 'start: "n=" /[0-9]{1,3}/ ";"'}}):
        status, raw = post(conn, {**body, "max_tokens": 40, "temperature": 0})
        assert status == 200, raw
        results.append(json.loads(raw)["choices"][0])
    assert all(r["finish_reason"] == "stop" for r in results)
    assert 0 <= json.loads(results[0]["text"])["n"] <= 9

