"""Requests that do not parse (malformed protobuf, invalid UTF-8 in a string field) answer INVALID_ARGUMENT.

Why an interceptor: gRPC parses a request with the method's deserializer before any servicer code runs, and
a deserializer that raises makes the call end with UNKNOWN, which tells the client nothing. Here the parse
error becomes a value (`MalformedRequest`) that the wrapped method answers with INVALID_ARGUMENT and the
parser's reason. Only methods with a single request message are wrapped (Startup, Generate, health Check and
Watch); streaming-request methods (reflection) keep gRPC's own handling.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import grpc


@dataclass(frozen=True)
class MalformedRequest:
    """What a request message that failed to parse becomes: the parser's reason."""

    reason: str


def tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's malformed message
            return MalformedRequest(str(exc) or type(exc).__name__)
    return parse


async def refuse(request: MalformedRequest, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {request.reason}")


def _guard_unary(behaviour: Callable) -> Callable:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            await refuse(request, context)
        return await behaviour(request, context)
    return guarded


def _guard_stream(behaviour: Callable) -> Callable:
    if not inspect.isasyncgenfunction(behaviour):
        return _guard_unary(behaviour)       # a coroutine that writes with context.write

    async def guarded(request: Any, context: grpc.aio.ServicerContext):
        if isinstance(request, MalformedRequest):
            await refuse(request, context)
        async for response in behaviour(request, context):
            yield response
    return guarded


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every single-request method so that an unparsable message is INVALID_ARGUMENT, not UNKNOWN."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _guard_stream(handler.unary_stream), request_deserializer=tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            _guard_unary(handler.unary_unary), request_deserializer=tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer)
