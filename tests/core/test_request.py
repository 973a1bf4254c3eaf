"""validate_request: every field checked before the prompt is tokenized; the byte bound never refuses a prompt
that fits."""

from __future__ import annotations

import random

import pytest

from appliance.core.request import (
    MAX_REQUEST_ID_CHARS,
    RequestError,
    RequestLimits,
    SamplingParams,
    validate_request,
)
from appliance.core.tokenizer import Tokenizer

LIMITS = RequestLimits(vocab_size=1024, max_model_len=64, max_token_bytes=4)


def never_called(text: str) -> list[int]:
    raise AssertionError("the prompt was tokenized")


@pytest.mark.parametrize("request_id, params, field", [
    ("", SamplingParams(), "request_id"),
    ("tab\there", SamplingParams(), "request_id"),
    ("\u00e9t\u00e9", SamplingParams(), "request_id"),
    ("x" * (MAX_REQUEST_ID_CHARS + 1), SamplingParams(), "request_id"),
    ("r", SamplingParams(temperature=float("nan")), "sampling.temperature"),
    ("r", SamplingParams(temperature=float("-inf")), "sampling.temperature"),
    ("r", SamplingParams(stop=("",)), "sampling.stop[0]"),
    ("r", SamplingParams(stop_token_ids=(1024,)), "sampling.stop_token_ids"),
    ("r", SamplingParams(max_tokens=0), "sampling.max_tokens"),
])
def test_bad_fields_are_refused_before_tokenizing(request_id, params, field):
    with pytest.raises(RequestError) as info:
        validate_request(request_id, "a prompt", params, LIMITS, never_called)
    assert info.value.field == field


def test_text_over_the_byte_bound_is_refused_untokenized():
    bound = LIMITS.max_prompt_bytes
    assert bound == (64 - 1) * 4
    with pytest.raises(RequestError, match=f"{bound + 1:,} bytes of text") as info:
        validate_request("r", "a" * (bound + 1), SamplingParams(max_tokens=1), LIMITS, never_called)
    assert info.value.field == "prompt"
    with pytest.raises(RequestError, match="bytes of text"):       # bytes, not characters
        validate_request("r", "\u00e9" * (bound // 2 + 1), SamplingParams(max_tokens=1), LIMITS, never_called)
    seen = []
    ids = validate_request("r", "a" * bound, SamplingParams(max_tokens=1), LIMITS,
                           lambda text: seen.append(text) or [5] * 63)
    assert seen == ["a" * bound] and len(ids) == 63


def test_max_token_bytes_bounds_the_bytes_of_every_token():
    """The byte bound is exact for the tokenizer: no text has fewer tokens than bytes / max_token_bytes."""
    tok = Tokenizer.build(1024)
    vocab = tok.tk.get_vocab(with_added_tokens=True)
    assert tok.max_token_bytes == max(len(t.encode()) for t in vocab)
    rng = random.Random(0)
    words = ["the", "appliance", " serves", "\u00e9t\u00e9", "\u4e2d\u6587", "<|eos|>", "<|reserved_0|>", "  ", "\n"]
    for _ in range(50):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 200)))
        ids = tok.encode(text)
        assert len(text.encode()) <= len(ids) * tok.max_token_bytes
