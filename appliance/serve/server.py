"""The server (mode=serve): one engine and its two front ends, gRPC (appliance/serve/grpc.py) and the
OpenAI-compatible HTTP (appliance/serve/openai/), started side by side and reading one ServerState; here is their
lifecycle: start, serving, drain, stop.

Lifecycle of `serve(rc)`: bind both ports (print "listening on HOST:PORT"), health NOT_SERVING ->
engine.start() in a thread -> print the startup report and write startup_report.json -> health SERVING. On
SIGTERM/SIGINT: health NOT_SERVING, refuse new Generate calls (UNAVAILABLE), engine.drain(grace_period_s),
stop both front ends, engine.shutdown(), return (exit 0). Everything after the grace shares SHUTDOWN_TAIL_S,
so the process is gone within grace_period_s + 2 s even when an engine step or a stream outlasts it.
A signal during the engine start waits (up to the same bound) for the start to end and shuts the engine down:
a thread still inside torch when the interpreter finalizes is killed mid-C++ and aborts the process.
The server is made before its event loop runs (tests run it on a thread of their own), so it holds no loop: a
shutdown request from any thread (a signal, a test) goes through a concurrent Future that run() awaits, and run()
gives the engine an on_failure bound to its own loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2

from appliance.core.config import RuntimeConfig
from appliance.core.startup_report import StartupReport
from appliance.modes.results import write_result
from appliance.serve.api import appliance_pb2 as pb
from appliance.serve.auth import token_file_warning
from appliance.serve.convert import startup_response
from appliance.serve.grpc import GrpcFrontEnd
from appliance.serve.openai.app import HttpFrontEnd
from appliance.serve.ports import check_grpc_port_free, host_port
from appliance.serve.state import EngineClient, OpenStream, ServerState
from appliance.serve.tls import load_tls_pair

EXIT_ENGINE_FAILED = 1       # the engine stopped while serving (a rank died): a service manager restarts it
FLUSH_GRACE_S = 2.0          # after the drain: time for the last messages of finished streams to go out
SHUTDOWN_TAIL_S = 2.0        # after server.grace_period_s: abort the rest, flush, stop both front ends and the engine
FRONT_ENDS_STOP_S = 0.8      # of the tail: stopping gRPC and HTTP (the last messages go out meanwhile)
EXIT_RESERVE_S = 0.2         # of the tail: the process leaving (appliance.cli skips the interpreter's teardown)


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
        self.open_streams: set[OpenStream] = set()     # of both front ends, not yet finished
        self.executor: Executor = ThreadPoolExecutor(max_workers=rc.server.workers, thread_name_prefix="grpc-submit")
        # Set when the engine start finished (well or not). An asyncio.Event binds to a loop when first awaited,
        # so it can be made here, before the loop that run() runs on.
        self.ready = asyncio.Event()
        # Any thread (a signal handler, a test, the engine's failure) asks for the shutdown through this; run()
        # awaits it on its loop.
        self._shutdown_requested: concurrent.futures.Future[None] = concurrent.futures.Future()
        # The TLS pair is checked here, before the engine's preflight and the bind.
        self.grpc = GrpcFrontEnd(self, load_tls_pair(rc.server))
        warning = token_file_warning(rc.server.auth_token_file)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        http_port = rc.server.http_port
        self.http = HttpFrontEnd(self, http_port) if http_port is not None else None   # OpenAI-compatible HTTP

    @property
    def address(self) -> str:
        return host_port(self.rc.server.host, self.port)

    def request_shutdown(self) -> None:
        """Thread-safe: begin the graceful shutdown (what SIGTERM/SIGINT do); once is enough."""
        with contextlib.suppress(concurrent.futures.InvalidStateError):    # asked before, or the server stopped
            self._shutdown_requested.set_result(None)

    def _engine_failed(self, message: str) -> None:
        """On the loop: the engine stopped for good (a rank died). Health NOT_SERVING at once, then the usual
        shutdown (the ranks stopped), and `serve` exits non-zero so a service manager restarts the server."""
        self.failure, self.state = message, ServerState.FAILED
        print(f"error: the engine stopped: {message}; shutting down", file=sys.stderr, flush=True)
        asyncio.ensure_future(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))
        self.request_shutdown()

    def _on_engine_failure(self, loop: asyncio.AbstractEventLoop) -> Callable[[str], None]:
        """The engine's on_failure: called on the engine's thread, it hands the failure to `loop`."""
        def on_failure(message: str) -> None:
            with contextlib.suppress(RuntimeError):      # the loop closed: the server has stopped already
                loop.call_soon_threadsafe(self._engine_failed, message)
        return on_failure

    async def run(self, install_signal_handlers: bool = False) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        self.engine.on_failure = self._on_engine_failure(loop)
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_shutdown)
        await self._start_front_ends()
        start = self._start_engine()
        stop = asyncio.wrap_future(self._shutdown_requested)
        first: set[asyncio.Future[Any]] = {start, stop}
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():                         # stopped while the engine was still starting
            await self._stop_during_start(start)
            return {"status": "interrupted", "mode": "serve", "address": self.address}
        error = start.exception()
        if error is not None:
            stop.cancel()
            self.start_error = error
            self.ready.set()
            await self._stop_http(FLUSH_GRACE_S)
            await self.grpc.stop(FLUSH_GRACE_S)
            self.executor.shutdown(wait=False)
            raise error
        report = await self._on_started(start.result())
        await stop
        await self._shutdown()
        if self.failure is not None:
            return {"status": "failed", "mode": "serve", "address": self.address, "reason": self.failure}
        return {"status": "ok", "mode": "serve", "address": self.address, "capacity_slots": report.capacity_slots}

    async def _stop_during_start(self, start: asyncio.Future[StartupReport]) -> None:
        """Stop without serving; wait for the engine start to end (it cannot be interrupted inside torch) and
        shut the engine down, within grace_period_s + SHUTDOWN_TAIL_S. A start still running then is left to
        appliance.cli, which ends the process without the interpreter's teardown."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.rc.server.grace_period_s + SHUTDOWN_TAIL_S - EXIT_RESERVE_S
        print(f"shutdown requested during engine start; stopping without serving (the start may take up to "
              f"{self.rc.server.grace_period_s + SHUTDOWN_TAIL_S:g} s more to wind down)", flush=True)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.state = ServerState.STOPPED
        await asyncio.gather(self._stop_http(FRONT_ENDS_STOP_S), self.grpc.stop(0))
        await asyncio.wait({start}, timeout=max(deadline - loop.time(), 0.0))
        if start.done() and start.exception() is None:
            await self._within(deadline, self.engine.shutdown)
        self.executor.shutdown(wait=False)

    @staticmethod
    async def _within(deadline: float, blocking: Callable[..., object], *args: Any) -> bool:
        """Run a blocking engine call in a daemon thread until the loop time `deadline`; whether it finished.
        A daemon thread, not the executor: an overrunning call must not hold the process at exit."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

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
                loop.call_soon_threadsafe(settle, exc)
            except RuntimeError:            # the loop closed meanwhile
                pass

        threading.Thread(target=target, name=f"engine-{getattr(blocking, '__name__', 'call')}", daemon=True).start()
        done, _ = await asyncio.wait({fut}, timeout=max(deadline - loop.time(), 0.0))
        if done:
            fut.result()
        return bool(done)

    async def _start_front_ends(self) -> None:
        """Both front ends, side by side: each port is bound before either says it listens (a busy one stops the
        start before anything is announced), then gRPC starts, then HTTP."""
        srv = self.rc.server
        try:
            await self.grpc.open()
            check_grpc_port_free(srv.host, srv.port, (srv.http_port,))
            if self.http is not None:
                self.http.bind(taken_ports=(srv.port,))
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
        except BaseException:
            await self.grpc.stop(0)
            raise
        srv = self.rc.server
        where = host_port(srv.host, port)
        scheme = "https" if srv.tls_cert_file else "http"
        print(f"http listening on {where} ({scheme}://{where}/v1 OpenAI-compatible, /health, /metrics"
              f"{'; bearer token' if srv.auth_token else ''})", flush=True)

    async def _stop_http(self, budget_s: float) -> None:
        if self.http is not None:
            await self.http.stop(budget_s)

    def _start_engine(self) -> asyncio.Future[StartupReport]:
        """engine.start() in a daemon thread: it blocks for minutes on big models, and a shutdown requested
        meanwhile must not wait for it (the process exits; the OS frees the device)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[StartupReport] = loop.create_future()

        def settle(result: StartupReport | None, exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            elif result is not None:
                fut.set_result(result)
            else:
                fut.set_exception(RuntimeError("engine.start() returned no startup report"))

        def target() -> None:
            result: StartupReport | None = None
            exc: BaseException | None = None
            try:
                result = self.engine.start() or self.engine.report
            except BaseException as e:      # noqa: BLE001 - handed to the event loop, re-raised there
                exc = e
            try:
                loop.call_soon_threadsafe(settle, result, exc)
            except RuntimeError:           # loop already closed: the server stopped during start
                pass

        threading.Thread(target=target, name="engine-start", daemon=True).start()
        return fut

    async def _on_started(self, report: StartupReport) -> StartupReport:
        self.report = report
        self.startup_message = startup_response(report)
        # The engine has logged the capacity table (Hydra's job logging shows it on the terminal).
        path = write_result(self.output_dir, "startup_report.json", report.to_dict())
        if path:
            print(f"startup report written to {path}", flush=True)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.state = ServerState.SERVING
        self.ready.set()
        print(f"SERVING on {self.address}", flush=True)
        return report

    async def _shutdown(self) -> None:
        """Drain for the grace, then share SHUTDOWN_TAIL_S: the engine aborts what is left and streams it, both
        front ends stop (the last messages go out), the engine shuts down. No step waits past its share: a
        step or a rank teardown that outlasts it is left to appliance.cli, which ends the process."""
        loop = asyncio.get_running_loop()
        grace = self.rc.server.grace_period_s
        deadline = loop.time() + grace + SHUTDOWN_TAIL_S - EXIT_RESERVE_S
        print(f"shutting down: health NOT_SERVING, draining for up to {grace} s", flush=True)
        self.state = ServerState.FAILED if self.failure is not None else ServerState.DRAINING
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        drained = await self._within(deadline - FRONT_ENDS_STOP_S, self.engine.drain, grace)
        if not drained or self.failure is not None:   # streams the engine could not end (in time): ended here,
            for stream in list(self.open_streams):    # with why the engine stopped if it did
                stream.end_aborted(self.failure)
            await asyncio.sleep(0)               # let their handlers send the finish
        budget = max(deadline - loop.time() - 0.1, 0.0) / 2   # half to the front ends, half to the engine
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
    if engine is None and rc.server.engine_process:     # the engine core in a process of its own (ZMQ)
        from appliance.engine.process.client import EngineProcessClient
        engine = EngineProcessClient(rc)
    elif engine is None:
        from appliance.engine.engine import (
            Engine,  # imported here: torch loads only when serving for real
        )
        engine = Engine(rc)
    server = ApplianceServer(rc, engine, output_dir)
    engine.prepare()
    result = asyncio.run(server.run(install_signal_handlers=True))
    sys.stdout.flush()
    if server.failure is not None:       # exit 1 at once: the process group of the lost ranks has no clean teardown
        from npu.leaving import leave_process
        leave_process(EXIT_ENGINE_FAILED)
    return result
