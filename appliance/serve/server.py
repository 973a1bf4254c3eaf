"""gRPC server (mode=serve): Startup, streaming Generate, grpc.health.v1, reflection, TLS, bearer token.

Why grpc.aio: every open Generate stream is one coroutine waiting on an asyncio.Queue, so thousands of
concurrent streams cost no threads. A sync server would pin one worker thread per open stream, and
max_num_seqs + max_waiting_requests streams (272 by default) would need that many threads. The engine
thread hands each delta to the event loop with call_soon_threadsafe; blocking engine calls (start, submit,
drain, shutdown) run off the loop, so health checks and Startup answer while the engine loads.

The server (ApplianceServer) holds the state and the engine and starts its two front ends side by side: gRPC
(GrpcFrontEnd, below) and the OpenAI-compatible HTTP (appliance/serve/http.py), both reading one ServerState.

Lifecycle of `serve(rc)`: bind both ports (print "listening on HOST:PORT"), health NOT_SERVING ->
engine.start() in a thread -> print the startup report and write startup_report.json -> health SERVING. On
SIGTERM/SIGINT: health NOT_SERVING, refuse new Generate calls (UNAVAILABLE), engine.drain(grace_period_s),
stop both front ends, engine.shutdown(), return (exit 0). Everything after the grace shares SHUTDOWN_TAIL_S,
so the process is gone within grace_period_s + 2 s even when an engine step or a stream outlasts it.
A signal during the engine start waits (up to the same bound) for the start to end and shuts the engine down:
a thread still inside torch when the interpreter finalizes is killed mid-C++ and aborts the process.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import sys
import threading
import uuid
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from appliance.core.config import RuntimeConfig
from appliance.core.errors import StartupError
from appliance.core.request import (
    EngineUnavailableError,
    QueueFullError,
    RequestError,
    RequestOutput,
)
from appliance.core.startup_report import StartupReport
from appliance.modes.results import write_result
from appliance.serve.api import appliance_pb2 as pb
from appliance.serve.api import appliance_pb2_grpc as pb_grpc
from appliance.serve.auth import BearerTokenInterceptor, token_file_warning
from appliance.serve.convert import (
    generate_response,
    request_prompt,
    sampling_params,
    startup_response,
    stats_response,
)
from appliance.serve.http import HttpBindError, HttpFrontEnd
from appliance.serve.malformed import MalformedRequestInterceptor
from appliance.serve.ports import suggested_port
from appliance.serve.state import EngineClient, ServerState
from appliance.serve.streams import open_stream
from appliance.serve.tls import load_tls_pair

log = logging.getLogger("appliance.serve.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Appliance"].full_name   # "appliance.v1.Appliance"
HEALTH_SERVICES = ("", SERVICE_NAME)
EXIT_ENGINE_FAILED = 1       # the engine stopped while serving (a rank died): a service manager restarts it
FLUSH_GRACE_S = 2.0          # after the drain: time for the last messages of finished streams to go out
SHUTDOWN_TAIL_S = 2.0        # after server.grace_period_s: abort the rest, flush, stop both front ends and the engine
FRONT_ENDS_STOP_S = 0.8      # of the tail: stopping gRPC and HTTP (the last messages go out meanwhile)
EXIT_RESERVE_S = 0.2         # of the tail: the process leaving (appliance.cli skips the interpreter's teardown)
MAX_DETAILS_CHARS = 2048     # of a status message (see short)


# -- service -------------------------------------------------------------------------------------------

class ApplianceService(pb_grpc.ApplianceServicer):
    """The RPCs; read the server's state (starting / serving / draining) through `server`."""

    def __init__(self, server: "ApplianceServer"):
        self._server = server

    async def Startup(self, request: pb.StartupRequest, context: grpc.aio.ServicerContext) -> pb.StartupResponse:
        srv = self._server
        if not srv.ready.is_set():
            timeout = context.time_remaining()
            timeout = srv.rc.server.startup_timeout_s if timeout is None else max(timeout - 0.05, 0.0)
            try:
                await asyncio.wait_for(srv.ready.wait(), timeout)
            except asyncio.TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"the engine is still starting after {timeout:.1f} s")
        if srv.start_error is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"engine start failed: {srv.start_error}")
        return srv.startup_message

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        srv = self._server
        if srv.state is not ServerState.SERVING:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine is {srv.state}; retry when health is SERVING")
        request_id = request.request_id or uuid.uuid4().hex
        try:
            prompt = request_prompt(request)
            params = sampling_params(request.sampling)
            stream = await open_stream(srv.engine, srv.executor, request_id, prompt, params, srv.open_streams)
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, short(str(exc)),
                                trailing_metadata=(("invalid-field", exc.field),))
        except QueueFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"wait queue full: {exc}")
        except EngineUnavailableError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {exc}")
        except Exception as exc:      # noqa: BLE001 - INTERNAL and why, rather than gRPC's UNKNOWN
            log.exception("submit failed")
            await context.abort(grpc.StatusCode.INTERNAL,
                                short(f"the request could not be submitted: {type(exc).__name__}: {exc}"))

        finished = False
        try:
            # Headers go out at once: the client learns the request was accepted (queued) and its id.
            await context.send_initial_metadata((("request-id", request_id),))
            while not finished:
                out = await stream.next_output()
                finished = out.finished
                if out.error is not None:
                    finished = True
                    if out.new_token_ids or out.new_text:
                        yield generate_response(RequestOutput(out.request_id, out.new_token_ids, out.new_text))
                    if out.error_field is not None:        # the request's own field: its grammar was refused
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, short(f"{out.error_field}: {out.error}"),
                                            trailing_metadata=(("invalid-field", out.error_field),))
                    if srv.engine.failure is not None:     # the engine stopped (a rank died)
                        await context.abort(grpc.StatusCode.UNAVAILABLE, f"request {request_id} failed: {out.error}; "
                                            f"the server is shutting down (retry after it restarts)")
                    await context.abort(grpc.StatusCode.INTERNAL,
                                        short(f"request {request_id} failed inside the engine: {out.error}"))
                yield generate_response(out)
        finally:
            if not finished:      # client cancel, deadline, or server stop: free its blocks now
                stream.abort()

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return stats_response(self._server.engine.stats(), self._server.state)


def short(details: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """Status details cut to `limit` characters: they travel in HTTP/2 headers, whose 16 KiB limit a longer message
    breaks (the client then sees RESOURCE_EXHAUSTED "Stream removed" instead of the error)."""
    return details if len(details) <= limit else details[:limit] + "..."


def host_port(host: str, port: int | None) -> str:
    """"HOST:PORT" for gRPC; an IPv6 literal, given with or without brackets, gets exactly one pair."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ServerBindError(StartupError, OSError):
    """server.host:server.port cannot be bound (the CLI exits 2 with the message)."""


def check_port_free(host: str, port: int, taken_ports: tuple[int | None, ...] = ()) -> None:
    """Bind server.host:server.port with a plain socket first, so a busy port or a foreign address is reported
    with its reason and the fix (gRPC only logs a C-core line and fails). Port 0 picks a free port: nothing to check.
    `taken_ports` (server.http_port) are never suggested as the fix."""
    if port == 0:
        return
    address = host.strip("[]")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as gRPC binds: TIME_WAIT does not block
        try:
            probe.bind((address, port))
        except OSError as exc:
            raise ServerBindError(bind_failure(host, port, exc, taken_ports)) from None


def bind_failure(host: str, port: int, exc: OSError | None, taken_ports: tuple[int | None, ...] = ()) -> str:
    """Why server.host:server.port cannot be bound, and what to change."""
    where = f"cannot listen on server.host={host} server.port={port}"
    if exc is not None and exc.errno == errno.EADDRINUSE:
        return (f"{where}: the port is in use (another server, or an appliance still running). Fix: pick a free "
                f"port, e.g. server.port={suggested_port(port, taken_ports)}, or stop the process holding it")
    if exc is not None and exc.errno == errno.EACCES:
        return f"{where}: ports below 1024 need privileges. Fix: server.port=50051 (or any port from 1024 up)"
    reason = f" ({exc.strerror or exc})" if exc is not None else ""
    return (f"{where}{reason}: the host is not an address of this machine or the port is in use. Fix: "
            f"server.host=127.0.0.1 (or 0.0.0.0 with TLS or server.insecure=true), or another server.port")


# -- the gRPC front end ---------------------------------------------------------------------------------

class GrpcFrontEnd:
    """grpc.aio serving the Appliance service, grpc.health.v1 and reflection; the server binds and starts it beside
    the HTTP front end."""

    def __init__(self, server: "ApplianceServer", tls: tuple[bytes, bytes] | None):
        self.server = server
        self.port: int | None = None
        self._tls = tls
        self._grpc: grpc.aio.Server | None = None
        self._health = health_aio.HealthServicer()

    async def open(self) -> None:
        """The grpc.aio server with its services, health NOT_SERVING (on the event loop, not yet bound)."""
        srv = self.server.rc.server
        options = [("grpc.max_send_message_length", srv.max_message_bytes),
                   ("grpc.max_receive_message_length", srv.max_message_bytes),
                   ("grpc.so_reuseport", 0)]       # a second server on a busy port must fail, not share it
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if srv.auth_token:
            interceptors.append(BearerTokenInterceptor(srv.auth_token))
        interceptors.append(MalformedRequestInterceptor())
        self._grpc = grpc.aio.server(options=options, interceptors=interceptors)
        pb_grpc.add_ApplianceServicer_to_server(ApplianceService(self.server), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._grpc)
        await self.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def bind(self) -> int:
        """Bind server.host:server.port (checked free first: see check_port_free); the port bound."""
        srv = self.server.rc.server
        assert self._grpc is not None, "open() first"
        port = 0
        try:
            bind = host_port(srv.host, srv.port)
            if self._tls is not None:
                port = self._grpc.add_secure_port(bind, grpc.ssl_server_credentials([self._tls]))
            else:
                port = self._grpc.add_insecure_port(bind)
        except RuntimeError:          # grpc raises "Failed to bind"; older releases return 0
            pass
        if not port:
            raise ServerBindError(bind_failure(srv.host, srv.port, None))
        self.port = port
        return port

    async def start(self) -> None:
        assert self._grpc is not None, "open() first"
        await self._grpc.start()

    async def stop(self, budget_s: float) -> None:
        if self._grpc is not None:
            await self._grpc.stop(budget_s)

    async def set_health(self, status: int) -> None:
        for name in HEALTH_SERVICES:
            await self._health.set(name, status)


# -- server --------------------------------------------------------------------------------------------

class ApplianceServer:
    """One engine and its two front ends, gRPC and HTTP (server.http_port; null: gRPC only), started side by side.
    `run()` is the whole lifecycle; `request_shutdown()` ends it."""

    def __init__(self, rc: RuntimeConfig, engine: EngineClient, output_dir: Path | None = None):
        self.rc = rc
        self.engine = engine
        self.output_dir = output_dir                 # where startup_report.json goes (the Hydra job dir)
        self.state = ServerState.STARTING
        self.failure: str | None = None              # why the engine stopped while serving: the process exits 1
        self.report: StartupReport | None = None
        self.startup_message: pb.StartupResponse | None = None
        self.start_error: BaseException | None = None
        self.port: int | None = None
        self.open_streams: set = set()               # RequestStreams of both front ends not yet finished
        self.executor: Executor = ThreadPoolExecutor(max_workers=rc.server.workers, thread_name_prefix="grpc-submit")
        self.ready: asyncio.Event | None = None      # set when the engine start finished (well or not)
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The TLS pair is checked here, before the engine's preflight and the bind.
        self.grpc = GrpcFrontEnd(self, load_tls_pair(rc.server))
        warning = token_file_warning(rc.server.auth_token_file)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        self.http = HttpFrontEnd(self) if rc.server.http_port is not None else None   # OpenAI-compatible HTTP
        engine.on_failure = self._engine_failed

    @property
    def address(self) -> str:
        return host_port(self.rc.server.host, self.port)

    def request_shutdown(self) -> None:
        """Thread-safe: begin the graceful shutdown (what SIGTERM/SIGINT do)."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def _engine_failed(self, message: str) -> None:
        """Engine thread: the engine stopped for good (a rank died). Health NOT_SERVING at once, then the usual
        shutdown (the ranks stopped), and `serve` exits non-zero so a service manager restarts the server."""
        def fail() -> None:
            self.failure, self.state = message, ServerState.FAILED
            print(f"error: the engine stopped: {message}; shutting down", file=sys.stderr, flush=True)
            asyncio.ensure_future(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))
            self._stop.set()

        if self._loop is not None:
            self._loop.call_soon_threadsafe(fail)

    async def run(self, install_signal_handlers: bool = False) -> dict[str, Any]:
        self._loop = asyncio.get_running_loop()
        self.ready, self._stop = asyncio.Event(), asyncio.Event()
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._stop.set)
        await self._start_front_ends()
        start = self._start_engine()
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done() or start.exception() is not None:
            stop.cancel()
        if not start.done():                         # stopped while the engine was still starting
            await self._stop_during_start(start)
            return {"status": "interrupted", "mode": "serve", "address": self.address}
        if start.exception() is not None:
            self.start_error = start.exception()
            self.ready.set()
            await self._stop_http(FLUSH_GRACE_S)
            await self.grpc.stop(FLUSH_GRACE_S)
            self.executor.shutdown(wait=False)
            raise self.start_error
        await self._on_started(start.result())
        await stop
        await self._shutdown()
        if self.failure is not None:
            return {"status": "failed", "mode": "serve", "address": self.address, "reason": self.failure}
        return {"status": "ok", "mode": "serve", "address": self.address,
                "capacity_slots": self.report.capacity_slots}

    async def _stop_during_start(self, start: asyncio.Future) -> None:
        """Stop without serving; wait for the engine start to end (it cannot be interrupted inside torch) and
        shut the engine down, within grace_period_s + SHUTDOWN_TAIL_S. A start still running then is left to
        appliance.cli, which ends the process without the interpreter's teardown."""
        deadline = self._loop.time() + self.rc.server.grace_period_s + SHUTDOWN_TAIL_S - EXIT_RESERVE_S
        print(f"shutdown requested during engine start; stopping without serving (the start may take up to "
              f"{self.rc.server.grace_period_s + SHUTDOWN_TAIL_S:g} s more to wind down)", flush=True)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.state = ServerState.STOPPED
        await asyncio.gather(self._stop_http(FRONT_ENDS_STOP_S), self.grpc.stop(0))
        await asyncio.wait({start}, timeout=max(deadline - self._loop.time(), 0.0))
        if start.done() and start.exception() is None:
            await self._within(deadline, self.engine.shutdown)
        self.executor.shutdown(wait=False)

    async def _within(self, deadline: float, blocking: Any, *args: Any) -> bool:
        """Run a blocking engine call in a daemon thread until the loop time `deadline`; whether it finished.
        A daemon thread, not the executor: an overrunning call must not hold the process at exit."""
        fut = self._loop.create_future()

        def settle(exc: BaseException | None) -> None:
            if not fut.done():
                fut.set_exception(exc) if exc is not None else fut.set_result(None)

        def target() -> None:
            exc = None
            try:
                blocking(*args)
            except BaseException as e:      # noqa: BLE001 - re-raised on the loop
                exc = e
            try:
                self._loop.call_soon_threadsafe(settle, exc)
            except RuntimeError:            # the loop closed meanwhile
                pass

        threading.Thread(target=target, name=f"engine-{getattr(blocking, '__name__', 'call')}", daemon=True).start()
        done, _ = await asyncio.wait({fut}, timeout=max(deadline - self._loop.time(), 0.0))
        if done:
            fut.result()
        return bool(done)

    async def _start_front_ends(self) -> None:
        """Both front ends, side by side: each port is bound before either says it listens (a busy one stops the
        start before anything is announced), then gRPC starts, then HTTP."""
        srv = self.rc.server
        try:
            await self.grpc.open()
            check_port_free(srv.host, srv.port, (srv.http_port,))
            if self.http is not None:
                try:
                    self.http.bind(taken_ports=(srv.port,))
                except HttpBindError as exc:
                    raise ServerBindError(str(exc)) from None
            self.port = self.grpc.bind()
            await self.grpc.start()
        except BaseException:
            if self.http is not None:
                self.http.close_unstarted()
            raise
        tls = "TLS" if srv.tls_cert_file else "plaintext"
        print(f"listening on {self.address} ({tls}{', bearer token' if srv.auth_token else ''}); "
              f"health NOT_SERVING while the engine starts", flush=True)
        await self._start_http()

    async def _start_http(self) -> None:
        """The OpenAI-compatible HTTP front end beside gRPC (server.http_port; null disables it)."""
        if self.http is None:
            return
        try:
            port = await self.http.start(FLUSH_GRACE_S)
        except BaseException as exc:
            await self.grpc.stop(0)
            if isinstance(exc, HttpBindError):
                raise ServerBindError(str(exc)) from None
            raise
        srv = self.rc.server
        where = host_port(srv.host, port)
        scheme = "https" if srv.tls_cert_file else "http"
        print(f"http listening on {where} ({scheme}://{where}/v1 OpenAI-compatible, /health, /metrics"
              f"{'; bearer token' if srv.auth_token else ''})", flush=True)

    async def _stop_http(self, budget_s: float) -> None:
        if self.http is not None:
            await self.http.stop(budget_s)

    def _start_engine(self) -> asyncio.Future:
        """engine.start() in a daemon thread: it blocks for minutes on big models, and a shutdown requested
        meanwhile must not wait for it (the process exits; the OS frees the device)."""
        loop, fut = self._loop, self._loop.create_future()

        def settle(result: Any, exc: BaseException | None) -> None:
            if fut.done():
                return
            fut.set_exception(exc) if exc is not None else fut.set_result(result)

        def target() -> None:
            try:
                result, exc = self.engine.start(), None
            except BaseException as e:      # noqa: BLE001 - handed to the event loop, re-raised there
                result, exc = None, e
            try:
                loop.call_soon_threadsafe(settle, result, exc)
            except RuntimeError:           # loop already closed: the server stopped during start
                pass

        threading.Thread(target=target, name="engine-start", daemon=True).start()
        return fut

    async def _on_started(self, report: StartupReport) -> None:
        self.report = report if report is not None else self.engine.report
        self.startup_message = startup_response(self.report)
        # The engine has logged the capacity table (Hydra's job logging shows it on the terminal).
        path = write_result(self.output_dir, "startup_report.json", self.report.to_dict())
        if path:
            print(f"startup report written to {path}", flush=True)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.state = ServerState.SERVING
        self.ready.set()
        print(f"SERVING on {self.address}", flush=True)

    async def _shutdown(self) -> None:
        """Drain for the grace, then share SHUTDOWN_TAIL_S: the engine aborts what is left and streams it, both
        front ends stop (the last messages go out), the engine shuts down. No step waits past its share: a
        step or a rank teardown that outlasts it is left to appliance.cli, which ends the process."""
        grace = self.rc.server.grace_period_s
        deadline = self._loop.time() + grace + SHUTDOWN_TAIL_S - EXIT_RESERVE_S
        print(f"shutting down: health NOT_SERVING, draining for up to {grace} s", flush=True)
        self.state = ServerState.FAILED if self.failure is not None else ServerState.DRAINING
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        drained = await self._within(deadline - FRONT_ENDS_STOP_S, self.engine.drain, grace)
        if not drained or self.failure is not None:   # streams the engine could not end (in time): ended here,
            for stream in list(self.open_streams):    # with why the engine stopped if it did
                stream.end_aborted(self.failure)
            await asyncio.sleep(0)               # let their handlers send the finish
        budget = max(deadline - self._loop.time() - 0.1, 0.0) / 2   # half to the front ends, half to the engine
        await asyncio.gather(self._stop_http(budget), self.grpc.stop(budget))
        self.state = ServerState.STOPPED
        stopped = await self._within(deadline, self.engine.shutdown)
        self.executor.shutdown(wait=False)
        print("stopped" if stopped else "stopped (the engine was still stopping; the process ends anyway)",
              flush=True)

    async def _set_health(self, status: int) -> None:
        await self.grpc.set_health(status)


def serve(rc: RuntimeConfig, engine: EngineClient | None = None, output_dir: Path | None = None) -> dict[str, Any]:
    """mode=serve: run the server until SIGTERM/SIGINT.

    Before the port is bound: the TLS pair loads, then the engine's preflight (checkpoint files, backend, whether
    the weights can fit, tokenizer). Any startup fault, there or while the engine starts, raises a StartupError.
    """
    if engine is None:
        from appliance.engine.engine import (
            Engine,  # imported here: torch loads only when serving for real
        )
        engine = Engine(rc)
    server = ApplianceServer(rc, engine, output_dir)
    engine.prepare()
    result = asyncio.run(server.run(install_signal_handlers=True))
    sys.stdout.flush()
    if server.failure is not None:       # exit 1 at once: the process group of the lost ranks has no clean teardown
        from npu.ranks import leave_process
        leave_process(EXIT_ENGINE_FAILED)
    return result
