"""The OpenAI-compatible HTTP front end: the FastAPI app (routes, bearer token, error translation) and uvicorn
serving it on the gRPC server's event loop, on a socket bound here.

    POST /v1/completions, POST /v1/chat/completions   (server-sent events when "stream": true)
    GET  /v1/models, GET /health (200 only while serving), GET /metrics (Prometheus)
    POST /tokenize, POST /detokenize                  (vLLM's shapes)

Why in-process on the gRPC server's event loop: one engine, one wait queue and one lifecycle for both front
ends (starting -> serving -> draining), so limits, health and shutdown agree. The same rules as gRPC: the
bearer token (server.auth_token) on everything but /health, TLS from server.tls_cert_file/tls_key_file,
and the engine's own request validation. Errors are OpenAI-style JSON (appliance/serve/openai/errors.py): 400
naming the field as the client wrote it, 401, 404 for another model, 429 when the wait queue is full, 503 while
starting or draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.core.errors import ConfigError, ConfigIssue
from appliance.serve.auth import bearer_token_matches
from appliance.serve.chat_formats import ChatFormat, load_chat_format
from appliance.serve.chat_template import ChatTemplateError
from appliance.serve.http_limits import BodyLimit, uvicorn_limits
from appliance.serve.metrics import metrics_registry, render
from appliance.serve.openai.errors import ApiError, install_error_handlers, internal_error
from appliance.serve.openai.protocol import request_field_names
from appliance.serve.openai.serving_chat import OpenAIServingChat
from appliance.serve.openai.serving_completion import OpenAIServingCompletion
from appliance.serve.openai.serving_models import OpenAIServingModels
from appliance.serve.openai.serving_tokenize import OpenAIServingTokenization
from appliance.serve.ports import bind_http_socket
from appliance.serve.state import FrontEndState

log = logging.getLogger("appliance.serve.http")     # the HTTP front end's logger, by the name log filters use
OPEN_PATHS = ("/health",)                  # answered without a token so that probes work
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def create_app(server: FrontEndState, chat_format: ChatFormat | None) -> FastAPI:
    """The routes on `server`'s engine, behind the bearer token, with OpenAI-style errors."""
    completion = OpenAIServingCompletion(server)
    chat = OpenAIServingChat(server, chat_format)
    tokenization = OpenAIServingTokenization(chat)
    models = OpenAIServingModels(server)
    token = server.rc.server.auth_token
    registry = metrics_registry(server.engine.stats, models.model)
    app = FastAPI(title="appliance", docs_url=None, redoc_url=None, openapi_url=None,
                  max_body_size=server.rc.server.http_max_body_bytes)   # 413 while a body is read (http_limits)
    app.add_middleware(TokenAndFaults, token=token)
    install_error_handlers(app, request_field_names())
    app.post("/v1/completions")(completion.completions)
    app.post("/v1/chat/completions")(chat.chat_completions)
    app.get("/v1/models")(models.models)
    app.post("/tokenize")(tokenization.tokenize)
    app.post("/detokenize")(tokenization.detokenize)
    app.get("/health")(models.health)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(registry), media_type=PROMETHEUS_CONTENT_TYPE)

    return app


class TokenAndFaults:
    """ASGI middleware: the bearer token (server.auth_token) on every path but OPEN_PATHS; and an unexpected fault in
    a handler, before its response started, answered as a JSON 500 that keeps the connection (Starlette's own 500 is
    plain text, and uvicorn then closes the connection).

    Plain ASGI, not Starlette's BaseHTTPMiddleware (`@app.middleware("http")`), which relays every response body
    through a memory stream and a task of its own: a streamed completion paid that per server-sent event (about a
    third of the HTTP front end's event-loop time with 64 streams, bench/bench_http.py)."""

    def __init__(self, app: ASGIApp, token: str | None):
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.token and scope["path"] not in OPEN_PATHS and not bearer_token_matches(
                Headers(scope=scope).get("authorization"), self.token):
            err = ApiError(401, "missing or wrong bearer token (send the header Authorization: Bearer <token>)",
                           type_="authentication_error", code="invalid_api_key")
            return await JSONResponse(err.body(), status_code=401, headers={"www-authenticate": "Bearer"})(
                scope, receive, send)
        started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception as exc:
            log.exception("unexpected error answering %s", scope["path"])
            if started:                # too late for a status: the connection ends, as with any broken response
                raise
            await JSONResponse(internal_error(exc).body(), status_code=500)(scope, receive, send)


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn on the gRPC server's event loop. The appliance owns SIGTERM/SIGINT (drain first, then stop both
    front ends), so uvicorn must not install its own signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpFrontEnd:
    """uvicorn serving the app on a socket bound here (so a busy port is an error we word, not uvicorn's exit).
    bind() -> start() -> stop(); close_unstarted() releases a port bound by a start that did not happen."""

    def __init__(self, server: FrontEndState, http_port: int):
        self.server = server
        self.http_port = http_port                         # as configured (0: any free port)
        self.port: int | None = None                       # once bound
        self._socket: socket.socket | None = None          # bound, not yet served
        self._serving: tuple[EmbeddedUvicorn, asyncio.Task[None]] | None = None

    def bind(self, taken_ports: tuple[int | None, ...] = ()) -> int:
        """Bind server.host:server.http_port now, before gRPC says it listens, so a busy port stops the start
        before anything is announced. `taken_ports` (the gRPC port) are never suggested as the fix."""
        return self._bind(taken_ports).getsockname()[1]

    def _bind(self, taken_ports: tuple[int | None, ...] = ()) -> socket.socket:
        sock = bind_http_socket(self.server.rc.server.host, self.http_port, taken_ports)
        self._socket, self.port = sock, sock.getsockname()[1]
        return sock

    async def start(self, grace_s: float) -> int:
        """Serve on the bound socket (bound now if it was not); the port, once uvicorn has started."""
        srv = self.server.rc.server
        sock = self._socket or self._bind()
        port: int = sock.getsockname()[1]
        try:
            try:
                chat_format = load_chat_format(self.server.rc.model)
            except ChatTemplateError as exc:      # a startup fault like a bad config: exit 2, naming the file
                raise ConfigError([ConfigIssue("model.weights", self.server.rc.model.weights, str(exc))]) from None
            app = BodyLimit(create_app(self.server, chat_format), srv.http_max_body_bytes)
            # uvicorn annotates timeout_graceful_shutdown as int; it is a wait_for timeout, where a float works.
            config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                    ssl_certfile=srv.tls_cert_file, ssl_keyfile=srv.tls_key_file,
                                    timeout_graceful_shutdown=max(grace_s, 0.1),  # type: ignore[arg-type]
                                    **uvicorn_limits(srv.http_read_timeout_s, srv.http_max_connections))
            server = EmbeddedUvicorn(config)
            task = asyncio.ensure_future(server.serve(sockets=[sock]))
            self._serving = server, task
            while not server.started and not task.done():
                await asyncio.sleep(0.005)
            if task.done():
                task.result()          # raises what stopped uvicorn during its startup
                raise RuntimeError("the HTTP server stopped during its startup")
        except BaseException:
            sock.close()
            self._serving = None
            raise
        self._socket = None
        return port

    def close_unstarted(self) -> None:
        """Release a port bound by bind() when the server stops before start()."""
        if self._socket is not None and self._serving is None:
            self._socket.close()

    async def stop(self, budget_s: float) -> None:
        """Stop within budget_s: uvicorn's graceful stop first, then its forced exit (open streams are cut)."""
        if self._serving is None:
            return
        server, task = self._serving
        server.should_exit = True
        done, _ = await asyncio.wait({task}, timeout=max(budget_s, 0.0))
        if not done:
            server.force_exit = True
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._serving = None
