"""Request-facing types shared by the engine, the offline API and the gRPC server. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence


class FinishReason(str, Enum):
    LENGTH = "length"      # max_tokens or max_model_len reached
    STOP = "stop"          # a stop string or stop token id
    EOS = "eos"            # the model's end-of-sequence token
    ABORTED = "aborted"    # cancelled by the client, the server, or failed inside the engine


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = no top-k cut
    seed: int | None = None           # per-request generator; None = engine seed + request counter
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class RequestOutput:
    """One streamed delta. The last one of a request has finish_reason and usage set."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None          # set when the request failed inside the engine (finish_reason ABORTED)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestError(ValueError):
    """A request the engine refuses: names the field (gRPC INVALID_ARGUMENT)."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


class QueueFullError(RuntimeError):
    """The wait queue is full (gRPC RESOURCE_EXHAUSTED)."""


class EngineUnavailableError(RuntimeError):
    """The engine is starting or draining (gRPC UNAVAILABLE)."""


@dataclass
class CompletionResult:
    """A finished request as the offline API returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the model's vocabulary and the deployment's max_model_len."""

    vocab_size: int
    max_model_len: int


def validate_request(request_id: str, prompt: str | Sequence[int], params: SamplingParams, limits: RequestLimits,
                     encode: Callable[[str], list[int]]) -> list[int]:
    """The prompt's token ids, or RequestError naming the first bad field. Every front end and the engine
    call this one function, so a request is refused the same way wherever it arrives."""
    if not request_id:
        raise RequestError("request_id", "must not be empty")
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt", "must not be empty")
        ids = encode(prompt)
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise RequestError("prompt_token_ids",
                               f"token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    if not ids:
        raise RequestError("prompt", "must not be empty")
    if params.max_tokens <= 0:
        raise RequestError("sampling.max_tokens", f"{params.max_tokens} must be > 0")
    if len(ids) + params.max_tokens > limits.max_model_len:
        raise RequestError("sampling.max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                                                  f"exceeds max_model_len {limits.max_model_len}")
    if params.temperature < 0:
        raise RequestError("sampling.temperature", f"{params.temperature} must be >= 0")
    if not 0 < params.top_p <= 1:
        raise RequestError("sampling.top_p", f"{params.top_p} must be in (0, 1]")
    if params.top_k < 0:
        raise RequestError("sampling.top_k", f"{params.top_k} must be >= 0")
    return ids
