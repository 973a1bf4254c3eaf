"""A request as the engine core tracks it: tokens, progress through prefill and decode, sampling, how it ended.

Its text (detokenizing, stop strings, hold-back) and its RequestOutputs are output processing's (output.py): on_output
is handed to it when the core adds the request.
"""

from __future__ import annotations

import itertools
import time
from enum import Enum
from typing import Callable

from appliance.core.request import FinishReason, RequestOutput, SamplingParams, TokenLogprob, Usage
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
        self.params = params
        self.on_output = on_output
        self.arrival = next(_arrival)
        self.arrival_time = time.monotonic()   # submit time: TTFT and end-to-end latency start here
        self.last_token_time: float | None = None
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0       # tokens whose KV is in the cache
        # Async scheduling: 1 while a step that samples this sequence's next token is launched and its token not read
        # yet. That token counts in num_tokens (the next step computes it: a decode row) but is not in token_ids.
        self.num_unresolved = 0
        self.num_cached_prompt_tokens = 0  # prefix-cache hit of the first admission
        self.num_preemptions = 0
        self.last_scheduled_step = -1
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.error_field: str | None = None  # set with error when the request's own field is at fault (its grammar)
        self.stop_kept_tokens: int | None = None   # a front end's stop string: the output tokens it delivered
        # Prompt logprobs asked for: of each prompt token (None for the first); filled in order (a preempted request
        # recomputes its prompt but keeps those already computed), handed on once all are known.
        self.prompt_logprobs: list[TokenLogprob | None] | None = \
            [None] if params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False
        # Structured output: the grammar state of the committed output tokens (set by the engine on submit).
        self.matcher: GrammarMatcher | None = None

    @property
    def token_ids(self) -> list[int]:
        """Prompt + outputs known so far (a live list: read it, do not change it)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs, the one a launched step is sampling included (num_unresolved)."""
        return len(self._all_token_ids) + self.num_unresolved

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, len(self.output_token_ids), self.num_cached_prompt_tokens)

    def take_prompt_logprobs(self) -> tuple[TokenLogprob | None, ...] | None:
        """The prompt logprobs, once: on the first call after they are all known (None before, after, or unasked)."""
        if (self.prompt_logprobs is None or self.prompt_logprobs_sent
                or len(self.prompt_logprobs) != self.num_prompt_tokens):
            return None
        self.prompt_logprobs_sent = True
        return tuple(self.prompt_logprobs)
