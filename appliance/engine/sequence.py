"""A request as the engine tracks it: tokens, progress through prefill and decode, sampling, streaming."""

from __future__ import annotations

import itertools
import time
from enum import Enum
from typing import Callable

from appliance.core.request import FinishReason, RequestOutput, SamplingParams, TokenLogprob, Usage
from appliance.core.tokenizer import IncrementalDetokenizer
from appliance.engine.grammar import GrammarMatcher

_arrival = itertools.count()


class SeqStatus(Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to be recomputed
    RUNNING = "running"      # holds KV blocks: prefilling (possibly chunked) or decoding
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 on_output: Callable[[RequestOutput], None]):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self._all_token_ids = list(prompt_token_ids)   # prompt + outputs, kept in step (read every step)
        self.detokenizer: IncrementalDetokenizer | None = None   # set by the engine: each new token's text delta
        self.params = params
        self.on_output = on_output
        self.arrival = next(_arrival)
        self.arrival_time = time.monotonic()   # submit time: TTFT and end-to-end latency start here
        self.last_token_time: float | None = None
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0       # tokens whose KV is in the cache
        self.num_cached_prompt_tokens = 0  # prefix-cache hit of the first admission
        self.num_preemptions = 0
        self.last_scheduled_step = -1
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.error_field: str | None = None  # set with error when the request's own field is at fault (its grammar)
        self.text = ""                     # detokenized output so far
        self.num_text_emitted = 0          # characters of text already streamed
        # Logprobs asked for: of each output token, and of each prompt token (None for the first); filled in order
        # (a preempted request recomputes its prompt but keeps those already computed).
        self.output_logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = \
            [None] if params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False
        # Structured output: the grammar state of the committed output tokens (set by the engine on submit).
        self.matcher: GrammarMatcher | None = None

    @property
    def token_ids(self) -> list[int]:
        """Prompt + outputs (a live list: read it, do not change it)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if self.output_logprobs is not None and logprob is not None:
            self.output_logprobs.append(logprob)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, len(self.output_token_ids), self.num_cached_prompt_tokens)

    def emit(self, new_token_ids: list[int], new_text: str) -> None:
        """Stream a delta: the new tokens' logprobs (the last ones appended) when asked for, and the prompt's once,
        on the first delta after they are all known."""
        finished = self.finish_reason is not None
        logprobs = None
        if self.output_logprobs is not None:
            logprobs = tuple(self.output_logprobs[len(self.output_logprobs) - len(new_token_ids):])
        prompt_logprobs = None
        if (self.prompt_logprobs is not None and not self.prompt_logprobs_sent
                and len(self.prompt_logprobs) == self.num_prompt_tokens):
            prompt_logprobs, self.prompt_logprobs_sent = tuple(self.prompt_logprobs), True
        self.on_output(RequestOutput(
            request_id=self.request_id, new_token_ids=tuple(new_token_ids), new_text=new_text,
            finish_reason=self.finish_reason, usage=self.usage() if finished else None, error=self.error,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            prompt_token_ids=None if prompt_logprobs is None else tuple(self.prompt_token_ids),
            error_field=self.error_field))
