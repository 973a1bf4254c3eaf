"""OpenAI-style errors and their translation: the engine's refusals, FastAPI's validation errors and Starlette's
HTTP errors all become one JSON body {"error": {message, type, param, code}} with the field named as the client
wrote it. Why one place: every endpoint answers a bad field, a busy server or a failed request the same way.
"""

from __future__ import annotations

import difflib
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from appliance.core.request import FinishReason, RequestError, RequestOutput

# Engine field names (RequestError.field) -> the OpenAI request field a client sent.
REQUEST_FIELDS = {"prompt_token_ids": "prompt", "request_id": "x-request-id"}
BODY_PARSE_ERROR = "There was an error parsing the body"     # FastAPI's HTTPException detail
# Fields of OpenAI's or vLLM's API that this server refuses, and what it takes instead.
INSTEAD_OF = {"min_p": "top_p or top_k", "best_of": "n", "functions": "tools", "function_call": "tool_choice",
              "guided_json": "structured_outputs.json", "guided_regex": "structured_outputs.regex",
              "guided_choice": "structured_outputs.choice", "guided_grammar": "structured_outputs.grammar",
              "reasoning_effort": "chat_template_kwargs.reasoning_effort"}


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type and the request field (param) it is about."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def request_error(exc: RequestError, renamed: dict[str, str]) -> ApiError:
    """The engine's RequestError as a 400 naming the field the client sent (`sampling.stop[1]` -> `stop[1]`)."""
    field = exc.field.removeprefix("sampling.")
    field = REQUEST_FIELDS.get(field, field)
    field = renamed.get(field, field)
    return ApiError(400, f"{field}: {str(exc).removeprefix(exc.field + ': ')}", param=field)


def unfinished_error(out: RequestOutput, engine_stopped: bool) -> ApiError | None:
    """Why a finished request has no complete answer: its own field made it fail (its grammar, stopped in the
    grammar library: 400 naming the field), it failed inside the engine (503 once the engine itself has stopped,
    e.g. a rank died: retry elsewhere; else 500), or the server aborted it. OpenAI has no finish_reason for "cut
    short by the server", and a client must not take the partial text as complete."""
    if out.error is not None and out.error_field is not None:
        return request_error(RequestError(out.error_field, out.error), {})
    if out.error is not None:
        return ApiError(503 if engine_stopped else 500, f"the request failed inside the engine: {out.error}",
                        type_="server_error")
    if out.finish_reason == FinishReason.ABORTED:
        return ApiError(503, "the server aborted the request before it finished (it is shutting down); the text "
                             "is incomplete: retry", type_="service_unavailable", code="request_aborted")
    return None


def field_path(loc: tuple[Any, ...], names: frozenset[str]) -> str | None:
    """A pydantic error location as the client wrote the field: `messages[0].content[1].text`, without the
    union members pydantic adds (`prompt.str`, `content.list[ContentPart]`) or dict keys (`logit_bias.7`)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in names:
            path += f".{part}" if path else part
    return path or None


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


def internal_error(exc: Exception) -> ApiError:
    """An unexpected fault in a handler, as a JSON 500 naming it (Starlette's own 500 is plain text)."""
    return ApiError(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}", type_="server_error")


def install_error_handlers(app: FastAPI, field_names: frozenset[str]) -> None:
    """ApiError, FastAPI's validation errors and Starlette's HTTP errors, all as OpenAI-style JSON.
    `field_names` (every request model's fields) tell a field from the union members in pydantic's locations."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(http: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(http, validation_error_body(list(exc.errors()), field_names))

    @app.exception_handler(HTTPException)
    async def http_error(http: Request, exc: HTTPException) -> JSONResponse:
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == BODY_PARSE_ERROR:     # FastAPI's words for what json.loads refused
            detail = ("malformed JSON: the body could not be parsed (not UTF-8, nested too deeply, or a number "
                      "of more than 4300 digits)")
        return await api_error(http, ApiError(exc.status_code, detail, type_="not_found_error"
                                              if exc.status_code == 404 else "invalid_request_error"))
