"""The server starts its two front ends side by side, and both read one ServerState; the engine reaches the server
through EngineClient (on_failure included), whichever engine it is."""

from __future__ import annotations

import threading

from appliance.config.compose import load_runtime_config
from appliance.serve.state import ServerState
from tests.serve.fake_engine import FakeEngine
from tests.serve.test_http import request
from tests.serve.test_server import Running, wait_for


def both_front_ends_rc():
    return load_runtime_config(["server.port=0", "server.http_port=0", "server.grace_period_s=5"])


def test_both_front_ends_read_one_server_state_from_start_to_stop():
    rc = both_front_ends_rc()
    gate = threading.Event()
    srv = Running(rc, FakeEngine(rc, start_gate=gate))
    try:
        wait_for(lambda: srv.server.http is not None and srv.server.http.port is not None, 10, "HTTP to bind")
        assert srv.server.grpc.port == srv.server.port and srv.server.http.port not in (None, srv.server.port)
        assert srv.server.state is ServerState.STARTING
        assert srv.client().health() == "NOT_SERVING"
        assert request(srv.server.http.port, "/health") == (503, {"status": "starting"})
        gate.set()
        srv.wait_serving()
        assert srv.server.state is ServerState.SERVING
        assert srv.client().health() == "SERVING"
        assert request(srv.server.http.port, "/health") == (200, {"status": "serving"})
    finally:
        gate.set()
        srv.stop()
    assert srv.server.state is ServerState.STOPPED and srv.result["status"] == "ok"


def test_an_engine_that_stops_while_serving_fails_the_server_through_on_failure():
    rc = both_front_ends_rc()
    srv = Running(rc, FakeEngine(rc))
    srv.wait_serving()
    engine = srv.engine
    assert engine.on_failure is not None, "the server did not subscribe to the engine's failure"
    threading.Thread(target=engine.on_failure, args=("rank 1 died",)).start()     # as the engine thread does
    srv.thread.join(20)
    assert not srv.thread.is_alive()
    assert srv.result["status"] == "failed" and srv.result["reason"] == "rank 1 died"
    assert srv.server.state is ServerState.STOPPED      # the usual shutdown followed
