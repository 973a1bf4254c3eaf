"""The gRPC front end: the Appliance service (Startup, streaming Generate, Stats), grpc.health.v1, reflection,
TLS and the bearer token, on grpc.aio.

Why grpc.aio: every open Generate stream is one coroutine waiting on an asyncio.Queue, so thousands of
concurrent streams cost no threads. A sync server would pin one worker thread per open stream, and
max_num_seqs + max_waiting_requests streams (272 by default) would need that many threads. The engine
thread hands each delta to the event loop with call_soon_threadsafe; blocking engine calls run off the loop,
so health checks and Startup answer while the engine loads.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from appliance.core.request import (
    EngineUnavailableError,
    QueueFullError,
    RequestError,
    RequestOutput,
)
from appliance.serve.api import appliance_pb2 as pb
from appliance.serve.api import appliance_pb2_grpc as pb_grpc
from appliance.serve.auth import BearerTokenInterceptor
from appliance.serve.convert import generate_response, request_prompt, sampling_params, stats_response
from appliance.serve.malformed import MalformedRequestInterceptor
from appliance.serve.ports import ServerBindError, grpc_bind_failure, host_port
from appliance.serve.state import ServerState, StartupState
from appliance.serve.streams import open_stream

log = logging.getLogger("appliance.serve.server")      # the gRPC front end's logger, by the name log filters use
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Appliance"].full_name   # "appliance.v1.Appliance"
HEALTH_SERVICES = ("", SERVICE_NAME)
MAX_DETAILS_CHARS = 2048     # of a status message (see short)


def short(details: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """Status details cut to `limit` characters: they travel in HTTP/2 headers, whose 16 KiB limit a longer message
    breaks (the client then sees RESOURCE_EXHAUSTED "Stream removed" instead of the error)."""
    return details if len(details) <= limit else details[:limit] + "..."


class ApplianceService(pb_grpc.ApplianceServicer):
    """The RPCs; read the server's state (starting / serving / draining) through `server`."""

    def __init__(self, server: StartupState):
        self.server = server

    async def Startup(self, request: pb.StartupRequest, context: grpc.aio.ServicerContext) -> pb.StartupResponse:
        srv = self.server
        if not srv.ready.is_set():
            timeout = context.time_remaining()
            timeout = srv.rc.server.startup_timeout_s if timeout is None else max(timeout - 0.05, 0.0)
            try:
                await asyncio.wait_for(srv.ready.wait(), timeout)
            except asyncio.TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"the engine is still starting after {timeout:.1f} s")
        message = srv.startup_message
        if srv.start_error is None and message is not None:
            return message
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"engine start failed: {srv.start_error}")
        raise RuntimeError("context.abort returned")      # it raises: never reached

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        srv = self.server
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
        return stats_response(self.server.engine.stats(), self.server.state)


class GrpcFrontEnd:
    """grpc.aio serving the Appliance service, grpc.health.v1 and reflection; the server binds and starts it beside
    the HTTP front end. open() builds the grpc.aio server, on the event loop: grpc.aio ties a server to the loop it
    is made on, and this object is made before the loop runs."""

    def __init__(self, server: StartupState, tls: tuple[bytes, bytes] | None):
        self.server = server
        self.port: int | None = None                     # once bound
        self._tls = tls
        self._grpc: grpc.aio.Server | None = None        # made by open(), on the event loop
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
        server = grpc.aio.server(options=options, interceptors=interceptors)
        pb_grpc.add_ApplianceServicer_to_server(ApplianceService(self.server), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server)
        self._grpc = server
        await self.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def bind(self) -> int:
        """Bind server.host:server.port (checked free first: see ports.check_grpc_port_free); the port bound."""
        srv = self.server.rc.server
        server = self._opened()
        port = 0
        try:
            bind = host_port(srv.host, srv.port)
            if self._tls is not None:
                port = server.add_secure_port(bind, grpc.ssl_server_credentials([self._tls]))
            else:
                port = server.add_insecure_port(bind)
        except RuntimeError:          # grpc raises "Failed to bind"; older releases return 0
            pass
        if not port:
            raise ServerBindError(grpc_bind_failure(srv.host, srv.port, None))
        self.port = port
        return port

    async def start(self) -> None:
        await self._opened().start()

    async def stop(self, budget_s: float) -> None:
        if self._grpc is not None:
            await self._grpc.stop(budget_s)

    async def set_health(self, status: int) -> None:
        for name in HEALTH_SERVICES:
            await self._health.set(name, status)

    def _opened(self) -> grpc.aio.Server:
        if self._grpc is None:
            raise RuntimeError("GrpcFrontEnd.open() first: the grpc.aio server is made on the event loop")
        return self._grpc
