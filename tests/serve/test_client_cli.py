"""The gRPC client's command line tells a finished request from one the server cut short (issue 24 item 7), and a
refused token from a refused request: it names its own two ways to send one (issue 35)."""

from __future__ import annotations

import threading

from appliance.client import main as client_main
from tests.serve import test_server
from tests.serve.test_server import wait_for, with_server

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


def test_a_wrong_or_missing_token_names_the_clients_flag_and_variable(base_rc, running, capsys, monkeypatch):
    srv = running(with_server(base_rc, auth_token="s3cret"))
    monkeypatch.delenv("APPLIANCE_AUTH_TOKEN", raising=False)
    for token in ([], ["--token", "nope"]):
        assert client_main(["--address", srv.address, *token, "hi"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: UNAUTHENTICATED: ") and "--token TOKEN" in err and \
            "export APPLIANCE_AUTH_TOKEN=TOKEN" in err, err
    assert client_main(["--address", srv.address, "--token", "s3cret", "--max-tokens", "2", "hi"]) == 0

