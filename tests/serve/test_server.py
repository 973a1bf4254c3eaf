"""gRPC server against a fake engine: status codes, health transitions, auth, TLS, cancel, drain, signals.

The fake (tests/serve/fake_engine.py) keeps the engine's interface and its request validation, so every fault
path of the server runs in-process in a few seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
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
from appliance.core.request import FinishReason, RequestOutput, Usage
from appliance.serve.api import appliance_pb2 as pb
from appliance.serve.convert import generate_request
from appliance.serve.server import ApplianceServer, ServerBindError, coalesce

REPO = Path(__file__).resolve().parents[2]


from tests.serve.fake_engine import FakeEngine, fake_token  # noqa: E402


def expected_tokens(prompt: str, n: int) -> list[int]:
    ids = list(prompt.encode())
    return [fake_token(ids, i) for i in range(n)]


# -- harness ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_rc():
    return load_runtime_config(["server.port=0", "server.grace_period_s=5"])


def with_server(rc, **changes):
    return dataclasses.replace(rc, server=dataclasses.replace(rc.server, **changes))


class Running:
    """An ApplianceServer on its own event loop thread."""

    def __init__(self, rc, engine):
        self.engine = engine
        self.server = ApplianceServer(rc, engine)
        self.result = None
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while self.server.port is None:
            assert time.monotonic() < deadline and self.thread.is_alive(), f"server did not bind: {self.error}"
            time.sleep(0.01)
        self.address = f"127.0.0.1:{self.server.port}"

    def _run(self):
        try:
            self.result = asyncio.run(self.server.run())
        except BaseException as exc:    # noqa: BLE001 - reported by the test
            self.error = exc

    def client(self, **kw) -> ApplianceClient:
        return ApplianceClient(self.address, **kw)

    def stop(self, timeout: float = 20):
        self.server.request_shutdown()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server did not stop"


@pytest.fixture
def running(base_rc):
    servers = []

    def start(rc=None, **engine_kw):
        rc = rc or base_rc
        srv = Running(rc, FakeEngine(rc, **engine_kw))
        servers.append(srv)
        return srv
    yield start
    for srv in servers:
        if srv.thread.is_alive():
            srv.stop()


def wait_for(cond, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


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
    waiter = threading.Thread(target=lambda: waited.update(resp=c.startup(timeout=20)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive(), "Startup must wait while the engine starts"
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
    waiter = threading.Thread(target=call_startup)
    waiter.start()
    time.sleep(0.2)
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
        rc = with_server(base_rc, port=sock.getsockname()[1])
        with pytest.raises(ServerBindError, match="server.host:server.port 127.0.0.1:"):
            asyncio.run(ApplianceServer(rc, FakeEngine(rc)).run())


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
    assert [d.request_id for d in deltas] == ["r1"] * 5
    assert [t for d in deltas for t in d.new_token_ids] == expected_tokens("hello", 5)
    assert "".join(d.new_text for d in deltas) == bytes(expected_tokens("hello", 5)).decode()
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert deltas[-1].usage == Usage(prompt_tokens=5, completion_tokens=5, cached_prompt_tokens=0)
    assert [t for d in by_ids for t in d.new_token_ids] == expected_tokens("hello", 5)
    assert by_ids[0].request_id and by_ids[0].request_id != "r1"      # server-assigned id


@pytest.mark.parametrize("prompt, sampling, field", [
    ("", {}, "prompt"),
    (None, {}, "prompt"),
    ([1, 2, 300], {}, "prompt_token_ids"),
    ("hi", {"max_tokens": 0}, "sampling.max_tokens"),
    ("hi", {"max_tokens": -3}, "sampling.max_tokens"),
    ("hi", {"max_tokens": 100_000}, "sampling.max_tokens"),
    ("hi", {"temperature": -0.5}, "sampling.temperature"),
    ("hi", {"top_p": 0.0}, "sampling.top_p"),
    ("hi", {"top_p": 1.5}, "sampling.top_p"),
    ("hi", {"top_k": -1}, "sampling.top_k"),
])
def test_bad_requests_are_invalid_argument_naming_the_field(running, prompt, sampling, field):
    srv = running()
    stub = srv.client().stub
    req = generate_request(prompt if prompt is not None else "x", **sampling)
    if prompt is None:
        req.ClearField("text")
    err = rpc_error(lambda: list(stub.Generate(req, timeout=10)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.details()
    assert ("invalid-field", field) in tuple(err.trailing_metadata())
    assert srv.engine.kv_free_blocks() == srv.engine.kv_total_blocks()


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
    wait_for(lambda: "cancel-me" in srv.engine.aborted, timeout=2, what="abort")
    assert srv.engine.kv_free_blocks() == srv.engine.kv_total_blocks()


def test_client_deadline_aborts_the_request(running):
    srv = running(step_s=0.02)
    c = srv.client()
    err = rpc_error(lambda: c.complete("a", max_tokens=400, request_id="slow", timeout=0.3))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: "slow" in srv.engine.aborted, timeout=2, what="abort")
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
    assert [m.name for m in fd.service[0].method] == ["Startup", "Generate"]
    channel.close()


def test_max_message_bytes_is_enforced(base_rc, running):
    srv = running(with_server(base_rc, max_message_bytes=1024))
    c = ApplianceClient(srv.address, max_message_bytes=1 << 20)
    err = rpc_error(lambda: c.complete("y" * 4096, max_tokens=1))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert c.complete("y" * 100, max_tokens=2)[0] == expected_tokens("y" * 100, 2)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls(base_rc, running, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    srv = running(with_server(base_rc, tls_cert_file=str(cert), tls_key_file=str(key)))
    secure = ApplianceClient(srv.address, root_cert=cert, server_name="localhost")
    assert secure.startup(timeout=10).capacity_slots == 4
    plain = srv.client()
    assert rpc_error(lambda: plain.health(timeout=2)).code() == grpc.StatusCode.UNAVAILABLE


def test_client_cli(running, capsys):
    srv = running()
    assert client_main(["--address", srv.address, "--startup"]) == 0
    out = capsys.readouterr().out
    rc = srv.server.rc
    assert f"model {rc.model.name} ({rc.model.arch})" in out
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
rc = load_runtime_config(["server.port=0", "server.grace_period_s=5"])
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
