"""Limits of the HTTP front end against slow, big and idle clients (server.http_max_body_bytes,
server.http_read_timeout_s, server.http_max_connections).

What uvicorn offers is used: h11_max_incomplete_event_size bounds the headers, timeout_keep_alive closes a
connection idle after a response. What it lacks is here, small:

- Body size: FastAPI(max_body_size=...) answers 413 as soon as a chunked or undeclared body passes the limit
  while it is read; BodyLimit (ASGI) answers a declared Content-Length over it before the app runs, and closes
  the connection after any 413. A 160 MB body is never buffered nor parsed on the loop.
- GuardedH11Protocol (uvicorn's h11 protocol): a request's headers and body must arrive within the read
  timeout of the moment the server began waiting for them, else the connection is closed (slow headers,
  trickled bodies, and sockets opened and left silent). uvicorn closes no connection that never sent a request.
- The connection cap evicts the longest-waiting idle connection (one not being answered) for a new one, so
  1,000 silent sockets cannot lock probes out. uvicorn's limit_concurrency is not used: once idle sockets fill
  it, it answers 503 to every request, /health included.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from appliance.serve.openai.errors import ApiError

MAX_HEADER_BYTES = 65536        # h11_max_incomplete_event_size: request line + headers


def too_large_message(limit: int) -> str:
    return (f"the request body is larger than server.http_max_body_bytes={limit} bytes; "
            f"send a smaller body (or raise server.http_max_body_bytes)")


def declared_length(scope: Scope) -> int | None:
    """The Content-Length header as a number (None when absent or not a number: h11 refuses those anyway)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimit:
    """ASGI middleware around the app: a declared Content-Length over `max_bytes` is answered 413 before the
    app runs (before auth, before a byte of the body is read). The count while a chunked or undeclared body
    is read is FastAPI's own (FastAPI(max_body_size=...), the same limit); its 413 is replaced here by the
    same OpenAI-style error naming the setting. Every 413 closes the connection, so the rest of a refused
    body is never read."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self.refuse(send)
        refused = False

        async def send_or_refuse(message: Message) -> None:
            nonlocal refused
            if message["type"] == "http.response.start" and message["status"] == 413:
                refused = True
                await self.refuse(send)
            elif not refused:              # (the app's own body of its 413 is dropped)
                await send(message)

        await self.app(scope, receive, send_or_refuse)

    async def refuse(self, send: Send) -> None:
        body = json.dumps(ApiError(413, too_large_message(self.max_bytes), code="request_too_large").body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a read deadline per request and a cap on open connections.

    Configured through class attributes (set by `guarded_protocol`), since uvicorn builds one protocol per
    connection from the class it is given."""

    read_timeout_s: float = 30.0
    max_connections: int = 512

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        no_delay(transport)
        self.read_deadline: asyncio.TimerHandle | None = None
        self.waiting_since = self.loop.time()
        super().connection_made(transport)
        self._arm_read_deadline()
        if len(self.connections) > self.max_connections:
            evict_longest_waiting(self.connections, self)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE or self.conn.their_state is h11.SEND_BODY:
            if self.read_deadline is None:          # the first bytes of a next request on a kept-alive connection
                self._arm_read_deadline()
        else:                                      # the request is in (or the connection is ending)
            self._disarm_read_deadline()

    def on_response_complete(self) -> None:
        self.waiting_since = self.loop.time()
        super().on_response_complete()             # uvicorn's keep-alive timer now closes the idle connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read_deadline()
        super().connection_lost(exc)

    def waiting_for_request(self) -> bool:
        """Not answering anything: between requests, or still receiving one the app has not been given."""
        return self.cycle is None or self.cycle.response_complete

    def _arm_read_deadline(self) -> None:
        self.read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm_read_deadline(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _read_timed_out(self) -> None:
        self.read_deadline = None
        if self.conn.their_state is h11.IDLE or self.conn.their_state is h11.SEND_BODY:
            self.transport.close()                 # the app, if it waits for the body, sees http.disconnect


def no_delay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on an accepted connection. A response goes out in two writes (headers, then body); with Nagle's
    algorithm the body waits for the ACK of the headers, which a keep-alive client delays by up to 40 ms. asyncio
    sets it only on sockets created with IPPROTO_TCP, and socket.create_server's listening socket (proto 0) hands
    out connections without it."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def evict_longest_waiting(connections: set, newcomer: GuardedH11Protocol) -> None:
    """Close the idle connection that has waited longest for its request (the newcomer when none is idle)."""
    idle = [c for c in connections if c is not newcomer and isinstance(c, GuardedH11Protocol)
            and c.waiting_for_request()]
    victim = min(idle, key=lambda c: c.waiting_since) if idle else newcomer
    victim.transport.close()


def guarded_protocol(read_timeout_s: float, max_connections: int) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol class carrying these limits (uvicorn.Config(http=...) takes a class)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"read_timeout_s": read_timeout_s, "max_connections": max_connections})


def uvicorn_limits(read_timeout_s: float, max_connections: int) -> dict[str, Any]:
    """The uvicorn.Config keywords that apply the limits."""
    return {"http": guarded_protocol(read_timeout_s, max_connections),
            "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
            "timeout_keep_alive": max(1, min(5, int(read_timeout_s)))}
