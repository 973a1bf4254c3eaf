"""Request-facing types shared by the engine, the offline API and the gRPC server. No torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

from appliance.core.constraint import ConstraintError, OutputConstraint, check_constraint


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
    logprobs: int | None = None       # None: none; N >= 0: each sampled token's logprob and the N most likely
    prompt_logprobs: int | None = None   # None: none; N >= 0: each prompt token's logprob and the N most likely
    # Structured output (appliance.core.constraint): the output must match it; the engine masks every other token.
    constraint: OutputConstraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities under the model's distribution: the log-softmax of the raw logits
    (before temperature, top-k and top-p), as vLLM's default logprobs mode ("raw_logprobs") reports them."""

    token_id: int
    logprob: float
    rank: int                                  # 1 = the most likely token
    top: tuple[tuple[int, float], ...] = ()    # the N most likely (token id, logprob), most likely first


@dataclass(frozen=True)
class RequestOutput:
    """One streamed delta. The last one of a request has finish_reason and usage set."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None          # set when the request failed inside the engine (finish_reason ABORTED)
    logprobs: tuple[TokenLogprob, ...] | None = None   # one per new token, when the request asked for logprobs
    # On the first delta of a request that asked for prompt logprobs: one per prompt token, None for the first
    # (nothing precedes it).
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None    # with prompt_logprobs (its first entry has no token)
    # With error: the request field at fault when the request itself failed it (its grammar stopped in the grammar
    # library): the front ends answer 400 / INVALID_ARGUMENT naming it rather than an engine failure.
    error_field: str | None = None

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
    logprobs: list[TokenLogprob] = field(default_factory=list)          # when the request asked (logprobs=N)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)   # when asked (prompt_logprobs=N)


# Documented request limits (README "Request limits"): bounded so that one request cannot make stop
# matching, metadata or tokenization expensive for everyone else.
MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# Integer ranges the engine can take (torch holds top_k in an int64 tensor and seeds a Generator with a uint64);
# they are also the gRPC fields' ranges (int32 top_k, uint64 seed), so HTTP and gRPC refuse the same values.
MAX_TOP_K = 2**31 - 1
# The most likely tokens a request may ask for per position (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
SEED_RANGE = (0, 2**64)                    # [low, high)


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the model's vocabulary, the deployment's max_model_len, and the
    longest token of the tokenizer in UTF-8 bytes (a text of more than (max_model_len - 1) x that many bytes
    cannot fit, so it is refused before it is tokenized)."""

    vocab_size: int
    max_model_len: int
    max_token_bytes: int

    @property
    def max_prompt_bytes(self) -> int:
        """Bytes of prompt text beyond which the prompt surely has more than max_model_len - 1 tokens."""
        return (self.max_model_len - 1) * self.max_token_bytes


def lone_surrogate_at(text: str) -> int | None:
    """The index of the first lone surrogate (e.g. JSON "\\ud800"), which no tokenizer can encode as UTF-8;
    None for valid Unicode. ASCII text is answered without encoding it."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def validate_text(field_name: str, text: str) -> None:
    """Text that cannot be UTF-8 encoded is refused naming the field, rather than failing in the tokenizer."""
    at = lone_surrogate_at(text)
    if at is not None:
        raise RequestError(field_name, f"contains a lone surrogate (U+{ord(text[at]):04X} at character {at}): "
                                       f"send valid Unicode text")


def validate_request_id(request_id: str) -> None:
    """gRPC metadata carries the id back (header "request-id"): printable ASCII only, and bounded."""
    if not request_id:
        raise RequestError("request_id", "must not be empty")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise RequestError("request_id", f"has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
    bad = sorted({c for c in request_id if not (c.isascii() and c.isprintable())})
    if bad:
        raise RequestError("request_id", f"must be printable ASCII (0x20-0x7e); it contains {bad[:5]}")


def validate_sampling(params: SamplingParams, limits: RequestLimits) -> None:
    """The sampling fields alone (no prompt): ranges, finiteness and the documented stop limits."""
    if params.max_tokens <= 0:
        raise RequestError("sampling.max_tokens", f"{params.max_tokens} must be > 0")
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise RequestError("sampling.temperature", f"{params.temperature} must be a finite number >= 0")
    if not 0 < params.top_p <= 1:      # also refuses NaN
        raise RequestError("sampling.top_p", f"{params.top_p} must be in (0, 1]")
    if not 0 <= params.top_k <= MAX_TOP_K:
        raise RequestError("sampling.top_k", f"{params.top_k} must be in [0, {MAX_TOP_K}]")
    if params.seed is not None and not SEED_RANGE[0] <= params.seed < SEED_RANGE[1]:
        raise RequestError("sampling.seed", f"{params.seed} must be in [0, 2**64)")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise RequestError(f"sampling.{name}", f"{value} must be in [0, {MAX_LOGPROBS}]")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise RequestError("sampling.stop", f"{len(params.stop)} stop strings; at most {MAX_STOP_STRINGS}")
    for i, stop in enumerate(params.stop):
        if not stop:
            raise RequestError(f"sampling.stop[{i}]", "must not be empty (it would end every request at once)")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise RequestError(f"sampling.stop[{i}]", f"has {len(stop)} characters; at most {MAX_STOP_STRING_CHARS}")
        validate_text(f"sampling.stop[{i}]", stop)
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError("sampling.stop_token_ids",
                           f"{len(params.stop_token_ids)} stop token ids; at most {MAX_STOP_TOKEN_IDS}")
    bad = [t for t in params.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError("sampling.stop_token_ids",
                           f"token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    if params.constraint is not None:
        try:
            check_constraint(params.constraint)
        except ConstraintError as exc:
            raise RequestError(exc.field, str(exc)) from None


def validate_prompt_text(text: str, limits: RequestLimits, field_name: str = "prompt") -> None:
    """Prompt text before it is tokenized: not empty, valid Unicode, and not longer in bytes than can fit (a
    character is at least one byte, so a long text is refused without even encoding it). The HTTP chat route
    checks its rendered chat with this too."""
    if not text:
        raise RequestError(field_name, "must not be empty")
    size = len(text) if len(text) > limits.max_prompt_bytes else len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_prompt_bytes:
        raise RequestError(field_name, f"{size:,} bytes of text (at least) cannot fit in max_model_len "
                                       f"{limits.max_model_len} tokens: at most {limits.max_prompt_bytes:,} bytes "
                                       f"({limits.max_model_len - 1} tokens x {limits.max_token_bytes} bytes, the "
                                       f"tokenizer's longest token)")
    validate_text(field_name, text)


def validate_request(request_id: str, prompt: str | Sequence[int], params: SamplingParams, limits: RequestLimits,
                     encode: Callable[[str], list[int]]) -> list[int]:
    """The prompt's token ids, or RequestError naming the first bad field. Every front end and the engine
    call this one function, so a request is refused the same way wherever it arrives. Everything cheap is
    checked before the prompt is tokenized, and a text too long to fit is refused by its size in bytes."""
    validate_request_id(request_id)
    validate_sampling(params, limits)
    if isinstance(prompt, str):
        validate_prompt_text(prompt, limits)
        ids = encode(prompt)
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise RequestError("prompt_token_ids",
                               f"token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    if not ids:
        raise RequestError("prompt", "must not be empty")
    check_length(len(ids), params.max_tokens, limits.max_model_len)
    return ids


def check_length(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Prompt + max_tokens within max_model_len, or a RequestError that blames the part that must change (the
    prompt when it alone leaves no room) and says by how much, since a client cannot see the server's limit."""
    if prompt_tokens + max_tokens <= max_model_len:
        return
    need = f"prompt ({prompt_tokens:,} tokens) + max_tokens ({max_tokens:,}) = {prompt_tokens + max_tokens:,} " \
           f"exceeds max_model_len {max_model_len:,} (the server's limit on prompt + generated tokens)"
    if prompt_tokens >= max_model_len:
        raise RequestError("prompt", f"{need}: shorten the prompt to at most {max(max_model_len - max_tokens, 1):,} "
                                     f"tokens, or serve with a larger max_model_len")
    raise RequestError("sampling.max_tokens", f"{need}: set max_tokens to at most {max_model_len - prompt_tokens:,}, "
                                              f"or shorten the prompt")
