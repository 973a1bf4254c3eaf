"""HTTP limits against big, slow and idle clients (issue 24 item 6): server.http_max_body_bytes,
server.http_read_timeout_s, server.http_max_connections. Each test waits for a state (a response, a closed
connection); the socket timeouts only end a hung test."""

from __future__ import annotations

import asyncio
import json
import select
import socket
from types import SimpleNamespace

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.errors import ConfigError
from appliance.serve.http_limits import BodyLimit
from appliance.serve.openai.app import create_app
from tests.serve import test_server
from tests.serve.fake_engine import FakeEngine
from tests.serve.test_server import Running, wait_for

running = test_server.running       # the fake-engine server fixture, here with this module's base_rc
HUNG_S = 60.0                       # only ends a hung test


@pytest.fixture(scope="module")
def base_rc():
    return load_runtime_config(["server.port=0", "server.http_port=0", "server.grace_period_s=5",
                                "server.http_max_body_bytes=65536", "server.http_read_timeout_s=1",
                                "server.http_max_connections=8"])


def http_port(srv: Running) -> int:
    wait_for(lambda: srv.server.state == "serving" and srv.server.http.port is not None, 10, "serving")
    return srv.server.http.port


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(HUNG_S)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response (status, headers, body) read to the end of the connection or of its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed without a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    """Wait until the server closes the connection; True when it did (EOF or reset)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        return False
    return True


def completion_headers(length: int | None, chunked: bool = False) -> bytes:
    framing = "transfer-encoding: chunked\r\n" if chunked else f"content-length: {length}\r\n"
    return (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{framing}\r\n").encode()


# -- body limit ----------------------------------------------------------------------------------------------

def test_a_declared_length_over_the_limit_is_413_before_the_body_is_sent(running, base_rc):
    port = http_port(running())
    with connect(port) as sock:
        sock.sendall(completion_headers(160 * 1024 * 1024))       # no byte of the body follows
        status, headers, body = read_response(sock)
        assert status == 413 and headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert "server.http_max_body_bytes=65536" in error["message"]
        assert closed_by_server(sock)


def test_a_chunked_body_over_the_limit_is_413_while_it_is_read(running, base_rc):
    """Just past the limit, with the body's end never sent: the answer comes without waiting for it."""
    port = http_port(running())
    limit = base_rc.server.http_max_body_bytes
    chunk = b"x" * 16384
    with connect(port) as sock:
        sock.sendall(completion_headers(None, chunked=True))
        for _ in range(limit // len(chunk) + 2):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, headers, body = read_response(sock)               # no terminating chunk was sent
        assert status == 413 and headers["connection"] == "close"
        assert "server.http_max_body_bytes" in json.loads(body)["error"]["message"]
        assert closed_by_server(sock)


def test_the_app_never_pulls_more_than_the_limit_of_an_endless_body():
    """However long the body, the app (create_app behind BodyLimit, as served) takes at most one chunk past
    the limit from the server, and answers 413 with the connection closed."""
    rc = load_runtime_config(["server.http_port=0", "server.http_max_body_bytes=1000"])
    state = SimpleNamespace(rc=rc, engine=FakeEngine(rc), executor=None, state="serving", failure=None,
                            open_streams=set())     # what the front ends read (appliance.serve.state.FrontEndState)
    app = BodyLimit(create_app(state, None), rc.server.http_max_body_bytes)
    chunk = b"y" * 300
    pulled = 0
    sent = []

    async def endless_receive():
        nonlocal pulled
        pulled += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000)}
    asyncio.run(app(scope, endless_receive, send))
    start = sent[0]
    assert start["status"] == 413 and (b"connection", b"close") in start["headers"]
    assert pulled <= rc.server.http_max_body_bytes + len(chunk)


# -- read timeouts ---------------------------------------------------------------------------------------------

def test_slow_headers_are_closed_after_the_read_timeout(running):
    port = http_port(running())
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")     # the blank line never comes
        assert closed_by_server(sock)


def test_a_silent_connection_is_closed_after_the_read_timeout(running):
    port = http_port(running())
    with connect(port) as sock:
        assert closed_by_server(sock)


def test_a_trickled_body_is_closed_although_bytes_keep_coming(running):
    port = http_port(running())
    with connect(port) as sock:
        sock.sendall(completion_headers(1000))
        for _ in range(int(HUNG_S / 0.1)):                       # one byte each 0.1 s: never idle for the timeout
            try:
                sock.sendall(b"{")
            except (BrokenPipeError, ConnectionResetError):
                return
            if select.select([sock], [], [], 0.1)[0]:
                assert closed_by_server(sock)
                return
        pytest.fail("the trickled body was never cut off")


def test_a_request_in_time_is_answered(running):
    port = http_port(running())
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        status, _, body = read_response(sock)
    assert status == 200 and json.loads(body) == {"status": "serving"}


# -- connection cap --------------------------------------------------------------------------------------------

def test_idle_connections_beyond_the_cap_close_the_oldest_and_probes_get_through(running, base_rc):
    rc = test_server.with_server(base_rc, http_read_timeout_s=600.0)     # only the cap can close them here
    port = http_port(running(rc))
    cap = rc.server.http_max_connections
    idle = [connect(port) for _ in range(3 * cap)]
    try:
        assert closed_by_server(idle[0])                          # the longest-waiting idle one made room
        with connect(port) as probe:
            probe.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert read_response(probe)[0] == 200
    finally:
        for sock in idle:
            sock.close()


# -- settings ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override", ["server.http_max_body_bytes=0", "server.http_read_timeout_s=0",
                                      "server.http_max_connections=-1"])
def test_limits_must_be_positive(override):
    with pytest.raises(ConfigError) as err:
        load_runtime_config([override])
    assert override.split("=")[0] in str(err.value)
