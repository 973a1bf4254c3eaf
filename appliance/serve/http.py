"""OpenAI-compatible HTTP front end (FastAPI on uvicorn) in the server's process, on the server's engine.

    POST /v1/completions, POST /v1/chat/completions   (server-sent events when "stream": true)
    GET  /v1/models, GET /health (200 only while serving), GET /metrics (Prometheus)
    POST /tokenize, POST /detokenize                  (vLLM's shapes)

Why in-process on the gRPC server's event loop: one engine, one wait queue and one lifecycle for both front
ends (starting -> serving -> draining), so limits, health and shutdown agree. The same rules as gRPC: the
bearer token (server.auth_token) on everything but /health, TLS from server.tls_cert_file/tls_key_file,
and the engine's own request validation. Errors are OpenAI-style JSON: 400 naming the field as the client
wrote it, 401, 404 for another model, 429 when the wait queue is full, 503 while starting or draining. A
client that disconnects (streaming or not) aborts its request, which frees its blocks within one engine step.
A request the server aborts (draining past its grace period) is a 503, or in a stream an error event: OpenAI
has no finish_reason for "cut short by the server", and a client must not take the partial text as complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import difflib
import errno
import json
import logging
import os
import socket
import time
import uuid
from concurrent.futures import Executor
from typing import Any, AsyncIterator, Callable, Iterator, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from appliance.core.config import RuntimeConfig
from appliance.core.constraint import OutputConstraint
from appliance.core.errors import ConfigError, ConfigIssue
from appliance.core.logs import REQUEST_ID
from appliance.core.request import (
    EngineUnavailableError,
    FinishReason,
    QueueFullError,
    RequestError,
    RequestLimits,
    RequestOutput,
    SamplingParams,
    Usage,
    validate_prompt_text,
)
from appliance.serve.auth import bearer_token_matches
from appliance.serve.chat_formats import ChatFormat, load_chat_format
from appliance.serve.chat_output import ChatOutputParser
from appliance.serve.chat_template import ChatTemplateError
from appliance.serve.http_limits import BodyLimit, uvicorn_limits
from appliance.serve.metrics import metrics_registry, render
from appliance.serve.openai_api import (
    REQUEST_FIELDS,
    ApiError,
    ChatCompletionRequest,
    Collected,
    CompletionRequest,
    DetokenizeRequest,
    ResponseShape,
    TokenizeRequest,
    chat_logprobs,
    choices_usage,
    completion_logprobs,
    field_path,
    finish_reason,
    invalid,
    request_field_names,
)
from appliance.serve.ports import suggested_port
from appliance.serve.state import EngineClient, ServerState
from appliance.serve.streams import ReplayedStream, RequestStream, open_stream
from appliance.serve.tool_grammar import marker_tokens, parameters_issue, tool_call_grammar


class ServingState(Protocol):
    """What the HTTP front end reads from the server it runs beside (appliance.serve.server.ApplianceServer)."""

    rc: RuntimeConfig
    engine: EngineClient
    executor: Executor          # runs engine.submit off the event loop
    state: ServerState


log = logging.getLogger("appliance.serve.http")
OPEN_PATHS = ("/health",)                  # answered without a token so that probes work
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BODY_PARSE_ERROR = "There was an error parsing the body"     # FastAPI's HTTPException detail


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _unfinished_error(out: RequestOutput, engine_stopped: bool) -> ApiError | None:
    """Why a finished request has no complete answer: its own field made it fail (its grammar, stopped in the
    grammar library: 400 naming the field), it failed inside the engine (503 once the engine itself has stopped,
    e.g. a rank died: retry elsewhere; else 500), or the server aborted it."""
    if out.error is not None and out.error_field is not None:
        return _request_error(RequestError(out.error_field, out.error), {})
    if out.error is not None:
        return ApiError(503 if engine_stopped else 500, f"the request failed inside the engine: {out.error}",
                        type_="server_error")
    if out.finish_reason == FinishReason.ABORTED:
        return ApiError(503, "the server aborted the request before it finished (it is shutting down); the text "
                             "is incomplete: retry", type_="service_unavailable", code="request_aborted")
    return None


class OpenAIRoutes:
    """The handlers, reading the server's state, engine and executor through `server`."""

    def __init__(self, server: ServingState, chat_format: ChatFormat | None):
        self.server = server
        self.model = server.rc.model.name
        self.chat_format = chat_format or ChatFormat(None)
        self.created = int(time.time())

    # -- shared --------------------------------------------------------------------------------------
    def _check_serving(self, model: str | None) -> None:
        state = self.server.state
        if state is not ServerState.SERVING:
            raise ApiError(503, f"the engine is {state}; retry when GET /health answers 200",
                           type_="service_unavailable")
        if model is not None and model != self.model:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model!r}",
                           type_="not_found_error", param="model", code="model_not_found")

    async def _open(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    renamed: dict[str, str]) -> RequestStream:
        """Submit; engine refusals name the field as the client wrote it (`renamed`: engine name -> client's)."""
        srv = self.server
        try:
            return await open_stream(srv.engine, srv.executor, request_id, prompt, params,
                                     getattr(srv, "open_streams", None))
        except RequestError as exc:
            raise _request_error(exc, renamed) from None
        except QueueFullError as exc:
            raise ApiError(429, f"wait queue full: {exc}; retry later", type_="rate_limit_error") from None
        except EngineUnavailableError as exc:
            raise ApiError(503, f"engine unavailable: {exc}", type_="service_unavailable") from None

    async def _open_choices(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                            renamed: dict[str, str], n: int) -> list[RequestStream]:
        """n engine requests of one prompt. With n > 1 the first is submitted alone and the rest once its first token
        is out: its prompt's full KV pages are then in the prefix cache, and the others read them from there
        instead of computing them again. Choice i samples with seed + i (when a seed is given)."""
        if n == 1:
            return [await self._open(request_id, prompt, params, renamed)]
        streams: list[RequestStream] = []
        try:
            streams.append(await self._open(f"{request_id}-0", prompt, params, renamed))
            streams[0] = ReplayedStream(streams[0], await streams[0].next_output())
            for i in range(1, n):
                seed = None if params.seed is None else (params.seed + i) % 2**64
                streams.append(await self._open(f"{request_id}-{i}", prompt, dataclasses.replace(params, seed=seed),
                                                renamed))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    async def _respond(self, http: Request, streams: list[RequestStream], shape: ResponseShape, body: Any,
                       render: Callable[[Collected, str | None], tuple[Any, str | None, dict[str, Any] | None]],
                       delta_logprobs: Callable[[int, RequestOutput], dict[str, Any] | None],
                       new_parser: Callable[[], ChatOutputParser] | None = None) -> Response:
        """Stream the deltas of every choice (each chunk with its tokens' logprobs from delta_logprobs; chat answers
        through a parser from new_parser, which splits out reasoning and tool calls), or answer once with the text
        (or message), finish reason and logprobs `render` makes of each whole choice and its finish reason."""
        if body.stream:
            return StreamingResponse(self._events(streams, shape, body.include_usage, delta_logprobs, new_parser,
                                                  body.continuous_usage),
                                     media_type="text/event-stream", headers={"x-request-id": shape.id})
        collect = asyncio.ensure_future(asyncio.gather(*(self._collect(stream) for stream in streams)))
        gone = asyncio.ensure_future(_until_disconnected(http))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
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
            self._log_finished(last)
        stopped = self._engine_stopped()
        failure = next((f for f in (_unfinished_error(last, stopped) for _, last in results) if f is not None), None)
        if failure is not None:
            raise failure
        choices = [render(collected, finish_reason(last)) for collected, last in results]
        return JSONResponse(shape.full_choices(choices, choices_usage([last.usage for _, last in results])),
                            headers={"x-request-id": shape.id})

    def _engine_stopped(self) -> bool:
        """The engine itself has stopped (a rank died), not just this request."""
        return getattr(self.server, "failure", None) is not None

    @staticmethod
    async def _collect(stream: RequestStream) -> tuple[Collected, RequestOutput]:
        collected = Collected()
        while True:
            out = await stream.next_output()
            collected.add(out)
            if out.finished or out.error is not None:
                return collected, out

    async def _events(self, streams: list[RequestStream], shape: ResponseShape, include_usage: bool,
                      delta_logprobs: Callable[[int, RequestOutput], dict[str, Any] | None],
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
                    yield _sse(shape.chunk("", None, include_usage, role=True, index=i, usage=usage_so_far(i)))
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
                        yield _sse(shape.chunk(None, None, include_usage, logprobs=logprobs if k == 0 else None,
                                               index=i, delta_fields=delta, usage=usage_so_far(i)))
                elif out.new_text or logprobs is not None:
                    yield _sse(shape.chunk(out.new_text, None, include_usage, logprobs=logprobs, index=i,
                                           usage=usage_so_far(i)))
                if not finished:
                    continue
                running.discard(i)
                usages[i] = out.usage
                self._log_finished(out)
                failure = _unfinished_error(out, self._engine_stopped())
                if failure is not None:           # the openai client raises APIError on an error event
                    yield _sse(failure.body())
                    include_usage = False
                    break
                reason = finish_reason(out)
                yield _sse(shape.chunk(None if shape.kind == "chat" else "",
                                       parsers[i].finish_reason(reason) if parsers is not None else reason,
                                       include_usage, index=i, usage=out.usage if continuous_usage else None))
            if include_usage:
                yield _sse(shape.usage_chunk(choices_usage(usages)))
            yield "data: [DONE]\n\n"
        finally:
            for pump_task in pumps:
                pump_task.cancel()
            for i in running:        # the client disconnected, or a choice failed: free the others' blocks
                streams[i].abort()

    @staticmethod
    def _log_finished(out: RequestOutput) -> None:
        usage = out.usage
        log.info("request finished: %s, %d prompt + %d completion tokens (%d cached)%s",
                 out.finish_reason.value if out.finish_reason else "error",
                 usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0,
                 usage.cached_prompt_tokens if usage else 0, f"; error: {out.error}" if out.error else "")

    # -- routes ----------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        self._check_serving(body.model)
        request_id = _request_id(http)
        prompt = body.single_prompt()
        params = body.sampling_params(default_max_tokens=16)
        streams = await self._open_choices(request_id, prompt, params, {"prompt": "prompt", "logprobs": "logprobs",
                                                                        "prompt_logprobs": "logprobs"}, body.n)
        token_text = self._token_text
        offsets = [0] * body.n

        def delta_logprobs(index: int, out: RequestOutput) -> dict[str, Any] | None:
            if body.logprobs is None:
                return None
            part = completion_logprobs(out.logprobs or (), out.new_token_ids, token_text, offsets[index])
            offsets[index] += sum(len(t) for t in part["tokens"])
            return part

        def render(got: Collected, reason: str | None) -> tuple[str, str | None, dict[str, Any] | None]:
            text, ids, entries = got.text, list(got.token_ids), list(got.logprobs)
            if body.echo_only:
                text, ids, entries = "", [], []
            if body.echo:
                text = (prompt if isinstance(prompt, str) else self.server.engine.tokenizer.decode(prompt)) + text
                ids, entries = [*got.prompt_token_ids, *ids], [*got.prompt_logprobs, *entries]
            if body.logprobs is None:
                return text, reason, None
            return text, reason, completion_logprobs(entries, ids, token_text)
        return await self._respond(http, streams, ResponseShape("completion", request_id, self.model), body,
                                   render, delta_logprobs)

    def _token_text(self, token_id: int) -> str:
        """A token as logprobs name it: its text alone (special tokens included)."""
        return self.server.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    async def chat_completions(self, body: ChatCompletionRequest, http: Request) -> Response:
        self._check_serving(body.model)
        request_id = _request_id(http)
        srv = self.server
        renamed = {"prompt": "messages", "max_tokens": body.max_tokens_field}
        tool_mode, named = body.tool_choice_mode()
        fmt = self.chat_format
        if tool_mode in ("required", "named") and fmt.tool_calls is None:
            raise invalid("tool_choice", f"model {self.model!r} ({srv.rc.model.arch}) has no known tool-call format "
                                         f"to force; send \"auto\" or \"none\"")
        if tool_mode in ("required", "named"):        # the call grammar reads every tool's parameters
            for i, tool in enumerate(body.template_tools() or ()):
                issue = parameters_issue(tool["function"].get("parameters"))
                if issue is not None:
                    raise invalid(f"tools[{i}].function.parameters{issue[0]}", issue[1])
        prompt, ids = await self._chat_prompt(body, renamed)
        max_tokens = body.requested_max_tokens()
        params = body.sampling_params(default_max_tokens=max(1, srv.rc.max_model_len - len(ids)))
        if max_tokens is not None:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        if tool_mode in ("required", "named"):
            params = self._force_tool_calls(body, params, prompt, named)
        streams = await self._open_choices(request_id, ids, params, {**renamed, "logprobs": "top_logprobs"}, body.n)
        num_top = body.top_logprobs or 0

        def delta_logprobs(_: int, out: RequestOutput) -> dict[str, Any] | None:
            return chat_logprobs(out.logprobs, num_top, self._token_text) if out.logprobs is not None else None

        tool_calls = fmt.tool_calls if tool_mode != "none" else None
        max_calls = None if body.parallel_tool_calls else 1

        def new_parser() -> ChatOutputParser:
            return ChatOutputParser(prompt, fmt.reasoning, tool_calls, max_calls)

        def render(got: Collected, reason: str | None) -> tuple[dict[str, Any], str | None, dict[str, Any] | None]:
            parser = new_parser()
            parser.feed(got.text)
            parser.finish()
            return (parser.message.body(), parser.finish_reason(reason),
                    chat_logprobs(got.logprobs, num_top, self._token_text) if body.logprobs else None)
        return await self._respond(http, streams, ResponseShape("chat", request_id, self.model), body,
                                   render, delta_logprobs, new_parser)

    def _force_tool_calls(self, body: ChatCompletionRequest, params: SamplingParams, prompt: str,
                          named: str | None) -> SamplingParams:
        """tool_choice required or named: the answer is constrained to calls in the model's format (the grammar
        engine masks every other token), one call when named or parallel_tool_calls is false."""
        if params.constraint is not None:
            raise invalid("tool_choice", f"{body.tool_choice!r} cannot be combined with response_format or "
                                         f"structured_outputs (both constrain the whole answer)")
        fmt = self.chat_format
        tools = [t for t in body.template_tools() or () if named is None or t["function"]["name"] == named]
        token_to_id = getattr(self.server.engine.tokenizer, "token_to_id", lambda _: None)
        grammar = tool_call_grammar(fmt.tool_calls, tools, single=named is not None or not body.parallel_tool_calls,
                                    reasoning=fmt.reasoning, prompt=prompt,
                                    specials=marker_tokens(fmt.tool_calls, fmt.reasoning, token_to_id))
        return dataclasses.replace(params, constraint=OutputConstraint.grammar(grammar, field="tool_choice"))

    async def _chat_prompt(self, body: ChatCompletionRequest, renamed: dict[str, str],
                           encode: Callable[[str], list[int]] | None = None) -> tuple[str, list[int]]:
        """The chat rendered in the model's chat format, and tokenized (by `encode`, default the engine's)."""
        renderer = self.chat_format.renderer
        if renderer is None:
            raise invalid("messages", f"model {self.model!r} has no chat template (no chat_template in its "
                                      f"tokenizer_config.json nor a chat_template.jinja): use /v1/completions")
        srv = self.server
        limits: RequestLimits = srv.engine.limits
        encode = encode or srv.engine.tokenizer.encode
        # Cheap checks first, so that a huge or many-message chat is refused before it is rendered or tokenized.
        kwargs = body.template_kwargs()
        body.refuse_messages_too_long(limits.max_prompt_bytes)
        body.refuse_invalid_unicode()
        messages = [m.template_value(i) for i, m in enumerate(body.messages)]

        tools = body.template_tools()

        def render_and_encode() -> tuple[str, list[int]]:    # on the executor: rendering and tokenizing take time
            text = renderer.render(messages, add_generation_prompt=body.add_generation_prompt, tools=tools, **kwargs)
            validate_prompt_text(text, limits)        # the rendered chat is bounded like a prompt
            return text, encode(text)
        try:
            return await asyncio.get_running_loop().run_in_executor(srv.executor, render_and_encode)
        except ChatTemplateError as exc:
            raise invalid("messages", str(exc)) from None
        except RequestError as exc:
            raise _request_error(exc, renamed) from None

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: {count, max_model_len, tokens, token_strs (each token's text, when asked)}."""
        self._check_serving(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send either prompt or messages")
        tokenizer = self.server.engine.tokenizer

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_bos=True) if body.add_special_tokens else tokenizer.encode(text)
        if body.prompt is not None:
            limits: RequestLimits = self.server.engine.limits
            try:
                validate_prompt_text(body.prompt, limits)
            except RequestError as exc:
                raise _request_error(exc, {}) from None
            ids = await asyncio.get_running_loop().run_in_executor(self.server.executor, encode, body.prompt)
        else:
            _, ids = await self._chat_prompt(body.chat(), {"prompt": "messages"}, encode)
        token_strs = None
        if body.return_token_strs:      # one decode per id: on the executor, as the encoding
            token_strs = await asyncio.get_running_loop().run_in_executor(
                self.server.executor, lambda: [self._token_text(i) for i in ids])
        return {"count": len(ids), "max_model_len": self.server.rc.max_model_len, "tokens": ids,
                "token_strs": token_strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's /detokenize: {prompt: the tokens' text}. Checked and decoded on the executor: a million ids take
        a second, which the event loop (health checks, every stream) must not wait for."""
        self._check_serving(body.model)
        vocab = self.server.engine.limits.vocab_size
        tokenizer = self.server.engine.tokenizer

        def decode() -> str:
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                raise invalid("tokens", f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            return tokenizer.decode(body.tokens)
        return {"prompt": await asyncio.get_running_loop().run_in_executor(self.server.executor, decode)}

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                            "owned_by": "appliance", "root": self.model, "parent": None,
                                            "max_model_len": self.server.rc.max_model_len}]}

    async def health(self) -> Response:
        state = self.server.state
        return JSONResponse({"status": state}, status_code=200 if state is ServerState.SERVING else 503)


def _request_error(exc: RequestError, renamed: dict[str, str]) -> ApiError:
    """The engine's RequestError as a 400 naming the field the client sent (`sampling.stop[1]` -> `stop[1]`)."""
    field = exc.field.removeprefix("sampling.")
    field = REQUEST_FIELDS.get(field, field)
    field = renamed.get(field, field)
    return ApiError(400, f"{field}: {str(exc).removeprefix(exc.field + ': ')}", param=field)


# Fields of OpenAI's or vLLM's API that this server refuses, and what it takes instead.
INSTEAD_OF = {"min_p": "top_p or top_k", "best_of": "n", "functions": "tools", "function_call": "tool_choice",
              "guided_json": "structured_outputs.json", "guided_regex": "structured_outputs.regex",
              "guided_choice": "structured_outputs.choice", "guided_grammar": "structured_outputs.grammar",
              "reasoning_effort": "chat_template_kwargs.reasoning_effort"}


def unknown_field_fix(name: str, names: frozenset[str]) -> str:
    """What to send instead of a refused field: its counterpart here, the field its spelling is closest to, or
    nothing."""
    if name in INSTEAD_OF:
        return f"send {INSTEAD_OF[name]} instead, or remove it"
    close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.8)
    return f"did you mean {close[0]}? Otherwise remove it" if close else "remove it"


def validation_error_body(errors: list[dict[str, Any]], names: frozenset[str]) -> ApiError:
    """FastAPI's validation errors as one 400: malformed JSON says so; otherwise the deepest error (the union
    member the client most likely meant) names its field as written, with what was expected there."""
    unknown = next((e for e in errors if e.get("type") == "extra_forbidden"), None)
    if unknown is not None:
        where = tuple(unknown.get("loc", ()))[1:]
        param = field_path(where[:-1], names)
        param = f"{param}.{where[-1]}" if param else str(where[-1])
        return ApiError(400, f"{param}: not supported by this server (the field is refused, not ignored: "
                             f"{unknown_field_fix(str(where[-1]), names)})", param=param)
    if errors and errors[0].get("type") == "json_invalid":
        reason = (errors[0].get("ctx") or {}).get("error", "JSON decode error")
        where = errors[0].get("loc", ())[-1]
        return ApiError(400, f"malformed JSON (at character {where}): {reason}")
    located = [(field_path(tuple(e.get("loc", ()))[1:], names), e) for e in errors]
    deepest = max(len(e.get("loc", ())) for _, e in located)
    param = next(p for p, e in located if len(e.get("loc", ())) == deepest)
    messages = list(dict.fromkeys(e.get("msg", "") for p, e in located if p == param))
    if param is None:           # no body, or not an object: a wrong Content-Type reads as no JSON at all
        messages.append("send a JSON object with Content-Type: application/json")
    return ApiError(400, f"{param or 'body'}: {'; '.join(messages) if param is None else ' or '.join(messages)}",
                    param=param)


def _request_id(http: Request) -> str:
    """The client's x-request-id, else a fresh one; set for the logs of this request."""
    request_id = http.headers.get("x-request-id") or uuid.uuid4().hex
    REQUEST_ID.set(request_id)
    return request_id


async def _until_disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def create_app(server: ServingState, chat_format: ChatFormat | None) -> FastAPI:
    routes = OpenAIRoutes(server, chat_format)
    token = server.rc.server.auth_token
    registry = metrics_registry(server.engine.stats, routes.model)
    app = FastAPI(title="appliance", docs_url=None, redoc_url=None, openapi_url=None,
                  max_body_size=server.rc.server.http_max_body_bytes)   # 413 while a body is read (http_limits)

    @app.middleware("http")
    async def authenticate(http: Request, call_next):
        """The bearer token; and an unexpected fault in a handler answered as a JSON 500 that keeps the connection
        (Starlette's own 500 is plain text, and uvicorn then closes the connection)."""
        if token and http.url.path not in OPEN_PATHS \
                and not bearer_token_matches(http.headers.get("authorization"), token):
            err = ApiError(401, "missing or wrong bearer token (send the header Authorization: Bearer <token>)",
                           type_="authentication_error", code="invalid_api_key")
            return JSONResponse(err.body(), status_code=401, headers={"www-authenticate": "Bearer"})
        try:
            return await call_next(http)
        except Exception as exc:       # noqa: BLE001 - logged; the client gets its name
            log.exception("unexpected error answering %s", http.url.path)
            err = ApiError(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}", type_="server_error")
            return JSONResponse(err.body(), status_code=500)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    field_names = request_field_names()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(_, validation_error_body(list(exc.errors()), field_names))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == BODY_PARSE_ERROR:     # FastAPI's words for what json.loads refused
            detail = ("malformed JSON: the body could not be parsed (not UTF-8, nested too deeply, or a number "
                      "of more than 4300 digits)")
        return await api_error(_, ApiError(exc.status_code, detail, type_="not_found_error"
                                           if exc.status_code == 404 else "invalid_request_error"))

    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    app.get("/v1/models")(routes.models)
    app.post("/tokenize")(routes.tokenize)
    app.post("/detokenize")(routes.detokenize)
    app.get("/health")(routes.health)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(registry), media_type=PROMETHEUS_CONTENT_TYPE)

    return app


class HttpBindError(OSError):
    """server.host:server.http_port cannot be bound."""


def http_bind_failure(host: str, port: int, exc: OSError, taken_ports: tuple[int, ...]) -> str:
    """Why server.host:server.http_port cannot be bound, and a fix that is not another configured port."""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    where = f"cannot listen on server.host:server.http_port {host}:{port}: {reason}"
    if exc.errno == errno.EADDRINUSE:
        return (f"{where} (another server, or an appliance still running). Fix: pick a free port, e.g. "
                f"server.http_port={suggested_port(port, taken_ports)}, stop the process holding it, "
                f"or server.http_port=null to disable HTTP")
    return (f"{where} (the host is not an address of this machine or the port is in use). Fix: another "
            f"server.host or server.http_port, or server.http_port=null to disable HTTP")


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn on the gRPC server's event loop. The appliance owns SIGTERM/SIGINT (drain first, then stop both
    front ends), so uvicorn must not install its own signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpFrontEnd:
    """uvicorn serving the app on a socket bound here (so a busy port is an error we word, not uvicorn's exit)."""

    def __init__(self, server: ServingState):
        self.server = server
        self.port: int | None = None
        self._uvicorn: _EmbeddedUvicorn | None = None
        self._socket: socket.socket | None = None
        self._main: asyncio.Future | None = None

    def bind(self, taken_ports: tuple[int, ...] = ()) -> int:
        """Bind server.host:server.http_port now, before gRPC says it listens, so a busy port stops the start
        before anything is announced. `taken_ports` (the gRPC port) are never suggested as the fix."""
        srv = self.server.rc.server
        host = srv.host.strip("[]")
        try:
            self._socket = socket.create_server((host, srv.http_port),
                                                family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except OSError as exc:
            raise HttpBindError(http_bind_failure(srv.host, srv.http_port, exc, taken_ports)) from None
        self.port = self._socket.getsockname()[1]
        return self.port

    async def start(self, grace_s: float) -> int:
        srv = self.server.rc.server
        if self._socket is None:
            self.bind()
        sock = self._socket
        try:
            try:
                chat_format = load_chat_format(self.server.rc.model)
            except ChatTemplateError as exc:      # a startup fault like a bad config: exit 2, naming the file
                raise ConfigError([ConfigIssue("model.weights", self.server.rc.model.weights, str(exc))]) from None
            app = BodyLimit(create_app(self.server, chat_format), srv.http_max_body_bytes)
            config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                    ssl_certfile=srv.tls_cert_file, ssl_keyfile=srv.tls_key_file,
                                    timeout_graceful_shutdown=max(grace_s, 0.1),
                                    **uvicorn_limits(srv.http_read_timeout_s, srv.http_max_connections))
            self._uvicorn = _EmbeddedUvicorn(config)
            self._main = asyncio.ensure_future(self._uvicorn.serve(sockets=[sock]))
            while not self._uvicorn.started and not self._main.done():
                await asyncio.sleep(0.005)
            if self._main.done():
                self._main.result()          # raises what stopped uvicorn during its startup
                raise RuntimeError("the HTTP server stopped during its startup")
        except BaseException:
            sock.close()
            self._uvicorn = None
            raise
        return self.port

    def close_unstarted(self) -> None:
        """Release a port bound by bind() when the server stops before start()."""
        if self._socket is not None and self._uvicorn is None:
            self._socket.close()

    async def stop(self, budget_s: float) -> None:
        """Stop within budget_s: uvicorn's graceful stop first, then its forced exit (open streams are cut)."""
        if self._uvicorn is None:
            return
        self._uvicorn.should_exit = True
        done, _ = await asyncio.wait({self._main}, timeout=max(budget_s, 0.0))
        if not done:
            self._uvicorn.force_exit = True
            self._main.cancel()
            await asyncio.gather(self._main, return_exceptions=True)
        self._uvicorn = None
