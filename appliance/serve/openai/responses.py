"""The OpenAI API's responses: plain dicts in the documented shapes, built from the engine's outputs.

Logprobs (completions `logprobs: N` and `echo`, chat `logprobs` / `top_logprobs`) come in vLLM's shapes and are
the model's raw distribution (log_softmax of the logits before temperature, top-k and top-p: vLLM's default
"raw_logprobs"); each position lists the chosen token first, then the most likely ones (vLLM's order).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from appliance.core.request import FinishReason, RequestOutput, TokenLogprob, Usage

# Engine finish reasons as OpenAI spells them. An aborted request has none of OpenAI's reasons (stop, length,
# content_filter, tool_calls): its stream ends with an error event instead (see streaming.choice_events).
FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop", FinishReason.EOS: "stop"}

def choices_usage(usages: Sequence[Usage | None]) -> Usage | None:
    """The usage of n choices of one prompt: the prompt counted once (with its first choice's cache hit), every
    choice's completion tokens."""
    known = [u for u in usages if u is not None]
    if len(known) < len(usages):
        return None
    return Usage(known[0].prompt_tokens, sum(u.completion_tokens for u in known), known[0].cached_prompt_tokens)


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


def finish_reason(out: RequestOutput) -> str | None:
    """OpenAI's finish_reason; None while running and for an aborted request (which has no OpenAI reason)."""
    return FINISH_REASONS.get(FinishReason(out.finish_reason)) if out.finish_reason is not None else None


# The logprob OpenAI-compatible servers send for -inf (JSON has no infinity).
MIN_LOGPROB = -9999.0


def ranked(lp: TokenLogprob) -> list[tuple[int, float]]:
    """vLLM's order of a position's candidates: the chosen token first, then the most likely without it."""
    return [(lp.token_id, lp.logprob)] + [(t, v) for t, v in lp.top if t != lp.token_id]


def completion_logprobs(entries: Sequence[TokenLogprob | None], token_ids: Sequence[int],
                        token_text: Callable[[int], str], text_offset: int = 0) -> dict[str, Any]:
    """The completions API's logprobs: per token its text, logprob, the candidates {text: logprob} (the chosen
    token and the N most likely) and its character offset; a position without logprobs (the first prompt token)
    has null ones."""
    body: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for token_id, lp in zip(token_ids, entries, strict=True):
        text = token_text(token_id)
        body["tokens"].append(text)
        body["text_offset"].append(text_offset)
        text_offset += len(text)
        body["token_logprobs"].append(None if lp is None else max(lp.logprob, MIN_LOGPROB))
        body["top_logprobs"].append(None if lp is None else
                                    {token_text(t): max(v, MIN_LOGPROB) for t, v in ranked(lp)})
    return body


def chat_logprobs(entries: Sequence[TokenLogprob], num_top: int, token_text: Callable[[int], str]) -> dict[str, Any]:
    """The chat API's logprobs: {"content": [{token, logprob, bytes, top_logprobs: [N candidates]}]}."""
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode("utf-8", "replace"))}
    return {"content": [{**one(lp.token_id, lp.logprob), "top_logprobs": [one(t, v) for t, v in ranked(lp)[:num_top]]}
                        for lp in entries]}


@dataclasses.dataclass
class Collected:
    """A finished request's deltas put together (the non-streaming response is built from it)."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs or ()
        if out.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_token_ids = out.prompt_logprobs, out.prompt_token_ids or ()


class ResponseShape:
    """What differs between completions and chat: object names and how a choice carries its text."""

    def __init__(self, kind: Literal["completion", "chat"], request_id: str, model: str):
        self.kind, self.model = kind, model
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, text: str, reason: str | None, usage: Usage | None,
             logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """The non-streaming response of one choice."""
        return self.full_choices([(text, reason, logprobs)], usage)

    def full_choices(self, choices: list[tuple[Any, str | None, dict[str, Any] | None]],
                     usage: Usage | None) -> dict[str, Any]:
        """The non-streaming response: (text, or for chat the whole message, finish reason, logprobs) of each
        choice, in index order."""
        if self.kind == "chat":
            body = self._envelope("chat.completion", [
                {"index": i, "message": text if isinstance(text, dict) else {"role": "assistant", "content": text},
                 "logprobs": logprobs, "finish_reason": reason} for i, (text, reason, logprobs) in enumerate(choices)])
        else:
            body = self._envelope("text_completion", [
                {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
                for i, (text, reason, logprobs) in enumerate(choices)])
        body["usage"] = usage_body(usage)
        return body

    def chunk(self, text: str | None, reason: str | None, include_usage: bool, *, role: bool = False,
              logprobs: dict[str, Any] | None = None, index: int = 0,
              delta_fields: dict[str, Any] | None = None, usage: Usage | None = None) -> dict[str, Any]:
        """One streamed chunk of choice `index` (chat: its delta's content, or `delta_fields` such as reasoning or
        tool calls); with include_usage every chunk but the last carries `usage` (null unless the client asked for
        continuous usage)."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            delta.update(delta_fields or {})
            body = self._envelope("chat.completion.chunk",
                                  [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}])
        else:
            body = self._envelope("text_completion", [
                {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}])
        if include_usage:
            body["usage"] = usage_body(usage)
        return body

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        """The last chunk of a stream with include_usage: no choices, the request's usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj, []), "usage": usage_body(usage)}
