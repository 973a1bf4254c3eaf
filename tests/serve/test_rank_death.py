"""A spawned rank killed while serving (kill -9): the server says so at once and ends, rather than serving
requests that can only fail.

In process (the owner is this test's server, rank 1 its child; or, with the engine core in its own process, that
process, rank 1 its child: both are run): health NOT_SERVING, GET /health 503, Stats
"failed", the dead child reaped (no zombie), the in-flight request failed UNAVAILABLE naming the rank, no
transport internals. As users run it (`python -m appliance`): the same for the client, then exit status 1
with no rank left behind. The test waits for states (a request streaming, the server failed), never a time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from appliance.config.compose import load_runtime_config
from appliance.serve.api import appliance_pb2 as pb
from appliance.serve.server import ApplianceServer
from tests.conftest import REPO
from tests.serve.test_ranks_cli import Output, env, spawned_ranks
from tests.serve.test_server import Running, wait_for

DP2_EP2 = ["+model=dsv4_tiny", "device=cpu", "device.count=2", "parallel.data_parallel_size=2",
           "parallel.expert_parallel_size=2", "device.cpu_threads=1", "max_model_len=128",
           "parallel.startup_timeout_s=120", "server.grace_period_s=5"]
LONG = 100                 # tokens asked for: the request is still streaming when its rank is killed
INTERNALS = ("gloo", "Gloo", "Connection", "socket", "Traceback", "pair.cc", "ProcessGroup")


def stream_until_first_token(address: str):
    """A streaming request (both data ranks' halves step together), once its first token arrived."""
    channel = grpc.insecure_channel(address)
    from appliance.serve.api import appliance_pb2_grpc as pb_grpc
    from appliance.serve.convert import generate_request

    call = pb_grpc.ApplianceStub(channel).Generate(
        generate_request([5, 6, 7, 8], max_tokens=LONG, ignore_eos=True), timeout=300)
    next(call)
    return channel, call


def finish_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    return info.value


def assert_names_the_rank(err: grpc.RpcError, pid: int) -> None:
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
    assert f"rank 1 (pid {pid}) died: killed by SIGKILL" in err.details()
    assert not any(word in err.details() for word in INTERNALS), err.details()


def state_letter(pid: int) -> str | None:
    """The process's state (Z: a zombie nobody reaped), None once it is reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return None


def post_completion(port: int, result: dict) -> None:
    """A non-streaming HTTP completion; its status and body go to `result`."""
    body = json.dumps({"prompt": [9, 10, 11], "max_tokens": LONG, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            result.update(status=r.status, body=r.read().decode())
    except urllib.error.HTTPError as err:
        result.update(status=err.code, body=err.read().decode())


class HeldShutdown(ApplianceServer):
    """The server with its shutdown held until the test has looked at the failed state (health, /health,
    Stats): otherwise it may end before the test looks."""

    release = threading.Event()

    async def _shutdown(self) -> None:
        import asyncio
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 120)
        await super()._shutdown()


@pytest.mark.parametrize("engine_process", [False, True], ids=["one-process", "engine-process"])
def test_a_killed_rank_fails_health_and_requests_and_the_server_stops(monkeypatch, one_torch_thread, engine_process):
    from appliance.engine.engine import Engine
    from appliance.engine.process.client import EngineProcessClient

    rc = load_runtime_config(DP2_EP2 + ["server.port=0", "server.http_port=0"])
    monkeypatch.setattr("tests.serve.test_server.ApplianceServer", HeldShutdown)
    HeldShutdown.release.clear()
    engine = EngineProcessClient(rc, pin_cpus=False) if engine_process else Engine(rc)
    srv = Running(rc, engine)
    try:
        srv.wait_serving(300)
        (rank,) = spawned_ranks(os.getpid())
        channel, call = stream_until_first_token(srv.address)
        http_result: dict = {}
        http_call = threading.Thread(target=post_completion, args=(srv.server.http.port, http_result))
        http_call.start()
        wait_for(lambda: srv.engine.num_in_flight() == 2, 60, "the HTTP request in flight too")
        os.kill(rank, signal.SIGKILL)
        assert_names_the_rank(finish_error(call), rank)
        http_call.join(60)
        assert http_result["status"] == 503, http_result
        assert f"rank 1 (pid {rank}) died: killed by SIGKILL" in http_result["body"]
        assert not any(word in http_result["body"] for word in INTERNALS), http_result["body"]
        wait_for(lambda: srv.server.state == "failed", 60, "the failed state")
        client = srv.client()
        assert client.health() == "NOT_SERVING"
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(f"http://127.0.0.1:{srv.server.http.port}/health", timeout=10)
        assert http.value.code == 503
        assert client.stub.Stats(pb.StatsRequest(), timeout=10).state == "failed"
        assert state_letter(rank) is None                        # reaped by the owner, not left a zombie
        refused = pytest.raises(grpc.RpcError, lambda: list(client.generate([1, 2], max_tokens=2)))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()
    finally:
        HeldShutdown.release.set()
    srv.thread.join(120)
    assert not srv.thread.is_alive()
    assert srv.result["status"] == "failed" and "rank 1" in srv.result["reason"]


def test_python_m_appliance_exits_1_after_a_rank_is_killed(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "appliance", *DP2_EP2, "server.port=0", "server.http_port=null",
                             f"hydra.run.dir={tmp_path}"], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = Output(proc)
    try:
        address = out.address()
        (rank,) = spawned_ranks(proc.pid)
        channel, call = stream_until_first_token(address)
        os.kill(rank, signal.SIGKILL)
        assert_names_the_rank(finish_error(call), rank)
        channel.close()
        assert proc.wait(120) == 1, out.text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for(lambda: state_letter(rank) is None, 30, "the rank reaped")
    assert re.search(rf"error: the engine stopped: rank 1 \(pid {rank}\) died: killed by SIGKILL", out.text)
    assert "Traceback" not in out.text and "terminate called" not in out.text, out.text[-3000:]
