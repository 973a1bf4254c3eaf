"""Output processing: from what the engine core decided about each request to the RequestOutputs its client reads.

The core says, per request and step, which tokens it committed (with their logprobs), and whether a rule it owns
ended the request (EOS, a stop token id, the length limits, a grammar's end, an abort or failure): a CoreOutput.
The OutputProcessor turns that into text: it owns each request's incremental detokenizer, finds stop strings,
holds back a tail that may still become one, and builds one RequestOutput per token (the last one carries the
finish reason and usage). It knows nothing of the scheduler, the KV cache or the device: its inputs and outputs
are plain data, so it can run in another process than the core (a front end's), as vLLM's output processor does.

States of a request here: added (add_request) -> streaming -> finished (its final RequestOutput built; its state
dropped). A stop string is found here, not in the core: process_outputs reports each request it ended that way
(`stopped`), and the core finishes those sequences before the outputs are delivered. The core only sees an
OutputSink: in one process this processor; with the core in its own process, a sender of the CoreOutputs to the front
end, whose processor tells the core of a stop string by message (appliance.engine.process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

from appliance.core.request import FinishReason, RequestOutput, SamplingParams, TokenLogprob, Usage
from appliance.core.tokenizer import IncrementalDetokenizer, Tokenizer

OnOutput = Callable[[RequestOutput], None]


@dataclass(frozen=True)
class CoreOutput:
    """One request's news from the core: its new tokens in order (and their logprobs, None where not asked), and
    finish_reason when a core rule ended it (at the last new token; an ABORTED request's tokens, if any, were
    computed but are not shown: they count in usage only). prompt_logprobs: the prompt's, once, when all are known."""

    request_id: str
    new_token_ids: Sequence[int] = ()
    new_logprobs: Sequence[TokenLogprob | None] = ()
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0               # prompt tokens served by the prefix cache (usage)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    error: str | None = None
    error_field: str | None = None            # set with error when the request's own field is at fault


@dataclass
class _RequestState:
    """What output processing keeps per request: its prompt and parameters, the detokenizer (made on the first
    token with text), the text so far and how much of it was streamed, and the output tokens counted."""

    prompt_token_ids: list[int]
    params: SamplingParams
    on_output: OnOutput
    request_id: str                             # what its RequestOutputs say (the key CoreOutputs use may differ)
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    num_text_emitted: int = 0
    num_output_tokens: int = 0


@dataclass
class ProcessedOutputs:
    """What one process_outputs call built: the outputs to deliver, in order, each with its request's callback, and
    the requests a stop string ended (STOP, whatever the core said), with how many of their new tokens were kept: the
    core finishes those sequences."""

    outputs: list[tuple[OnOutput, RequestOutput]] = field(default_factory=list)
    stopped: dict[str, int] = field(default_factory=dict)

    def deliver(self) -> None:
        for on_output, out in self.outputs:
            on_output(out)


class Delivery(Protocol):
    """What the core reads back from its sink for one batch of CoreOutputs: the requests a stop string ended (with
    the new tokens kept), which it finishes before calling deliver()."""

    @property
    def stopped(self) -> dict[str, int]: ...

    def deliver(self) -> None: ...


class OutputSink(Protocol):
    """Where the engine core sends its CoreOutputs: an OutputProcessor in the same process (the in-process Engine),
    or a sender to a front end that runs its own OutputProcessor (appliance.engine.process: split mode)."""

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    on_output: OnOutput) -> None: ...

    def process_outputs(self, core_outputs: Iterable[CoreOutput]) -> Delivery: ...


class OutputProcessor:
    """Detokenizing, stop strings, hold-back and the RequestOutputs of every live request (one thread uses it)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    on_output: OnOutput, name: str | None = None) -> None:
        """Start tracking a request (whose earlier holder of this id, if any, has finished here already). CoreOutputs
        name it by request_id; its RequestOutputs by `name` (default: request_id; a front end keys by call id)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already being processed")
        self._requests[request_id] = _RequestState(list(prompt_token_ids), params, on_output, name or request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def process_outputs(self, core_outputs: Iterable[CoreOutput]) -> ProcessedOutputs:
        """The RequestOutputs of the core's news (each request must have been added and not have finished)."""
        done = ProcessedOutputs()
        for core in core_outputs:
            state = self._requests[core.request_id]
            built, kept = self._request_outputs(state, core)
            done.outputs += [(state.on_output, out) for out in built]
            if built[-1].finished:
                del self._requests[core.request_id]
                if built[-1].finish_reason is not core.finish_reason or kept < len(core.new_token_ids):
                    done.stopped[core.request_id] = kept      # a stop string, before or instead of a core rule
        return done

    def _request_outputs(self, state: _RequestState, core: CoreOutput) -> tuple[list[RequestOutput], int]:
        """One output per new token (a stop string ends the row at its token), or one final output without tokens;
        and how many new tokens were kept."""
        prompt_logprobs = core.prompt_logprobs
        built: list[RequestOutput] = []

        def output(tokens: list[int], logprobs: list[TokenLogprob | None], text: str,
                   reason: FinishReason | None) -> None:
            nonlocal prompt_logprobs
            built.append(self._output(state, core, tokens, logprobs, text, reason, prompt_logprobs))
            prompt_logprobs = None                    # (sent once, on the first of them)

        if core.finish_reason is FinishReason.ABORTED or not core.new_token_ids:
            state.num_output_tokens += len(core.new_token_ids)
            output([], [], "", core.finish_reason)    # an abort drops the held-back text
            return built, len(core.new_token_ids)
        logprobs = list(core.new_logprobs) or [None] * len(core.new_token_ids)
        last = len(core.new_token_ids) - 1
        for i, (token, logprob) in enumerate(zip(core.new_token_ids, logprobs)):
            state.num_output_tokens += 1
            reason, text = self._push(state, token, core.finish_reason if i == last else None)
            output([token], [logprob], text, reason)
            if reason is not None:
                return built, i + 1
        return built, len(core.new_token_ids)

    def _push(self, state: _RequestState, token: int, reason: FinishReason | None) -> tuple[FinishReason | None, str]:
        """Add a token's text (an EOS or stop token id adds none), look for a stop string, and return the finish
        reason (STOP where a stop string matched) and the text to stream: all that is left when the request
        finishes, else what no stop string can still claim (the hold-back)."""
        p = state.params
        if not (reason is FinishReason.EOS or token in p.stop_token_ids):
            detokenizer = state.detokenizer
            if detokenizer is None:
                detokenizer = state.detokenizer = self.tokenizer.detokenizer(state.prompt_token_ids)
            delta = detokenizer.push(token)
            state.text += delta
            if p.stop:
                # Only the new text, plus what a stop string could straddle, can hold a new match.
                longest = max(len(s) for s in p.stop)
                start = max(0, len(state.text) - len(delta) - longest + 1)
                hits = [i for i in (state.text.find(s, start) for s in p.stop) if i >= 0]
                if hits:
                    state.text = state.text[:min(hits)]
                    reason = FinishReason.STOP
        if reason is not None:
            new_text = state.text[state.num_text_emitted:]
        else:                                         # hold back a tail that may still become a stop string
            visible = len(state.text)
            if p.stop:
                visible -= max(len(s) for s in p.stop) - 1
            new_text = state.text[state.num_text_emitted:max(visible, state.num_text_emitted)]
        state.num_text_emitted += len(new_text)
        return reason, new_text

    @staticmethod
    def _output(state: _RequestState, core: CoreOutput, tokens: list[int], logprobs: list[TokenLogprob | None],
                text: str, reason: FinishReason | None,
                prompt_logprobs: tuple[TokenLogprob | None, ...] | None) -> RequestOutput:
        finished = reason is not None
        return RequestOutput(
            request_id=state.request_id, new_token_ids=tuple(tokens), new_text=text, finish_reason=reason,
            usage=Usage(len(state.prompt_token_ids), state.num_output_tokens, core.num_cached_tokens)
            if finished else None,
            error=core.error,
            logprobs=tuple(lp for lp in logprobs if lp is not None) if state.params.logprobs is not None else None,
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=None if prompt_logprobs is None else tuple(state.prompt_token_ids),
            error_field=core.error_field)
