"""Live figures of the real server process (the embedded DeepSeek-V4-shaped model, seven cache groups): after 200
streams over gRPC and HTTP cancelled at random points, every group's used blocks read 0 through GET /metrics and
through the gRPC Stats RPC, and both report the same counters."""

from __future__ import annotations

import http.client
import json
import random
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from appliance.client import ApplianceClient
from appliance.serve.api import appliance_pb2 as pb
from appliance.serve.convert import generate_request
from tests.serve.test_server_e2e import ServerProcess, wait_for

NUM_STREAMS = 200
GROUPS = {"ori", "cmp_c16", "cmp_c4", "idx", "hca_state", "csa_state", "csa_inner_state"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv = ServerProcess("device=cpu", "max_model_len=512", "max_num_seqs=8", "max_waiting_requests=256",
                        "kv_cache.num_slots_override=12", "server.port=0", "server.http_port=0",
                        run_dir=tmp_path_factory.mktemp("run"))
    try:
        grpc_address = srv.wait_address()
        wait_for(lambda: "SERVING on" in srv.output or srv.proc.poll() is not None, 300, "SERVING")
        assert srv.proc.poll() is None, srv.output
        port = int(re.search(r"^http listening on 127\.0\.0\.1:(\d+) ", srv.output, re.M).group(1))
        client = ApplianceClient(grpc_address)
        yield client, port
        client.close()
    finally:
        srv.proc.terminate()
        srv.proc.wait(60)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """/metrics as {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r"^([a-zA-Z0-9_:]+)\{([^}]*)\} (\S+)$", text, re.M):
        labels = tuple(sorted(tuple(kv.split("=", 1)) for kv in m.group(2).split(",")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def per_group(metrics: dict, name: str) -> dict[str, float]:
    return {dict(labels)["group"].strip('"'): v for (n, labels), v in metrics.items() if n == name}


def grpc_stream(client: ApplianceClient, rng: random.Random) -> None:
    call = client.stub.Generate(generate_request("the cache " * rng.randint(1, 20),
                                                 max_tokens=rng.randint(4, 150), ignore_eos=True))
    call.initial_metadata()                      # accepted by the engine
    for _, _ in zip(range(rng.randint(0, 6)), call):
        pass
    call.cancel()


def http_stream(port: int, rng: random.Random) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": "weather notes " * rng.randint(1, 20), "max_tokens": rng.randint(4, 150), "stream": True,
         "ignore_eos": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(rng.randint(0, 6)):
        if not resp.readline():
            break
    conn.close()


def test_cancelled_streams_leave_every_group_empty_in_metrics_and_stats(served):
    client, port = served
    seeds = range(NUM_STREAMS)

    def one(i: int) -> None:
        rng = random.Random(i)
        grpc_stream(client, rng) if i % 2 else http_stream(port, rng)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, seeds))

    def settled() -> bool:
        s = client.stub.Stats(pb.StatsRequest(), timeout=10)
        return s.num_requests_running == 0 and s.num_requests_waiting == 0 and \
            sum(s.requests_finished.values()) == NUM_STREAMS
    wait_for(settled, 120, "every request to finish")
    stats = client.stub.Stats(pb.StatsRequest(), timeout=10)
    assert stats.state == "serving"
    assert {g.name for g in stats.cache_groups} == GROUPS
    assert all(g.used_blocks == 0 and g.free_blocks == g.total_blocks > 0 and g.usage == 0
               for g in stats.cache_groups), stats.cache_groups
    assert stats.requests_finished["aborted"] > 0                 # the cancels reached the engine

    metrics = scrape(port)
    assert per_group(metrics, "appliance:kv_cache_used_blocks") == {g: 0.0 for g in GROUPS}
    assert per_group(metrics, "appliance:kv_cache_usage_perc") == {g: 0.0 for g in GROUPS}
    assert per_group(metrics, "appliance:kv_cache_free_blocks") == \
        {g.name: float(g.total_blocks) for g in stats.cache_groups}
    finished = {dict(labels)["finished_reason"].strip('"'): v for (n, labels), v in metrics.items()
                if n == "appliance:request_success_total"}
    assert finished == {reason: float(stats.requests_finished.get(reason, 0))
                        for reason in ("length", "stop", "eos", "aborted")}
    model = (("model_name", '"deepseek-v4-tiny"'),)
    assert metrics[("appliance:generation_tokens_total", model)] == stats.generation_tokens > 0
    assert metrics[("appliance:prompt_tokens_total", model)] == stats.prompt_tokens > 0
    assert metrics[("appliance:num_requests_running", model)] == 0
    assert metrics[("appliance:e2e_request_latency_seconds_count", model)] == \
        stats.e2e_request_latency_seconds.count == NUM_STREAMS
    assert stats.time_to_first_token_seconds.count <= NUM_STREAMS
    assert stats.time_per_output_token_seconds.count == stats.generation_tokens - stats.time_to_first_token_seconds.count
