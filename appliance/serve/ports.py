"""Every port the server binds, checked and explained in one place: server.port (gRPC) and server.http_port (HTTP).

Why here and not in each front end: a busy port stops the start before anything is announced, with the reason and
a fix worded the same way for both, and the fix never suggests a port the configuration already gives to the other
front end (a busy server.port=8000 must not suggest server.port=8001 when server.http_port=8001).
"""

from __future__ import annotations

import errno
import os
import socket

from appliance.core.errors import StartupError

FALLBACK_PORT = 50052
IN_USE_BY = "another server, or an appliance still running"
NOT_LOCAL = "the host is not an address of this machine or the port is in use"


class ServerBindError(StartupError, OSError):
    """server.host with server.port or server.http_port cannot be bound (the CLI exits 2 with the message)."""


def suggested_port(busy: int, taken_ports: tuple[int | None, ...] = ()) -> int:
    """The next port after `busy` that is not in `taken_ports` (wrapping to a high port at the top of the range)."""
    candidate = busy + 1 if 0 < busy < 65535 else FALLBACK_PORT
    while candidate in taken_ports or candidate == busy:
        candidate = candidate + 1 if candidate < 65535 else 1024
    return candidate


def host_port(host: str, port: int | None) -> str:
    """"HOST:PORT"; an IPv6 literal, given with or without brackets, gets exactly one pair."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def socket_address(host: str) -> tuple[str, socket.AddressFamily]:
    """server.host as a socket binds it: brackets off, IPv6 when the literal has a colon."""
    address = host.strip("[]")
    return address, socket.AF_INET6 if ":" in address else socket.AF_INET


# -- gRPC: server.port ---------------------------------------------------------------------------------

def check_grpc_port_free(host: str, port: int, taken_ports: tuple[int | None, ...] = ()) -> None:
    """Bind server.host:server.port with a plain socket first, so a busy port or a foreign address is reported
    with its reason and the fix (gRPC only logs a C-core line and fails). Port 0 picks a free port: nothing to check.
    `taken_ports` (server.http_port) are never suggested as the fix."""
    if port == 0:
        return
    address, family = socket_address(host)
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as gRPC binds: TIME_WAIT does not block
        try:
            probe.bind((address, port))
        except OSError as exc:
            raise ServerBindError(grpc_bind_failure(host, port, exc, taken_ports)) from None


def grpc_bind_failure(host: str, port: int, exc: OSError | None, taken_ports: tuple[int | None, ...] = ()) -> str:
    """Why server.host:server.port cannot be bound, and what to change."""
    where = f"cannot listen on server.host={host} server.port={port}"
    if exc is not None and exc.errno == errno.EADDRINUSE:
        return (f"{where}: the port is in use ({IN_USE_BY}). Fix: pick a free "
                f"port, e.g. server.port={suggested_port(port, taken_ports)}, or stop the process holding it")
    if exc is not None and exc.errno == errno.EACCES:
        return f"{where}: ports below 1024 need privileges. Fix: server.port=50051 (or any port from 1024 up)"
    reason = f" ({exc.strerror or exc})" if exc is not None else ""
    return (f"{where}{reason}: {NOT_LOCAL}. Fix: "
            f"server.host=127.0.0.1 (or 0.0.0.0 with TLS or server.insecure=true), or another server.port")


# -- HTTP: server.http_port ----------------------------------------------------------------------------

def bind_http_socket(host: str, port: int, taken_ports: tuple[int | None, ...] = ()) -> socket.socket:
    """A listening socket on server.host:server.http_port, bound here so that a busy port is an error we word,
    not uvicorn's exit. `taken_ports` (server.port) are never suggested as the fix."""
    address, family = socket_address(host)
    try:
        return socket.create_server((address, port), family=family)
    except OSError as exc:
        raise ServerBindError(http_bind_failure(host, port, exc, taken_ports)) from None


def http_bind_failure(host: str, port: int, exc: OSError, taken_ports: tuple[int | None, ...] = ()) -> str:
    """Why server.host:server.http_port cannot be bound, and a fix that is not another configured port."""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    where = f"cannot listen on server.host:server.http_port {host}:{port}: {reason}"
    if exc.errno == errno.EADDRINUSE:
        return (f"{where} ({IN_USE_BY}). Fix: pick a free port, e.g. "
                f"server.http_port={suggested_port(port, taken_ports)}, stop the process holding it, "
                f"or server.http_port=null to disable HTTP")
    return (f"{where} ({NOT_LOCAL}). Fix: another "
            f"server.host or server.http_port, or server.http_port=null to disable HTTP")
