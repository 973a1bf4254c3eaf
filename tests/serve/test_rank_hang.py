"""A rank that hangs while serving (SIGSTOP mid-stream: it neither steps nor exits) is declared hung within
parallel.step_timeout_s, as users run it (`python -m appliance`, DP2 x EP2 on gloo): health NOT_SERVING, the
stream fails UNAVAILABLE naming the rank and why, the stopped rank killed and reaped by the owner, exit status 1.
The test waits for states (a token streamed, the stream's end, the exit), never for a time."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import REPO
from tests.serve.test_rank_death import DP2_EP2, INTERNALS, finish_error, spawned_ranks, state_letter
from tests.serve.test_rank_death import stream_until_first_token as first_token_of_a_stream
from tests.serve.test_ranks_cli import Output, env

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
