"""Requests that do not parse (malformed protobuf, invalid UTF-8 in a string field) answer INVALID_ARGUMENT.

Why an interceptor: gRPC parses a request with the method's deserializer before any servicer code runs, and
a deserializer that raises makes the call end with UNKNOWN, which tells the client nothing. Here the parse
error becomes a value (`MalformedRequest`) that the wrapped method answers with INVALID_ARGUMENT and the
parser's reason: a single request before the method runs (Startup, Generate, health Check and Watch), each message
of a request stream as the method reads it (reflection).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

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


def _guard_request_stream(behaviour: Callable) -> Callable:
    """A request-streaming method whose stream ends INVALID_ARGUMENT at the first message that did not parse."""
    async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, MalformedRequest):
                await refuse(request, context)
            yield request

    if inspect.isasyncgenfunction(behaviour):
        async def guarded_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext):
            async for response in behaviour(checked(requests, context), context):
                yield response
        return guarded_stream

    async def guarded(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(checked(requests, context), context)
    return guarded


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every method so that an unparsable request message is INVALID_ARGUMENT, not UNKNOWN."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return handler
        parse, serialize = tolerant(handler.request_deserializer), handler.response_serializer
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                _guard_request_stream(handler.stream_stream), request_deserializer=parse, response_serializer=serialize)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(
                _guard_request_stream(handler.stream_unary), request_deserializer=parse, response_serializer=serialize)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _guard_stream(handler.unary_stream), request_deserializer=parse, response_serializer=serialize)
        return grpc.unary_unary_rpc_method_handler(
            _guard_unary(handler.unary_unary), request_deserializer=parse, response_serializer=serialize)
