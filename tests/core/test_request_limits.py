"""validate_request at the edges: every documented limit is accepted exactly at its bound and refused one past
it, and the first bad field is the one named (written against the mutants docs/TESTING.md lists)."""

from __future__ import annotations

import dataclasses

import pytest

from appliance.core.request import (
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
    SEED_RANGE,
    RequestError,
    RequestLimits,
    SamplingParams,
    validate_prompt_text,
    validate_request,
)

LIMITS = RequestLimits(vocab_size=1024, max_model_len=64, max_token_bytes=4)
OK = SamplingParams(max_tokens=1)


def tokens_per_char(text: str) -> list[int]:
    return [ord(c) % LIMITS.vocab_size for c in text]


def check(params: SamplingParams = OK, prompt: str | list[int] = "a prompt", request_id: str = "r") -> list[int]:
    return validate_request(request_id, prompt, params, LIMITS, tokens_per_char)


def refused_field(**kw) -> str:
    with pytest.raises(RequestError) as info:
        check(**kw)
    assert str(info.value).startswith(f"{info.value.field}: ")
    return info.value.field


@pytest.mark.parametrize("at_bound, past_bound, field", [
    (dict(request_id="r" * MAX_REQUEST_ID_CHARS), dict(request_id="r" * (MAX_REQUEST_ID_CHARS + 1)), "request_id"),
    (dict(request_id=" ~"), dict(request_id="\x7f"), "request_id"),                       # printable ASCII ends
    (dict(params=dataclasses.replace(OK, max_tokens=1)), dict(params=dataclasses.replace(OK, max_tokens=0)),
     "sampling.max_tokens"),
    (dict(params=dataclasses.replace(OK, temperature=0.0)), dict(params=dataclasses.replace(OK, temperature=-1e-9)),
     "sampling.temperature"),
    (dict(params=dataclasses.replace(OK, top_p=1.0)), dict(params=dataclasses.replace(OK, top_p=1.0 + 1e-9)),
     "sampling.top_p"),
    (dict(params=dataclasses.replace(OK, top_p=1e-9)), dict(params=dataclasses.replace(OK, top_p=0.0)),
     "sampling.top_p"),
    (dict(params=dataclasses.replace(OK, top_k=0)), dict(params=dataclasses.replace(OK, top_k=-1)), "sampling.top_k"),
    (dict(params=dataclasses.replace(OK, stop=("s",) * MAX_STOP_STRINGS)),
     dict(params=dataclasses.replace(OK, stop=("s",) * (MAX_STOP_STRINGS + 1))), "sampling.stop"),
    (dict(params=dataclasses.replace(OK, stop=("ok", "s" * MAX_STOP_STRING_CHARS))),
     dict(params=dataclasses.replace(OK, stop=("ok", "s" * (MAX_STOP_STRING_CHARS + 1)))), "sampling.stop[1]"),
    (dict(params=dataclasses.replace(OK, stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS)))),
     dict(params=dataclasses.replace(OK, stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1)))),
     "sampling.stop_token_ids"),
    (dict(params=dataclasses.replace(OK, stop_token_ids=(0, LIMITS.vocab_size - 1))),
     dict(params=dataclasses.replace(OK, stop_token_ids=(-1,))), "sampling.stop_token_ids"),
    (dict(params=dataclasses.replace(OK, stop_token_ids=(LIMITS.vocab_size - 1,))),
     dict(params=dataclasses.replace(OK, stop_token_ids=(LIMITS.vocab_size,))), "sampling.stop_token_ids"),
    (dict(prompt=[0, LIMITS.vocab_size - 1]), dict(prompt=[0, LIMITS.vocab_size]), "prompt_token_ids"),
    (dict(prompt=[0, 1]), dict(prompt=[-1, 1]), "prompt_token_ids"),
    (dict(prompt=[1] * 63), dict(prompt=[1] * 64), "prompt"),            # prompt + 1 <= 64: the prompt alone fills it
    (dict(prompt="a" * 63), dict(prompt="a" * 64), "prompt"),
])
def test_each_limit_is_accepted_at_its_bound_and_refused_past_it(at_bound, past_bound, field):
    check(**at_bound)
    assert refused_field(**past_bound) == field


def test_token_ids_are_returned_as_given_or_as_encoded():
    assert check(prompt=[5, 6, 7]) == [5, 6, 7]
    assert check(prompt="abc") == tokens_per_char("abc")


def test_a_text_that_encodes_to_nothing_is_refused_as_an_empty_prompt():
    with pytest.raises(RequestError) as info:
        validate_request("r", "   ", OK, LIMITS, lambda text: [])
    assert info.value.field == "prompt"


def test_the_byte_bound_counts_bytes_for_text_that_fits_by_characters():
    """252 bytes of text may fit in 63 tokens of at most 4 bytes; 253 cannot. Characters of two bytes each reach
    the bound at half as many characters, and surrogates (kept by the surrogatepass encoder) count 3 bytes: text
    past the bound is refused for its size before it is refused for the lone surrogates in it."""
    bound = LIMITS.max_prompt_bytes
    assert bound == 252
    one_token = lambda text: [1]    # noqa: E731 - the token count is not what is checked here
    validate_request("r", "\u00e9" * (bound // 2), OK, LIMITS, one_token)
    with pytest.raises(RequestError, match="253 bytes of text"):
        validate_request("r", "\u00e9" * (bound // 2) + "a", OK, LIMITS, one_token)
    with pytest.raises(RequestError, match="lone surrogate"):
        validate_request("r", "\ud800" * (bound // 3), OK, LIMITS, one_token)
    with pytest.raises(RequestError, match="255 bytes of text"):
        validate_request("r", "\ud800" * (bound // 3 + 1), OK, LIMITS, one_token)


def test_request_id_is_checked_before_sampling_and_sampling_before_the_prompt():
    bad_sampling = dataclasses.replace(OK, max_tokens=0)
    assert refused_field(request_id="", params=bad_sampling, prompt="") == "request_id"
    assert refused_field(params=bad_sampling, prompt="") == "sampling.max_tokens"
    assert refused_field(params=dataclasses.replace(OK, top_k=-1, stop=("",))) == "sampling.top_k"


@pytest.mark.parametrize("params, value, rule", [
    (dataclasses.replace(OK, max_tokens=-2), "-2", "> 0"),
    (dataclasses.replace(OK, temperature=-0.5), "-0.5", ">= 0"),
    (dataclasses.replace(OK, top_p=1.5), "1.5", "(0, 1]"),
    (dataclasses.replace(OK, top_k=-3), "-3", f"[0, {MAX_TOP_K}]"),
    (dataclasses.replace(OK, seed=2**64), f"{2**64}", "[0, 2**64)"),
    (dataclasses.replace(OK, stop=("s",) * (MAX_STOP_STRINGS + 1)), f"{MAX_STOP_STRINGS + 1}", f"{MAX_STOP_STRINGS}"),
    (dataclasses.replace(OK, stop=("s", "")), "", "must not be empty"),
    (dataclasses.replace(OK, stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1))), f"{MAX_STOP_TOKEN_IDS + 1}",
     f"at most {MAX_STOP_TOKEN_IDS}"),
    (dataclasses.replace(OK, stop=("s" * (MAX_STOP_STRING_CHARS + 1),)), f"{MAX_STOP_STRING_CHARS + 1}",
     f"{MAX_STOP_STRING_CHARS}"),
    (dataclasses.replace(OK, stop_token_ids=(LIMITS.vocab_size + 7,)), f"{LIMITS.vocab_size + 7}",
     f"[0, {LIMITS.vocab_size})"),
])
def test_a_refusal_quotes_the_value_given_and_the_rule_it_breaks(params, value, rule):
    with pytest.raises(RequestError) as info:
        check(params=params)
    message = str(info.value).removeprefix(f"{info.value.field}: ")
    assert value in message and rule in message


class UnencodableText(str):
    """A prompt whose UTF-8 encoding fails the test: validate_request must decide on its length alone."""

    def encode(self, *args, **kwargs):
        raise AssertionError("the text was encoded")


def test_text_longer_in_characters_than_the_byte_bound_is_refused_without_encoding_it():
    with pytest.raises(RequestError, match=f"{LIMITS.max_prompt_bytes + 1:,} bytes of text") as info:
        validate_request("r", UnencodableText("a" * (LIMITS.max_prompt_bytes + 1)), OK, LIMITS, tokens_per_char)
    assert info.value.field == "prompt"
    message = str(info.value)
    assert f"{LIMITS.max_model_len - 1} tokens x {LIMITS.max_token_bytes} bytes" in message
    assert f"max_model_len {LIMITS.max_model_len}" in message


def test_text_exactly_at_the_byte_bound_in_characters_is_still_measured_in_bytes():
    with pytest.raises(RequestError, match=f"{2 * LIMITS.max_prompt_bytes:,} bytes of text"):
        check(prompt="\u00e9" * LIMITS.max_prompt_bytes)


def test_empty_text_is_refused_naming_the_prompt_before_it_is_tokenized():
    def never_called(text: str) -> list[int]:
        raise AssertionError("the prompt was tokenized")

    with pytest.raises(RequestError) as info:
        validate_request("r", "", OK, LIMITS, never_called)
    assert str(info.value) == "prompt: must not be empty"
    with pytest.raises(RequestError) as info:
        validate_request("r", "text", OK, LIMITS, lambda text: [])
    assert str(info.value) == "prompt: must not be empty"


def test_an_empty_stop_string_is_refused_by_its_index_and_says_why():
    with pytest.raises(RequestError) as info:
        check(params=dataclasses.replace(OK, stop=("s", "")))
    assert str(info.value) == "sampling.stop[1]: must not be empty (it would end every request at once)"


@pytest.mark.parametrize("request_id, words", [
    ("", "must not be empty"),
    ("r" * (MAX_REQUEST_ID_CHARS + 2), f"has {MAX_REQUEST_ID_CHARS + 2} characters; at most {MAX_REQUEST_ID_CHARS}"),
    ("caf\u00e9\t", "must be printable ASCII (0x20-0x7e); it contains ['\\t', '\u00e9']"),
])
def test_a_refused_request_id_says_why(request_id, words):
    with pytest.raises(RequestError) as info:
        check(request_id=request_id)
    assert str(info.value) == f"request_id: {words}"


def test_a_refusal_lists_at_most_five_offending_values():
    ids = tuple(range(LIMITS.vocab_size, LIMITS.vocab_size + 7))
    for kw in (dict(params=dataclasses.replace(OK, stop_token_ids=ids)), dict(prompt=list(ids))):
        with pytest.raises(RequestError) as info:
            check(**kw)
        assert f"token ids {list(ids[:5])} are outside the vocabulary [0, {LIMITS.vocab_size})" in str(info.value)
    with pytest.raises(RequestError) as info:
        check(request_id="\x01\x02\x03\x04\x05\x06")
    assert "it contains ['\\x01', '\\x02', '\\x03', '\\x04', '\\x05']" in str(info.value)


def test_prompt_plus_max_tokens_over_max_model_len_names_all_three_numbers_and_the_fix():
    check(prompt=[1] * 59, params=dataclasses.replace(OK, max_tokens=5))          # 64 tokens: exactly fits
    with pytest.raises(RequestError) as info:
        check(prompt=[1] * 60, params=dataclasses.replace(OK, max_tokens=5))
    assert info.value.field == "sampling.max_tokens"
    assert str(info.value) == ("sampling.max_tokens: prompt (60 tokens) + max_tokens (5) = 65 exceeds max_model_len 64 "
                               "(the server's limit on prompt + generated tokens): set max_tokens to at most 4, or "
                               "shorten the prompt")


@pytest.mark.parametrize("prompt_tokens, max_tokens, at_most", [(64, 1, 63), (70, 8, 56), (64, 64, 1)])
def test_a_prompt_that_alone_fills_max_model_len_is_blamed_itself(prompt_tokens, max_tokens, at_most):
    """Lowering max_tokens cannot help there: the refusal names the prompt and the length it may have."""
    with pytest.raises(RequestError) as info:
        check(prompt=[1] * prompt_tokens, params=dataclasses.replace(OK, max_tokens=max_tokens))
    assert info.value.field == "prompt"
    assert f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {prompt_tokens + max_tokens} exceeds " \
           f"max_model_len 64" in str(info.value)
    assert str(info.value).endswith(f"shorten the prompt to at most {at_most} tokens, or serve with a larger "
                                    f"max_model_len")


# -- integer ranges the engine step can take, and text the tokenizer can encode (issue 24 item 2) ----------------

@pytest.mark.parametrize("at_bound, past_bound, field", [
    (dict(top_k=MAX_TOP_K), dict(top_k=MAX_TOP_K + 1), "sampling.top_k"),
    (dict(top_k=MAX_TOP_K), dict(top_k=2**63), "sampling.top_k"),
    (dict(seed=2**64 - 1), dict(seed=2**64), "sampling.seed"),
    (dict(seed=0), dict(seed=-1), "sampling.seed"),
])
def test_top_k_and_seed_are_refused_outside_the_engines_integer_ranges(at_bound, past_bound, field):
    check(params=dataclasses.replace(OK, **at_bound))
    assert refused_field(params=dataclasses.replace(OK, **past_bound)) == field


def test_the_bounds_of_top_k_and_seed_are_values_the_sampler_takes():
    """The accepted extremes really run in a sampling step (the refused ones used to fail there)."""
    torch = pytest.importorskip("torch")
    from npu.sampler import Sampler

    logits = torch.zeros(1, 8)
    params = SamplingParams(temperature=1.0, top_k=MAX_TOP_K, seed=SEED_RANGE[1] - 1)
    assert 0 <= Sampler(torch.device("cpu")).sample(logits, [("r", params)])[0] < 8


@pytest.mark.parametrize("kw, field", [
    (dict(prompt="\ud800"), "prompt"),
    (dict(prompt="fine text then \udfff"), "prompt"),
    (dict(prompt="caf\u00e9 \ud83d"), "prompt"),                       # half of an emoji's surrogate pair
    (dict(params=dataclasses.replace(OK, stop=("ok", "\ud800"))), "sampling.stop[1]"),
])
def test_a_lone_surrogate_is_refused_naming_the_field_before_tokenizing(kw, field):
    def never_called(text: str) -> list[int]:
        raise AssertionError("the text was tokenized")
    with pytest.raises(RequestError, match="lone surrogate") as info:
        validate_request("r", kw.get("prompt", "a prompt"), kw.get("params", OK), LIMITS, never_called)
    assert info.value.field == field


def test_the_chat_route_checks_rendered_text_by_the_same_rules():
    with pytest.raises(RequestError, match="bytes of text") as info:
        validate_prompt_text("a" * (LIMITS.max_prompt_bytes + 1), LIMITS, "messages")
    assert info.value.field == "messages"
    validate_prompt_text("a" * LIMITS.max_prompt_bytes, LIMITS, "messages")
