"""One request as the front ends see it on the event loop: submit to the engine, then await its deltas.

Shared by the gRPC and the HTTP front end, so both submit, stream and cancel the same way. Why this shape:
the engine calls `on_output` on its loop thread; the delta is handed to the event loop with
call_soon_threadsafe, so one open stream costs one asyncio.Queue and no thread. `submit` may block (it
tokenizes), so it runs on an executor; a client that goes away meanwhile still gets its request aborted.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from appliance.core.request import FinishReason, RequestOutput, SamplingParams, Usage
from appliance.serve.state import EngineClient, OpenStream, RequestHandle


def coalesce(out: RequestOutput, queue: asyncio.Queue[RequestOutput]) -> RequestOutput:
    """Merge deltas that queued up while the stream was busy: one message instead of many when the client or
    the event loop falls behind the engine (the concatenation of deltas stays the same)."""
    while not out.finished and out.error is None and not queue.empty():
        nxt = queue.get_nowait()
        logprobs = None if out.logprobs is None and nxt.logprobs is None else (out.logprobs or ()) + (nxt.logprobs or ())
        first = out if out.prompt_logprobs is not None else nxt
        out = RequestOutput(out.request_id, out.new_token_ids + nxt.new_token_ids, out.new_text + nxt.new_text,
                            nxt.finish_reason, nxt.usage, nxt.error, logprobs, first.prompt_logprobs,
                            first.prompt_token_ids, nxt.error_field)
    return out


class RequestStream:
    """A submitted request: `await next_output()` until one is finished; `abort()` frees its blocks.
    While open it sits in `registry` (the server's open streams), so a shutdown can end it."""

    def __init__(self, handle: RequestHandle, queue: asyncio.Queue[RequestOutput], request_id: str,
                 registry: set[OpenStream] | None = None):
        self.handle = handle
        self.request_id = request_id
        self.completion_tokens = 0
        self._queue = queue
        self._registry: set[OpenStream] = registry if registry is not None else set()
        self._registry.add(self)

    async def next_output(self) -> RequestOutput:
        """The next delta, merged with any that queued up behind it."""
        out = coalesce(await self._queue.get(), self._queue)
        self.completion_tokens += len(out.new_token_ids)
        if out.finished or out.error is not None:
            self._registry.discard(self)
        return out

    def abort(self) -> None:
        self._registry.discard(self)
        self.handle.abort()

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length in tokens, known from submit on (the engine's usage comes only at the end)."""
        seq = self.handle.seq
        return len(seq.prompt_token_ids) if seq is not None else 0

    def end_aborted(self, error: str | None = None) -> None:
        """Finish the stream here, ABORTED with what it delivered, when the engine cannot in time (a step that
        outlasts the shutdown's bound, or the engine stopped for good: `error`, e.g. a rank hung, which its front
        end reports as the engine's failure): the client gets a finish reason rather than a cut connection."""
        self._queue.put_nowait(RequestOutput(self.request_id, (), "", FinishReason.ABORTED,
                                             Usage(self.prompt_tokens, self.completion_tokens, 0), error=error))
        self._registry.discard(self)


class ReplayedStream(RequestStream):
    """A stream whose first delta was already read (to know the request got going): it is given out again first."""

    def __init__(self, stream: RequestStream, first: RequestOutput):
        super().__init__(stream.handle, stream._queue, stream.request_id, stream._registry)   # takes its place
        stream._registry.discard(stream)
        self.completion_tokens = stream.completion_tokens        # `first` was counted when it was read
        self._first: RequestOutput | None = first

    async def next_output(self) -> RequestOutput:
        if self._first is not None:
            out, self._first = self._first, None
            if out.finished or out.error is not None:
                self._registry.discard(self)
            return out
        return await super().next_output()


async def open_stream(engine: EngineClient, executor: Executor, request_id: str, prompt: str | list[int],
                      params: SamplingParams, registry: set[OpenStream] | None = None) -> RequestStream:
    """engine.submit off the event loop. Raises what submit raises (RequestError, QueueFullError,
    EngineUnavailableError); a cancel while submitting aborts the request as soon as it exists."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def on_output(out: RequestOutput) -> None:        # engine thread
        try:
            loop.call_soon_threadsafe(queue.put_nowait, out)
        except RuntimeError:        # the server stopped and its loop closed: nobody reads this stream any more
            pass

    def abort_once_submitted(submitted: asyncio.Future[RequestHandle]) -> None:
        if not submitted.cancelled() and submitted.exception() is None:
            submitted.result().abort()

    submit = loop.run_in_executor(executor, engine.submit, request_id, prompt, params, on_output)
    try:
        handle = await asyncio.shield(submit)
    except asyncio.CancelledError:
        submit.add_done_callback(abort_once_submitted)
        raise
    return RequestStream(handle, queue, request_id, registry)
