"""The gRPC client's command line tells a finished request from one the server cut short (issue 24 item 7)."""

from __future__ import annotations

import threading

from appliance.client import main as client_main
from tests.serve import test_server
from tests.serve.test_server import wait_for

base_rc = test_server.base_rc          # the fake-engine server fixture and its config, from test_server
running = test_server.running


def test_the_client_exits_non_zero_when_the_server_aborts_its_request(running, capsys):
    srv = running(step_s=0.05)                 # 400 tokens take 20 s: only the abort ends the request early

    def abort_once_running():
        wait_for(lambda: srv.engine.requests, 10, "the request to run")
        srv.engine.abort(next(iter(srv.engine.requests)))
    threading.Thread(target=abort_once_running, daemon=True).start()
    assert client_main(["--address", srv.address, "--max-tokens", "400", "hi"]) == 1
    assert "aborted the request" in capsys.readouterr().err

    assert client_main(["--address", srv.address, "--max-tokens", "3", "hi"]) == 0
    assert "[length: prompt 2, completion 3" in capsys.readouterr().err
