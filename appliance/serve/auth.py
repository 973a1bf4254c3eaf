"""Bearer-token authentication for the gRPC and HTTP front ends: constant-time comparison, health left open for
probes."""

from __future__ import annotations

import hmac
import os
import stat
from typing import Any

import grpc

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)   # answered without a token so that probes work


def bearer_token_matches(value: str | bytes | None, token: str) -> bool:
    """Whether an authorization value is "Bearer <token>" (constant time, so timing reveals nothing)."""
    if value is None:
        return False
    got = value.encode() if isinstance(value, str) else bytes(value)
    return hmac.compare_digest(got, f"Bearer {token}".encode())


def token_file_warning(path: str | None) -> str | None:
    """A warning when server.auth_token_file can be read by every user of the machine (anyone could then
    call the server with it), naming the file and the fix; None when it is private or not given."""
    if path is None:
        return None
    try:
        mode = os.stat(path).st_mode
    except OSError:          # the composer read it a moment ago; nothing to say about a file that went away
        return None
    if not mode & stat.S_IROTH:
        return None
    return (f"warning: server.auth_token_file={path} is readable by every user (mode {stat.filemode(mode)}), so "
            f"anyone on this machine can read the token. Fix: chmod 600 {path}")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without "authorization: Bearer <token>" with UNAUTHENTICATED; health stays open."""

    def __init__(self, token: str, open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES):
        self._token = token
        self._open_prefixes = open_prefixes

    def authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key.lower() == "authorization":
                return bearer_token_matches(value, self._token)
        return False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if details.method.startswith(self._open_prefixes) or self.authorized(details.invocation_metadata):
            return handler           # None for a method that does not exist: UNIMPLEMENTED, to a caller with the token
        return _deny_handler(handler, "missing or wrong bearer token (send metadata authorization: Bearer <token>)")


def _deny_handler(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler that answers UNAUTHENTICATED, of the method's kind; for a method that does not exist, a streaming
    one on raw bytes (it answers any kind of call), so that a caller without the token learns nothing of the
    service's methods."""
    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:
        return grpc.stream_stream_rpc_method_handler(deny)
    kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kind[(handler.request_streaming, handler.response_streaming)]
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


