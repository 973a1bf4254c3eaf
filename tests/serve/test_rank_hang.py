"""A rank that hangs while serving (SIGSTOP mid-stream: it neither steps nor exits) is declared hung within
parallel.step_timeout_s, as users run it (`python -m appliance`, DP2 x EP2 on gloo): health NOT_SERVING, the
stream fails UNAVAILABLE naming the rank and why, the stopped rank killed and reaped by the owner, exit status 1.
And when the owner cannot free its step (a hung torchrun rank on another host), the server still ends the streams
the engine holds with that failure. The tests wait for states (a token streamed, the stream's end, the exit),
never for a time."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from appliance.config.compose import load_runtime_config
from tests.conftest import REPO
from tests.serve.fake_engine import FakeEngine
from tests.serve.test_rank_death import DP2_EP2, INTERNALS, finish_error, state_letter
from tests.serve.test_rank_death import stream_until_first_token as first_token_of_a_stream
from tests.serve.test_ranks_cli import Output, env, spawned_ranks
from tests.serve.test_server import Running, wait_for

STEP_TIMEOUT_S = 5.0


def test_a_stopped_rank_is_declared_hung_within_the_step_deadline_and_nothing_is_left(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "appliance", *DP2_EP2, f"parallel.step_timeout_s={STEP_TIMEOUT_S}",
                             "server.port=0", "server.http_port=null", f"hydra.run.dir={tmp_path}"], cwd=REPO,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Output(proc)
    rank = None
    try:
        address = out.address()
        (rank,) = spawned_ranks(proc.pid)
        channel, call = first_token_of_a_stream(address)
        health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=300)
        assert next(health).status == health_pb2.HealthCheckResponse.SERVING
        os.kill(rank, signal.SIGSTOP)
        stopped_at = time.monotonic()
        err = finish_error(call)
        declared_after = time.monotonic() - stopped_at
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
        assert f"rank 1 (pid {rank}) hung" in err.details() and "stopped: SIGSTOP" in err.details(), err.details()
        assert not any(word in err.details() for word in INTERNALS), err.details()
        assert next(health).status == health_pb2.HealthCheckResponse.NOT_SERVING
        # Within the deadline: the step in flight when the rank stopped had just begun. (The bound's slack is for
        # a loaded machine; without the watch the stream would wait for its 300 s deadline.)
        assert STEP_TIMEOUT_S - 1 <= declared_after <= 3 * STEP_TIMEOUT_S + 10, declared_after
        print(f"declared hung {declared_after:.2f} s after SIGSTOP (parallel.step_timeout_s={STEP_TIMEOUT_S:g}): "
              f"{err.details()}")
        channel.close()
        assert proc.wait(120) == 1, out.text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        if rank is not None and state_letter(rank) == "T":
            os.kill(rank, signal.SIGKILL)
    assert state_letter(rank) is None                      # killed and reaped by the owner: no orphan, no zombie
    assert re.search(rf"error: the engine stopped: rank 1 \(pid {rank}\) hung", out.text), out.text[-3000:]
    assert "Traceback" not in out.text and "terminate called" not in out.text, out.text[-3000:]


class StuckEngine(FakeEngine):
    """An engine whose step waits for a rank that never answers: nothing it holds finishes or is aborted."""

    def _loop(self) -> None:
        self._stop.wait()

    def abort(self, request_id: str) -> None:
        """The loop would get to it: never."""

    def drain(self, grace_s: float) -> None:
        self.draining = True


def test_streams_a_stuck_engine_holds_end_unavailable_naming_the_lost_rank():
    rc = load_runtime_config(["server.port=0", "server.http_port=null", "server.grace_period_s=5"])
    srv = Running(rc, StuckEngine(rc))
    srv.wait_serving()
    errors: list[grpc.RpcError] = []

    def stream() -> None:
        with pytest.raises(grpc.RpcError) as info:
            list(srv.client().generate([5, 6, 7], max_tokens=4, timeout=120))
        errors.append(info.value)

    caller = threading.Thread(target=stream)
    caller.start()
    wait_for(lambda: len(srv.engine.requests) == 1, 60, "the request in the engine")
    lost = "rank 3 (pid 77 on node-b) hung: no heartbeat for 5 s, past parallel.step_timeout_s=5"
    srv.engine.failure = lost
    srv.engine.on_failure(lost)
    caller.join(60)
    srv.thread.join(60)
    assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE and lost in errors[0].details()
    assert srv.result["status"] == "failed" and srv.result["reason"] == lost
