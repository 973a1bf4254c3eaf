"""A request's choices from submit to answer: the n-choice fan-out, then either server-sent events or one JSON body.

Why one place for both endpoints: completions and chat differ only in how a choice's text becomes a response
(`render`, `delta_logprobs`, a chat parser); opening, streaming, disconnects and failures are the same. A client
that disconnects (streaming or not) aborts its requests, which frees their blocks within one engine step. A request
the server aborts (draining past its grace period) is a 503, or in a stream an error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from appliance.core.request import (
    EngineUnavailableError,
    FinishReason,
    QueueFullError,
    RequestError,
    RequestOutput,
    SamplingParams,
    Usage,
)
from appliance.serve.chat_output import ChatOutputParser
from appliance.serve.openai.errors import ApiError, request_error, unfinished_error
from appliance.serve.openai.protocol import SamplingRequest
from appliance.serve.openai.responses import Collected, ResponseShape, choices_usage, finish_reason
from appliance.serve.state import FrontEndState
from appliance.serve.streams import ReplayedStream, RequestStream, open_stream

log = logging.getLogger("appliance.serve.http")     # the HTTP front end's logger, by the name log filters use

# A whole choice -> (its text, or for chat its message; its finish reason; its logprobs).
Render = Callable[[Collected, str | None], tuple[Any, str | None, dict[str, Any] | None]]
# A choice's delta -> its tokens' logprobs in the endpoint's shape (None: none asked).
DeltaLogprobs = Callable[[int, RequestOutput], dict[str, Any] | None]


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def engine_stopped(server: FrontEndState) -> bool:
    """The engine itself has stopped (a rank died), not just this request."""
    return server.failure is not None


async def open_request(server: FrontEndState, request_id: str, prompt: str | list[int], params: SamplingParams,
                       renamed: dict[str, str]) -> RequestStream:
    """Submit; engine refusals name the field as the client wrote it (`renamed`: engine name -> client's)."""
    try:
        return await open_stream(server.engine, server.executor, request_id, prompt, params, server.open_streams)
    except RequestError as exc:
        raise request_error(exc, renamed) from None
    except QueueFullError as exc:
        raise ApiError(429, f"wait queue full: {exc}; retry later", type_="rate_limit_error") from None
    except EngineUnavailableError as exc:
        raise ApiError(503, f"engine unavailable: {exc}", type_="service_unavailable") from None


async def open_choices(server: FrontEndState, request_id: str, prompt: str | list[int], params: SamplingParams,
                       renamed: dict[str, str], n: int) -> list[RequestStream]:
    """n engine requests of one prompt. With n > 1 the first is submitted alone and the rest once its first token
    is out: its prompt's full KV pages are then in the prefix cache, and the others read them from there
    instead of computing them again. Choice i samples with seed + i (when a seed is given)."""
    if n == 1:
        return [await open_request(server, request_id, prompt, params, renamed)]
    streams: list[RequestStream] = []
    try:
        streams.append(await open_request(server, f"{request_id}-0", prompt, params, renamed))
        streams[0] = ReplayedStream(streams[0], await streams[0].next_output())
        for i in range(1, n):
            seed = None if params.seed is None else (params.seed + i) % 2**64
            streams.append(await open_request(server, f"{request_id}-{i}", prompt,
                                              dataclasses.replace(params, seed=seed), renamed))
    except BaseException:
        for stream in streams:
            stream.abort()
        raise
    return streams


async def respond(server: FrontEndState, http: Request, streams: list[RequestStream], shape: ResponseShape,
                  body: SamplingRequest, render: Render, delta_logprobs: DeltaLogprobs,
                  new_parser: Callable[[], ChatOutputParser] | None = None) -> Response:
    """Stream the deltas of every choice (each chunk with its tokens' logprobs from delta_logprobs; chat answers
    through a parser from new_parser, which splits out reasoning and tool calls), or answer once with the text
    (or message), finish reason and logprobs `render` makes of each whole choice and its finish reason."""
    if body.stream:
        return StreamingResponse(choice_events(server, streams, shape, body.include_usage, delta_logprobs,
                                               new_parser, body.continuous_usage),
                                 media_type="text/event-stream", headers={"x-request-id": shape.id})
    collect = asyncio.ensure_future(asyncio.gather(*(collect_choice(stream) for stream in streams)))
    gone = asyncio.ensure_future(until_disconnected(http))
    first: set[asyncio.Future[Any]] = {collect, gone}
    try:
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():          # the client went away (or the server stops): free the blocks
            collect.cancel()
            for stream in streams:
                stream.abort()
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)
    results = collect.result()
    for _, last in results:
        log_finished(last)
    stopped = engine_stopped(server)
    failure = next((f for f in (unfinished_error(last, stopped) for _, last in results) if f is not None), None)
    if failure is not None:
        raise failure
    choices = [render(collected, finish_reason(last)) for collected, last in results]
    return JSONResponse(shape.full_choices(choices, choices_usage([last.usage for _, last in results])),
                        headers={"x-request-id": shape.id})


async def collect_choice(stream: RequestStream) -> tuple[Collected, RequestOutput]:
    """A choice's deltas put together, and its last delta (finish reason, usage, error)."""
    collected = Collected()
    while True:
        out = await stream.next_output()
        collected.add(out)
        if out.finished or out.error is not None:
            return collected, out


async def choice_events(server: FrontEndState, streams: list[RequestStream], shape: ResponseShape,
                        include_usage: bool, delta_logprobs: DeltaLogprobs,
                        new_parser: Callable[[], ChatOutputParser] | None = None,
                        continuous_usage: bool = False) -> AsyncIterator[str]:
    """The choices' deltas as server-sent events, in the order they come; the usage chunk once all finished.
    With continuous_usage every chunk also carries its choice's usage so far (vLLM's continuous_usage_stats)."""
    parsers = [new_parser() for _ in streams] if new_parser is not None else None
    merged: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        while True:
            out = await stream.next_output()
            merged.put_nowait((index, out))
            if out.finished or out.error is not None:
                return
    pumps = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    running = set(range(len(streams)))
    usages: list[Usage | None] = [None] * len(streams)
    sent_tokens = [0] * len(streams)

    def usage_so_far(i: int) -> Usage | None:
        return Usage(streams[i].prompt_tokens, sent_tokens[i], 0) if continuous_usage else None
    try:
        if shape.kind == "chat":
            for i in range(len(streams)):
                yield sse(shape.chunk("", None, include_usage, role=True, index=i, usage=usage_so_far(i)))
        while running:
            i, out = await merged.get()
            finished = out.finished or out.error is not None
            logprobs = delta_logprobs(i, out) if out.new_token_ids else None
            sent_tokens[i] += len(out.new_token_ids)
            if parsers is not None:
                fields = parsers[i].feed(out.new_text) if out.new_text else []
                if out.finished and out.error is None and out.finish_reason != FinishReason.ABORTED:
                    fields += parsers[i].finish()
                for k, delta in enumerate(fields or ([{}] if logprobs is not None else [])):
                    yield sse(shape.chunk(None, None, include_usage, logprobs=logprobs if k == 0 else None,
                                          index=i, delta_fields=delta, usage=usage_so_far(i)))
            elif out.new_text or logprobs is not None:
                yield sse(shape.chunk(out.new_text, None, include_usage, logprobs=logprobs, index=i,
                                      usage=usage_so_far(i)))
            if not finished:
                continue
            running.discard(i)
            usages[i] = out.usage
            log_finished(out)
            failure = unfinished_error(out, engine_stopped(server))
            if failure is not None:           # the openai client raises APIError on an error event
                yield sse(failure.body())
                include_usage = False
                break
            reason = finish_reason(out)
            yield sse(shape.chunk(None if shape.kind == "chat" else "",
                                  parsers[i].finish_reason(reason) if parsers is not None else reason,
                                  include_usage, index=i, usage=out.usage if continuous_usage else None))
        if include_usage:
            yield sse(shape.usage_chunk(choices_usage(usages)))
        yield "data: [DONE]\n\n"
    finally:
        for pump_task in pumps:
            pump_task.cancel()
        for i in running:        # the client disconnected, or a choice failed: free the others' blocks
            streams[i].abort()


def log_finished(out: RequestOutput) -> None:
    usage = out.usage
    log.info("request finished: %s, %d prompt + %d completion tokens (%d cached)%s",
             out.finish_reason.value if out.finish_reason else "error",
             usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0,
             usage.cached_prompt_tokens if usage else 0, f"; error: {out.error}" if out.error else "")


async def until_disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
