"""gRPC server against a fake engine: status codes, health transitions, auth, TLS, cancel, drain, signals.

The fake (tests/serve/fake_engine.py) keeps the engine's interface and its request validation, so every fault
path of the server runs in-process in a few seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from appliance.client import ApplianceClient
from appliance.client import main as client_main
from appliance.config.compose import load_runtime_config
from appliance.core.planner import InsufficientMemoryError
from appliance.core.request import (
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    FinishReason,
    RequestOutput,
    Usage,
)
from appliance.core.units import human_bytes
from appliance.serve.api import appliance_pb2 as pb
from appliance.serve.convert import generate_request
from appliance.serve.ports import ServerBindError
from appliance.serve.server import ApplianceServer
from appliance.serve.streams import coalesce

REPO = Path(__file__).resolve().parents[2]


from tests.serve.certs import needs_openssl, self_signed_cert  # noqa: E402
from tests.serve.fake_engine import FakeEngine, fail_submit, fake_token  # noqa: E402


def expected_tokens(prompt: str, n: int) -> list[int]:
    ids = list(prompt.encode())
    return [fake_token(ids, i) for i in range(n)]


# -- harness ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_rc():
    return load_runtime_config(["server.port=0", "server.http_port=null", "server.grace_period_s=5"])


def with_server(rc, **changes):
    return dataclasses.replace(rc, server=dataclasses.replace(rc.server, **changes))


class Running:
    """An ApplianceServer on its own event loop thread."""

    def __init__(self, rc, engine, output_dir=None):
        self.engine = engine
        self.server = ApplianceServer(rc, engine, output_dir)
        self.result = None
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while self.server.port is None:
            assert time.monotonic() < deadline and self.thread.is_alive(), f"server did not bind: {self.error}"
            time.sleep(0.01)
        self.address = self.server.address

    def _run(self):
        try:
            self.result = asyncio.run(self.server.run())
        except BaseException as exc:    # noqa: BLE001 - reported by the test
            self.error = exc

    def client(self, **kw) -> ApplianceClient:
        return ApplianceClient(self.address, **kw)

    def wait_serving(self, timeout: float = 120):
        """Wait for the state, not for a time: requests sent before SERVING are answered UNAVAILABLE."""
        wait_for(lambda: self.server.state != "starting" or not self.thread.is_alive(), timeout, "SERVING")
        assert self.server.state == "serving", f"server did not start: {self.error!r}"

    def stop(self, timeout: float = 20):
        self.server.request_shutdown()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server did not stop"


@pytest.fixture
def running(base_rc):
    """start(rc, **engine_kw) -> a Running server, already SERVING unless the test holds or fails the start."""
    servers = []

    def start(rc=None, output_dir=None, **engine_kw):
        rc = rc or base_rc
        srv = Running(rc, FakeEngine(rc, **engine_kw), output_dir)
        servers.append(srv)
        if engine_kw.get("start_gate") is None and engine_kw.get("start_error") is None:
            srv.wait_serving()
        return srv
    yield start
    for srv in servers:
        if srv.thread.is_alive():
            srv.stop()


def wait_for(cond, timeout=30.0, what="condition"):
    """Poll a state; the timeout only ends a hung test (it is no statement about speed)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def signal_startup_waits(srv: Running) -> threading.Event:
    """An Event set when a Startup call starts waiting on the server for the engine start: the test then knows
    the call is held there (a state), instead of sleeping and hoping it arrived."""
    waiting, ready = threading.Event(), srv.server.ready
    wait_for_start = ready.wait

    async def signalling_wait():
        waiting.set()
        return await wait_for_start()
    ready.wait = signalling_wait
    return waiting


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


# -- tests -----------------------------------------------------------------------------------------------

def test_health_and_startup_follow_the_engine_lifecycle(running):
    start_gate, drain_gate = threading.Event(), threading.Event()
    srv = running(start_gate=start_gate, drain_gate=drain_gate)
    c = srv.client()
    assert c.health() == "NOT_SERVING"
    assert c.health("appliance.v1.Appliance") == "NOT_SERVING"
    assert rpc_error(lambda: c.complete("hi")).code() == grpc.StatusCode.UNAVAILABLE
    assert rpc_error(lambda: c.startup(timeout=0.3)).code() == grpc.StatusCode.DEADLINE_EXCEEDED

    waited = {}
    held = signal_startup_waits(srv)
    waiter = threading.Thread(target=lambda: waited.update(resp=c.startup(timeout=20)))
    waiter.start()
    assert held.wait(20), "the Startup call never reached the server"
    assert waiter.is_alive() and not waited, "Startup must wait while the engine starts"
    start_gate.set()
    waiter.join(20)
    assert waited["resp"].model_name == srv.engine.report.model_name
    wait_for(lambda: c.health() == "SERVING", what="SERVING")
    assert c.health("appliance.v1.Appliance") == "SERVING"
    assert c.complete("hi", max_tokens=2)[2].finish_reason == FinishReason.LENGTH

    srv.server.request_shutdown()
    wait_for(lambda: srv.engine.draining, what="drain")
    assert c.health() == "NOT_SERVING"
    err = rpc_error(lambda: c.complete("hi"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.details()
    drain_gate.set()
    srv.thread.join(20)
    assert srv.result["status"] == "ok" and srv.error is None
    assert srv.engine.drain_calls == [5.0] and srv.engine.shutdown_called


def test_engine_start_failure_fails_the_server_and_waiting_startup_calls(running):
    gate = threading.Event()
    srv = running(start_gate=gate, start_error=InsufficientMemoryError("device cpu:0: budget too small"))
    c = srv.client()
    waited = {}

    def call_startup():
        try:
            c.startup(timeout=20)
        except grpc.RpcError as exc:
            waited["err"] = exc
    held = signal_startup_waits(srv)
    waiter = threading.Thread(target=call_startup)
    waiter.start()
    assert held.wait(20), "the Startup call never reached the server"
    gate.set()
    waiter.join(20)
    srv.thread.join(20)
    assert waited["err"].code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "budget too small" in waited["err"].details()
    assert isinstance(srv.error, InsufficientMemoryError) and srv.result is None


def test_shutdown_during_engine_start_stops_without_serving(running):
    gate = threading.Event()
    srv = running(start_gate=gate)
    assert srv.client().health() == "NOT_SERVING"
    srv.stop()
    gate.set()
    assert srv.result["status"] == "interrupted" and srv.error is None
    assert not srv.engine.drain_calls


def test_busy_port_is_a_clear_error(base_rc):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        rc = with_server(base_rc, port=port)
        with pytest.raises(ServerBindError) as err:
            asyncio.run(ApplianceServer(rc, FakeEngine(rc)).run())
    assert f"server.host=127.0.0.1 server.port={port}: the port is in use" in str(err.value)
    assert "Fix: pick a free port, e.g. server.port=" in str(err.value)


def test_coalesce_merges_queued_deltas_and_keeps_the_finish():
    q: asyncio.Queue = asyncio.Queue()
    for out in (RequestOutput("r", (2,), "b"), RequestOutput("r", (3,), "c", FinishReason.EOS, Usage(1, 3, 0)),
                RequestOutput("other", (9,), "z")):
        q.put_nowait(out)
    merged = coalesce(RequestOutput("r", (1,), "a"), q)
    assert merged == RequestOutput("r", (1, 2, 3), "abc", FinishReason.EOS, Usage(1, 3, 0))
    assert q.qsize() == 1                       # stops at the finished delta
    assert coalesce(RequestOutput("r", (), "", FinishReason.STOP), q).new_token_ids == ()


def test_startup_response_carries_the_allocation(running):
    srv = running()
    with srv.client() as c:
        r = c.startup(timeout=10)
    plan = srv.engine.report.plan
    rc = srv.server.rc
    assert (r.model_name, r.arch, r.device_kind, r.device_count) == (rc.model.name, rc.model.arch, "cpu", 1)
    assert (r.decode_batch, r.block_size, r.max_model_len) == (rc.decode_batch, rc.block_size, rc.max_model_len)
    assert r.npu_memory_utilization == pytest.approx(rc.npu_memory_utilization)
    assert (r.capacity_slots, r.bytes_per_slot, r.scratch_bytes) == (4, plan.bytes_per_slot, plan.scratch_bytes)
    assert r.max_concurrency == 4 and r.kv_tokens_per_device == 4 * rc.max_model_len
    assert r.override == "num_slots_override=4"
    assert [d.total_bytes for d in r.devices] == [1 << 30]
    assert [d.peak_non_kv_bytes for d in r.devices] == [100 << 20]
    specs = {s.name: s for s in rc.model.cache_groups}
    assert [g.name for g in r.cache_groups] == list(specs)
    for g in r.cache_groups:
        s = specs[g.name]
        assert g.num_blocks == 4 * s.max_blocks_per_seq == srv.engine.kv_total_blocks()[g.name]
        assert (g.layers, g.rows_per_block, g.page_size_bytes) == (s.num_layers, s.rows_per_block, s.page_size_bytes)
        assert g.history == (pb.HISTORY_KIND_RING if s.is_ring else pb.HISTORY_KIND_FULL)
        assert g.total_bytes == 4 * s.max_memory_usage_bytes
    assert r.resolved_config_yaml == rc.resolved_yaml and "fake engine" in r.notes


def test_generate_streams_deltas_then_finish_and_usage(running):
    srv = running()
    with srv.client() as c:
        deltas = list(c.generate("hello", max_tokens=5, request_id="r1"))
        by_ids = list(c.generate(list(b"hello"), max_tokens=5))
        call = c.stub.Generate(generate_request("hello", request_id="r2", max_tokens=1))
        assert dict(call.initial_metadata())["request-id"] == "r2"      # sent on acceptance
        assert [m.request_id for m in call] == ["r2"]
    # A slow reader may get several tokens in one delta (the stream coalesces what is queued): count tokens.
    assert 1 <= len(deltas) <= 5 and all(d.request_id == "r1" and d.new_token_ids for d in deltas)
    assert [t for d in deltas for t in d.new_token_ids] == expected_tokens("hello", 5)
    assert "".join(d.new_text for d in deltas) == bytes(expected_tokens("hello", 5)).decode()
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert deltas[-1].usage == Usage(prompt_tokens=5, completion_tokens=5, cached_prompt_tokens=0)
    assert [t for d in by_ids for t in d.new_token_ids] == expected_tokens("hello", 5)
    assert by_ids[0].request_id and by_ids[0].request_id != "r1"      # server-assigned id


@pytest.mark.parametrize("prompt, kw, field", [
    ("", {}, "prompt"),
    (None, {}, "prompt"),
    ([1, 2, 300], {}, "prompt_token_ids"),
    ("x" * 5000, {"max_tokens": 1}, "prompt"),                 # more bytes than max_model_len tokens can hold
    ("hi", {"max_tokens": 0}, "sampling.max_tokens"),
    ("hi", {"max_tokens": -3}, "sampling.max_tokens"),
    ("hi", {"max_tokens": 100_000}, "sampling.max_tokens"),
    ("hi", {"temperature": -0.5}, "sampling.temperature"),
    ("hi", {"temperature": float("nan")}, "sampling.temperature"),
    ("hi", {"temperature": float("inf")}, "sampling.temperature"),
    ("hi", {"top_p": 0.0}, "sampling.top_p"),
    ("hi", {"top_p": 1.5}, "sampling.top_p"),
    ("hi", {"top_p": float("nan")}, "sampling.top_p"),
    ("hi", {"top_k": -1}, "sampling.top_k"),
    ("hi", {"stop": [""]}, "sampling.stop[0]"),
    ("hi", {"stop": ["a", ""]}, "sampling.stop[1]"),
    ("hi", {"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "sampling.stop"),
    ("hi", {"stop": ["s" * (MAX_STOP_STRING_CHARS + 1)]}, "sampling.stop[0]"),
    ("hi", {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "sampling.stop_token_ids"),
    ("hi", {"stop_token_ids": [256]}, "sampling.stop_token_ids"),
    ("hi", {"request_id": "line\nbreak"}, "request_id"),
    ("hi", {"request_id": "caf\u00e9"}, "request_id"),
    ("hi", {"request_id": "r" * (MAX_REQUEST_ID_CHARS + 1)}, "request_id"),
])
def test_bad_requests_are_invalid_argument_naming_the_field(running, prompt, kw, field):
    srv = running()
    stub = srv.client().stub
    req = generate_request(prompt if prompt is not None else "x", **kw)
    if prompt is None:
        req.ClearField("text")
    err = rpc_error(lambda: list(stub.Generate(req, timeout=10)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.details()
    assert ("invalid-field", field) in tuple(err.trailing_metadata())
    assert not srv.engine.requests                                   # refused before it was submitted
    assert srv.engine.kv_free_blocks() == srv.engine.kv_total_blocks()


def test_request_id_limits_accept_the_longest_printable_id(running):
    srv = running()
    longest = "".join(chr(32 + i % 95) for i in range(MAX_REQUEST_ID_CHARS))
    call = srv.client().stub.Generate(generate_request("hi", request_id=longest, max_tokens=2), timeout=10)
    assert [m.request_id for m in call] == [longest, longest]


@pytest.mark.parametrize("method, payload", [
    ("/appliance.v1.Appliance/Generate", b"\xff\xff\xff"),                  # corrupt wire format
    ("/appliance.v1.Appliance/Generate", b"\x0a\x02\xff\xfe"),              # request_id with invalid UTF-8
    ("/appliance.v1.Appliance/Generate", b"\x12\x03\xc3\x28a"),             # prompt text with invalid UTF-8
    ("/appliance.v1.Appliance/Startup", b"\xff\xff\xff"),
    ("/grpc.health.v1.Health/Check", b"\x0a\x01\xff"),
])
def test_malformed_messages_are_invalid_argument(running, method, payload):
    srv = running()
    channel = grpc.insecure_channel(srv.address)
    raw = (channel.unary_stream if method.endswith("Generate") else channel.unary_unary)(method)
    err = rpc_error(lambda: list(raw(payload, timeout=10)) if method.endswith("Generate") else raw(payload, timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "malformed request message" in err.details()
    assert srv.client().complete("hi", max_tokens=2)[0] == expected_tokens("hi", 2)   # the server goes on
    channel.close()


def test_a_malformed_message_in_a_request_stream_is_invalid_argument(running):
    """Reflection reads a stream of requests: one that does not parse ends it INVALID_ARGUMENT (it was UNKNOWN)."""
    srv = running()
    channel = grpc.insecure_channel(srv.address)
    reflect = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    err = rpc_error(lambda: list(reflect(iter([b"\xff\xff\xff\x07garbage"]), timeout=10)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed request message" in err.details(), err
    channel.close()


def test_an_unexpected_submit_failure_is_internal_not_unknown(running):
    srv = running()
    fail_submit(srv.engine, "fail", ValueError("can't determine decoder type: None"))
    c = srv.client()
    err = rpc_error(lambda: c.complete("fail", max_tokens=2))
    assert err.code() == grpc.StatusCode.INTERNAL and "ValueError: can't determine decoder type" in err.details()
    assert c.complete("hi", max_tokens=2)[0] == expected_tokens("hi", 2)


def test_duplicate_request_id_in_flight_is_invalid_argument(running):
    srv = running(step_s=0.05)
    c = srv.client()
    first = c.generate("a", max_tokens=200, request_id="dup")
    next(first)
    err = rpc_error(lambda: c.complete("b", request_id="dup"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.details()
    first.close()


def test_full_wait_queue_is_resource_exhausted(running):
    srv = running(step_s=0.05, max_requests=2)
    c = srv.client()
    streams = [c.generate("a", max_tokens=200) for _ in range(2)]
    for s in streams:
        next(s)
    err = rpc_error(lambda: c.complete("b"))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for s in streams:
        s.close()
    wait_for(lambda: not srv.engine.requests, what="aborts")
    assert c.complete("b", max_tokens=1)[2].finish_reason == FinishReason.LENGTH


def test_client_cancel_aborts_the_request_and_frees_its_blocks(running):
    srv = running(step_s=0.02)
    c = srv.client()
    stream = c.generate("a", max_tokens=400, request_id="cancel-me")
    next(stream)
    assert srv.engine.kv_free_blocks() != srv.engine.kv_total_blocks()
    stream.close()                                   # cancels the call
    wait_for(lambda: "cancel-me" in srv.engine.aborted, what="abort")
    assert srv.engine.kv_free_blocks() == srv.engine.kv_total_blocks()


def test_client_deadline_aborts_the_request(running):
    srv = running(step_s=3600)                       # the engine never steps: only the deadline ends the call
    c = srv.client()
    ended = {}

    def call():
        try:
            list(c.generate("a", max_tokens=400, request_id="slow", timeout=3))
        except grpc.RpcError as exc:
            ended["code"] = exc.code()
    caller = threading.Thread(target=call)
    caller.start()
    wait_for(lambda: "slow" in srv.engine.requests, what="the request in the engine")
    caller.join(30)
    assert ended == {"code": grpc.StatusCode.DEADLINE_EXCEEDED}
    wait_for(lambda: "slow" in srv.engine.aborted, what="abort")
    assert srv.engine.kv_free_blocks() == srv.engine.kv_total_blocks()


def test_a_request_failing_inside_the_engine_fails_alone(running):
    srv = running(step_s=0.01)
    c = srv.client()
    healthy = c.generate("fine", max_tokens=30)
    next(healthy)
    err = rpc_error(lambda: c.complete("boom", max_tokens=30))
    assert err.code() == grpc.StatusCode.INTERNAL and "injected kernel failure" in err.details()
    rest = list(healthy)
    assert rest[-1].finish_reason == FinishReason.LENGTH and rest[-1].usage.completion_tokens == 30
    assert c.health() == "SERVING"


def test_many_concurrent_streams(running):
    srv = running(step_s=0.001)
    c = srv.client()
    prompts = [f"prompt {i}" for i in range(48)]
    results: dict[str, list[int]] = {}

    def one(p):
        results[p] = c.complete(p, max_tokens=12)[0]
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {p: expected_tokens(p, 12) for p in prompts}


def test_drain_lets_in_flight_requests_finish(running):
    srv = running(step_s=0.01)
    c = srv.client()
    stream = c.generate("x", max_tokens=40)
    first = next(stream)
    srv.server.request_shutdown()
    rest = list(stream)
    assert rest[-1].finish_reason == FinishReason.LENGTH
    assert len(first.new_token_ids) + sum(len(d.new_token_ids) for d in rest) == 40
    srv.thread.join(20)
    assert srv.result["status"] == "ok" and srv.engine.shutdown_called


def test_drain_grace_expiry_aborts_the_rest(base_rc, running):
    srv = running(with_server(base_rc, grace_period_s=0.2), step_s=0.05)
    c = srv.client()
    stream = c.generate("x", max_tokens=400)
    next(stream)
    srv.server.request_shutdown()
    rest = list(stream)
    assert rest[-1].finish_reason == FinishReason.ABORTED
    srv.thread.join(20)
    assert srv.result["status"] == "ok"


def test_bearer_token(base_rc, running):
    srv = running(with_server(base_rc, auth_token="s3cret"))
    anonymous, wrong, right = srv.client(), srv.client(token="nope"), srv.client(token="s3cret")
    assert anonymous.health() in ("NOT_SERVING", "SERVING")       # probes need no token
    for c in (anonymous, wrong):
        assert rpc_error(lambda: c.complete("hi")).code() == grpc.StatusCode.UNAUTHENTICATED
        assert rpc_error(lambda: c.startup(timeout=10)).code() == grpc.StatusCode.UNAUTHENTICATED
    assert right.startup(timeout=10).capacity_slots == 4
    assert right.complete("hi", max_tokens=3)[0] == expected_tokens("hi", 3)
    # A method that does not exist tells a caller without the token nothing (UNIMPLEMENTED would list the API).
    channel = grpc.insecure_channel(srv.address)
    unary = channel.unary_unary("/appliance.v1.Appliance/NoSuchMethod")
    stream = channel.stream_stream("/no.such.Service/Stream")
    for call in (lambda md: unary(b"", timeout=10, metadata=md),
                 lambda md: list(stream(iter([b""]), timeout=10, metadata=md))):
        assert rpc_error(lambda: call(None)).code() == grpc.StatusCode.UNAUTHENTICATED
        assert rpc_error(lambda: call((("authorization", "Bearer s3cret"),))).code() == grpc.StatusCode.UNIMPLEMENTED
    channel.close()


def test_the_token_is_never_returned_or_written(running, tmp_path, capsys):
    token = "Tok3n-0f-the-day"
    rc = load_runtime_config(["server.port=0", "server.http_port=null", f"server.auth_token={token}"])
    srv = running(rc, output_dir=tmp_path)
    resp = srv.client(token=token).startup(timeout=10)
    assert token not in resp.resolved_config_yaml and "auth_token: '***'" in resp.resolved_config_yaml
    written = (tmp_path / "startup_report.json").read_text()
    assert token not in written and "auth_token: '***'" in written
    srv.stop()
    assert token not in "".join(capsys.readouterr())


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_ipv6_literal_hosts_with_or_without_brackets(base_rc, running, host):
    srv = running(with_server(base_rc, host=host))
    assert srv.address == f"[::1]:{srv.server.port}"
    assert srv.client().complete("hi", max_tokens=2)[0] == expected_tokens("hi", 2)


def test_reflection_lists_and_describes_the_services(running):
    srv = running()
    channel = grpc.insecure_channel(srv.address)
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="appliance.v1.Appliance")]
    listed, described = list(stub.ServerReflectionInfo(iter(reqs), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {"appliance.v1.Appliance", "grpc.health.v1.Health"} <= names
    from google.protobuf import descriptor_pb2
    fd = descriptor_pb2.FileDescriptorProto.FromString(described.file_descriptor_response.file_descriptor_proto[0])
    assert fd.package == "appliance.v1"
    assert [m.name for m in fd.service[0].method] == ["Startup", "Generate", "Stats"]
    channel.close()


def test_max_message_bytes_is_enforced(base_rc, running):
    srv = running(with_server(base_rc, max_message_bytes=1024))
    c = ApplianceClient(srv.address, max_message_bytes=1 << 20)
    err = rpc_error(lambda: c.complete("y" * 4096, max_tokens=1))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert c.complete("y" * 100, max_tokens=2)[0] == expected_tokens("y" * 100, 2)


@needs_openssl
def test_tls(base_rc, running, tmp_path):
    key, cert = self_signed_cert(tmp_path)
    srv = running(with_server(base_rc, tls_cert_file=str(cert), tls_key_file=str(key)))
    secure = ApplianceClient(srv.address, root_cert=cert, server_name="localhost")
    assert secure.startup(timeout=10).capacity_slots == 4
    plain = srv.client()
    assert rpc_error(lambda: plain.health(timeout=2)).code() == grpc.StatusCode.UNAVAILABLE


def shown_numbers(msg) -> list[str]:
    """How every number of a Startup message (nested ones too) reads in the terminal tables."""
    out = []
    for field, value in msg.ListFields():
        if field.type == field.TYPE_MESSAGE:
            for item in value if field.is_repeated else [value]:
                out += shown_numbers(item)
        elif field.type == field.TYPE_ENUM or field.is_repeated or isinstance(value, str):
            continue
        elif field.name.endswith("_seconds"):
            out.append(f"{value:.2f} s")
        elif field.name == "share_of_budget":
            out.append(f"{value:.1%}")
        elif field.name == "npu_memory_utilization":
            out.append(f"utilization {value:g}")
        elif field.containing_type.name == "DeviceMemory":
            out.append(human_bytes(value))
        else:
            out.append(f"{value:,}")
    return out


def test_client_cli(running, capsys):
    srv = running()
    assert client_main(["--address", srv.address, "--startup"]) == 0
    out = capsys.readouterr().out
    rc = srv.server.rc
    assert f"{rc.model.name} ({rc.model.arch})" in out
    msg = srv.client().startup(timeout=10)
    numbers = shown_numbers(msg)
    assert len(numbers) > 40 and [n for n in numbers if n not in out] == []
    unused = msg.budget_bytes - msg.scratch_bytes - msg.kv_cache_bytes
    assert f"+ unused {unused:,} B" in out
    for g in rc.model.cache_groups:
        assert g.name in out
    assert client_main(["--address", srv.address, "--max-tokens", "6", "hello"]) == 0
    captured = capsys.readouterr()
    assert captured.out == bytes(expected_tokens("hello", 6)).decode() + "\n"
    assert "[length: prompt 5, completion 6" in captured.err
    assert client_main(["--address", srv.address, "--max-tokens", "0", "hello"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    assert client_main(["--address", srv.address, "--health"]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"


SIGTERM_SCRIPT = """
from tests.serve.fake_engine import FakeEngine
from appliance.config.compose import load_runtime_config
from appliance.serve.server import serve
rc = load_runtime_config(["server.port=0", "server.http_port=0", "server.grace_period_s=5"])
engine = FakeEngine(rc, step_s=0.01)
result = serve(rc, engine)
print("result", result["status"], "shutdown", engine.shutdown_called, "drained", engine.drain_calls, flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_and_exits_zero(sig):
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        lines = []
        address = None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("listening on "):
                address = line.split()[2]
            if line.startswith("SERVING on "):
                break
        assert address, "".join(lines)
        c = ApplianceClient(address)
        assert c.health() == "SERVING"
        stream = c.generate("x", max_tokens=60)
        next(stream)
        proc.send_signal(sig)
        rest = list(stream)                       # the in-flight request finishes during the drain
        assert rest[-1].finish_reason == FinishReason.LENGTH
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(lines) + out
    assert "result ok shutdown True drained [5.0]" in out


@pytest.mark.parametrize("args", [["--health"], ["--startup"], ["hello"]])
def test_client_without_a_server_says_how_to_start_one(capsys, args):
    import socket
    with socket.socket() as sock:            # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    assert client_main(["--address", address, *args]) == 1
    err = capsys.readouterr().err
    assert f"no appliance server answers at {address}" in err
    assert "python -m appliance" in err and "--address" in err and "Traceback" not in err


def test_startup_report_round_trips_through_the_response(running):
    from appliance.serve.convert import startup_report, startup_response
    srv = running()
    report = srv.engine.report
    assert startup_report(startup_response(report)) == report
