"""Request-facing types shared by the engine, the offline API and the gRPC server. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


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
