"""The engine core in its own process (server.engine_process=true, appliance/engine/process/) behind the real front
ends: greedy outputs over gRPC and HTTP equal the in-process engine's, an abort gives the request's blocks back,
a stop string is found by the front end and frees the core's request (counted as stopped), a full wait queue is
RESOURCE_EXHAUSTED / 429, /metrics and Stats read the core's figures, a killed core turns health NOT_SERVING and
fails the streams in flight, SIGTERM drains the streams in flight and ends both processes (the front one never
having loaded torch), and a startup fault in the core is the usual message and exit status 2. Every wait is for a
state, not a time."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from appliance.client import ApplianceClient
from appliance.config.compose import load_runtime_config
from appliance.core.request import FinishReason, SamplingParams
from appliance.engine.process import messages as m
from appliance.engine.process.client import EngineProcessClient
from appliance.offline import Appliance
from appliance.serve.api import appliance_pb2 as pb
from appliance.serve.convert import generate_request
from appliance.serve.server import ApplianceServer
from tests.serve.test_server_e2e import ServerProcess, token_prompts, wait_for

# 2 running + 2 waiting fill the engine (the backpressure test); the greedy batch fits in that.
OVERRIDES = ["device=cpu", "max_model_len=128", "max_num_seqs=2", "max_waiting_requests=2",
             "kv_cache.num_slots_override=16", "server.port=0", "server.http_port=0", "server.grace_period_s=5"]
MAX_TOKENS = 12


class InProcessServer:
    """ApplianceServer (gRPC + HTTP) in a thread of this process, on an EngineProcessClient (its core a child)."""

    def __init__(self, overrides: list[str]):
        self.rc = load_runtime_config([*overrides, "server.engine_process=true"])
        self.engine = EngineProcessClient(self.rc, pin_cpus=False)    # pinning would pin the test process
        self.server = ApplianceServer(self.rc, self.engine)
        self.result: dict = {}
        self.error: BaseException | None = None
        self.engine.prepare()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.state != "starting" or not self.thread.is_alive(), 300, "engine start")
        assert self.server.state == "serving", f"server did not start: {self.error!r}"
        self.client = ApplianceClient(f"127.0.0.1:{self.server.port}")
        self.http = f"http://127.0.0.1:{self.server.http.port}"

    def _run(self) -> None:
        try:
            self.result = asyncio.run(self.server.run())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def stop(self) -> None:
        self.server.request_shutdown()
        self.thread.join(60)
        self.client.close()

    def blocks(self) -> tuple[int, int]:
        """(free, total) blocks over every cache group, as the core last reported them."""
        groups = self.engine.stats().groups
        return sum(g.free_blocks for g in groups), sum(g.total_blocks for g in groups)

    def all_free(self) -> bool:
        free, total = self.blocks()
        return total > 0 and free == total


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def served():
    srv = InProcessServer(OVERRIDES)
    yield srv
    srv.stop()
    assert srv.result.get("status") == "ok", (srv.result, srv.error)
    assert srv.engine.returncode == 0


def test_greedy_outputs_over_grpc_and_http_equal_the_in_process_engine(served):
    prompts = token_prompts(4, served.rc.model.layout.vocab_size, seed=11)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with Appliance.from_config(OVERRIDES) as offline:        # the engine on a thread of this process
        expected = [(r.token_ids, r.text) for r in offline.generate(prompts, greedy)]
        report = offline.report
    # The startup report crosses the process boundary whole (the Startup RPC and startup_report.json read it).
    assert m.event_decoder().decode(m.encoder().encode(m.Reply(1, report=report))).report == report
    assert served.engine.report is not None and served.engine.report.plan.num_blocks == report.plan.num_blocks
    got: dict[int, tuple] = {}

    def one(i: int) -> None:
        ids, text, last = served.client.complete(prompts[i], max_tokens=MAX_TOKENS, ignore_eos=True)
        got[i] = (ids, text, last.finish_reason, last.usage.prompt_tokens, last.usage.completion_tokens)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i][:2] for i in range(len(prompts))] == expected
    assert all(got[i][2:] == (FinishReason.LENGTH, len(prompts[i]), MAX_TOKENS) for i in range(len(prompts)))

    for prompt, (_, text) in zip(prompts, expected):
        status, body = post(f"{served.http}/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                              "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        assert body["choices"][0]["text"] == text and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] == len(prompt)
    wait_for(served.all_free, 30, "blocks back")


def collect(engine, request_id: str, prompt, params: SamplingParams) -> list:
    """Every delta of one request, submitted straight to `engine` (an Engine or an EngineProcessClient)."""
    return list(engine.submit(request_id, prompt, params))


def test_every_sampling_field_crosses_to_the_core(served):
    """Stop strings, logprobs, prompt logprobs, seeded sampling and an output constraint: the core's deltas equal the
    in-process engine's, delta for delta (the fields travel in the messages as the engine's own dataclasses)."""
    from appliance.core.constraint import OutputConstraint
    from appliance.engine.engine import Engine

    cases = {
        "stop": ("the cache holds", SamplingParams(max_tokens=16, ignore_eos=True, stop=("e", "th"))),
        "logprobs": ([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)),
        "seeded": ("hello", SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_k=20, seed=7)),
        "constrained": ("pick", SamplingParams(max_tokens=8, constraint=OutputConstraint.choice(["yes", "no"]))),
    }
    local = Engine(served.rc)
    local.start()
    try:
        expected = {name: collect(local, name, *case) for name, case in cases.items()}
    finally:
        local.shutdown()
    got = {name: collect(served.engine, name, *case) for name, case in cases.items()}
    assert got == expected
    assert "".join(o.new_text for o in got["constrained"]) in ("yes", "no")


def split_stop(deltas: list[str]) -> str:
    """A stop string that straddles two tokens' texts (the last two characters of one, the first of the next) and
    first appears there: its first characters stream held back."""
    text = ""
    for a, b in zip(deltas, deltas[1:]):
        text += a
        stop = a[-2:] + b[:1]
        if len(a) >= 2 and b and (text + b).find(stop) == len(text) - 2:
            return stop
    raise AssertionError(f"no stop string straddles two tokens of {deltas!r}")


def test_a_stop_string_across_tokens_streams_as_in_process_and_the_core_frees_and_counts_it(served):
    """The front end finds the stop string (split over two tokens, held back) and streams the in-process engine's
    deltas and usage exactly; the core frees the request's blocks and counts it finished by stop, not aborted, and
    counts as generated only the tokens the client received (not those it computed past the stop string); and
    its request_id is free again at once."""
    from appliance.engine.engine import Engine

    prompt, plain = "the cache holds", SamplingParams(max_tokens=100, ignore_eos=True)
    local = Engine(served.rc)
    local.start()
    try:
        stop = split_stop([o.new_text for o in collect(local, "base", prompt, plain)])
        params = SamplingParams(max_tokens=100, ignore_eos=True, stop=(stop,))
        expected = collect(local, "stopped", prompt, params)
    finally:
        local.shutdown()
    assert expected[-1].finish_reason == FinishReason.STOP and expected[-1].usage.completion_tokens < 100
    assert any(o.new_token_ids and not o.new_text for o in expected)        # a delta held back
    wait_for(served.all_free, 30, "blocks back")
    before = served.engine.stats().finished
    tokens_before = served.engine.stats().generation_tokens
    got = collect(served.engine, "stopped", prompt, params)
    again = collect(served.engine, "stopped", prompt, params)             # the same request_id, at once
    assert got == expected and again == expected

    def counted() -> bool:
        finished = served.engine.stats().finished
        return finished.get("stop", 0) == before.get("stop", 0) + 2 and served.all_free()
    wait_for(counted, 30, "the core to free both requests and count them stopped")
    assert served.engine.stats().finished.get("aborted", 0) == before.get("aborted", 0)
    received = sum(len(o.new_token_ids) for o in got + again)
    assert received == 2 * expected[-1].usage.completion_tokens
    assert served.engine.stats().generation_tokens - tokens_before == received
    assert served.engine.num_in_flight() == 0


def test_an_abort_gives_the_blocks_back(served):
    stream = served.client.generate("tell me a long story", max_tokens=100, ignore_eos=True)
    next(stream)
    wait_for(lambda: not served.all_free(), 30, "the request's blocks to show in the core's stats")
    assert served.engine.num_in_flight() == 1
    stream.close()                                   # cancel: the server aborts it in the core
    wait_for(lambda: served.engine.num_in_flight() == 0, 30, "the abort")
    wait_for(served.all_free, 30, "blocks back")
    # and its request id may be used again at once
    ids, _, last = served.client.complete("again", max_tokens=2, ignore_eos=True)
    assert len(ids) == 2 and last.finish_reason == FinishReason.LENGTH


def test_a_full_wait_queue_is_resource_exhausted_and_429(served):
    finished_before = sum(served.client.stub.Stats(pb.StatsRequest(), timeout=10).requests_finished.values())
    calls = [served.client.stub.Generate(generate_request("fill", max_tokens=100, ignore_eos=True))
             for _ in range(4)]                      # 2 running + 2 waiting
    try:
        for call in calls:
            assert dict(call.initial_metadata())["request-id"]      # sent once the core admitted it
        with pytest.raises(grpc.RpcError) as info:
            served.client.complete("one too many", max_tokens=2)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status, body = post(f"{served.http}/v1/completions", {"prompt": "one too many", "max_tokens": 2})
        assert status == 429, body
    finally:
        for call in calls:
            call.cancel()
    wait_for(lambda: served.engine.num_in_flight() == 0, 30, "the cancels")
    # The front end lets go of a cancelled stream before the core has ended it: wait until the core counted all four
    # finished (aborted, or done if one ran its 100 tokens first), so no later test sees them end or count a token.
    wait_for(lambda: sum(served.client.stub.Stats(pb.StatsRequest(), timeout=10).requests_finished.values())
             - finished_before >= 4, 30, "the core to end the four cancelled streams")
    wait_for(served.all_free, 30, "blocks back")


def test_metrics_and_stats_count_a_finished_request_before_its_client_hears_the_end(served):
    """The core sends its stats snapshot ahead of a request's last output: read right after, nothing lags."""
    wait_for(served.all_free, 30, "blocks back")
    # A snapshot the core took once every earlier request (the previous test's cancelled streams) had left it: their
    # last tokens are counted in it, not in the difference below.
    snapshots: list = []

    def core_idle() -> bool:
        snapshots.append(served.client.stub.Stats(pb.StatsRequest(), timeout=10))
        return snapshots[-1].num_requests_running == 0 and snapshots[-1].num_requests_waiting == 0

    wait_for(core_idle, 30, "a stats snapshot of an idle core")
    before = snapshots[-1]
    status, body = post(f"{served.http}/v1/completions", {"prompt": "count me", "max_tokens": 3, "ignore_eos": True})
    assert status == 200, body
    after = served.client.stub.Stats(pb.StatsRequest(), timeout=10)      # at once: no wait
    assert after.generation_tokens - before.generation_tokens == 3
    assert after.requests_finished["length"] - before.requests_finished["length"] == 1
    assert after.prompt_tokens - before.prompt_tokens == body["usage"]["prompt_tokens"]


def test_metrics_and_stats_read_the_core(served):
    wait_for(served.all_free, 30, "blocks back")
    with urllib.request.urlopen(f"{served.http}/metrics", timeout=30) as r:
        text = r.read().decode()
    groups = {s.name for s in served.rc.model.cache_groups}
    used = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^appliance:kv_cache_used_blocks\{group="([^"]+)",model_name="[^"]+"\} (\S+)$', text, re.M)}
    assert set(used) == groups and not any(used.values())
    assert re.search(r'^appliance:request_success_total\{finished_reason="length",model_name="[^"]+"\} '
                     r'([1-9]\d*)\.0$', text, re.M)
    stats = served.client.stub.Stats(pb.StatsRequest(), timeout=10)
    assert {g.name for g in stats.cache_groups} == groups
    assert stats.requests_finished["length"] >= 1 and stats.generation_tokens > 0


def test_a_killed_core_turns_health_not_serving_and_fails_the_streams_in_flight():
    srv = InProcessServer(OVERRIDES)
    try:
        health = health_pb2_grpc.HealthStub(srv.client.channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(health).status == health_pb2.HealthCheckResponse.SERVING
        stream = srv.client.generate("tell me a long story", max_tokens=100, ignore_eos=True)
        next(stream)
        os.kill(srv.engine.pid, signal.SIGKILL)
        assert next(health).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the engine core process" in info.value.details() and "SIGKILL" in info.value.details()
        srv.thread.join(60)
        assert srv.result["status"] == "failed" and "SIGKILL" in srv.result["reason"], (srv.result, srv.error)
        assert "SIGKILL" in srv.server.failure
    finally:
        if srv.thread.is_alive():
            srv.stop()
        srv.client.close()


def test_a_stopped_core_is_declared_hung_and_killed():
    srv = InProcessServer([*OVERRIDES, "parallel.step_timeout_s=2"])
    try:
        stream = srv.client.generate("tell me a long story", max_tokens=100, ignore_eos=True)
        next(stream)
        pid = srv.engine.pid
        os.kill(pid, signal.SIGSTOP)                  # no exit to see: only its silence tells
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "sent nothing for" in info.value.details() and "stopped" in info.value.details()
        srv.thread.join(60)
        assert srv.result["status"] == "failed" and "hung" in srv.result["reason"], (srv.result, srv.error)
        wait_for(lambda: not process_alive(pid), 30, "the stopped core to be killed")
    finally:
        if srv.thread.is_alive():
            srv.stop()
        srv.client.close()


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_drains_the_streams_in_flight_and_ends_both_processes(tmp_path):
    srv = ServerProcess(*OVERRIDES, "server.engine_process=true", run_dir=tmp_path / "run")
    try:
        client = ApplianceClient(srv.wait_address())
        wait_for(lambda: "SERVING on" in srv.output or srv.proc.poll() is not None, 300, "SERVING")
        assert srv.proc.poll() is None, srv.output
        core = int(re.search(r"engine core process started: pid (\d+)", srv.output).group(1))
        assert process_alive(core)
        # The front end never loads torch: only the core process maps libtorch.
        assert "libtorch" not in Path(f"/proc/{srv.proc.pid}/maps").read_text()
        assert "libtorch" in Path(f"/proc/{core}/maps").read_text()
        stream = client.generate("tell me a story", max_tokens=40, ignore_eos=True)
        first = next(stream)
        srv.proc.send_signal(signal.SIGTERM)          # the stream in flight still finishes, all 40 tokens
        rest = list(stream)
        assert rest[-1].finish_reason == FinishReason.LENGTH
        assert len(first.new_token_ids) + sum(len(o.new_token_ids) for o in rest) == 40
        assert srv.proc.wait(60) == 0, srv.output
        assert "stopped" in srv.output
        wait_for(lambda: not process_alive(core), 30, "the core process to end")
        client.close()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_the_core_ends_with_a_killed_server(tmp_path):
    srv = ServerProcess(*OVERRIDES, "server.engine_process=true", run_dir=tmp_path / "run")
    try:
        srv.wait_address()
        wait_for(lambda: "engine core process started" in srv.output or srv.proc.poll() is not None, 300, "the core")
        core = int(re.search(r"engine core process started: pid (\d+)", srv.output).group(1))
        srv.proc.kill()                               # no drain, no Shutdown: the kernel ends the core
        srv.proc.wait(60)
        wait_for(lambda: not process_alive(core), 30, "the core process to end with the server")
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_a_startup_fault_in_the_core_is_its_message_and_exit_2(cli):
    # Fits the preflight's estimate, not the profiled peak: the fault comes from the core's Engine.start.
    proc = cli("device=cpu", "server.engine_process=true", "server.port=0", "server.http_port=0",
               "device.memory_bytes_per_device=3400000")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: device cpu:0: total 3,400,000 B" in proc.stderr and "peak_non_kv alone exceeds" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
