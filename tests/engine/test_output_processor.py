"""Output processing (appliance/engine/output.py) on its own: CoreOutputs in, RequestOutputs out, no engine.

- One RequestOutput per new token; the streamed texts concatenate to the decoded text, a tail that may still
  become a stop string held back until the end, which flushes it.
- A stop string ends the request at the token that completes it, even among several new tokens or where the core
  said LENGTH: the text stops before it, the request is reported as stopped (with the tokens kept), and forgotten.
- A core EOS or a stop token id adds no text, and the end flushes the held-back tail; an ABORTED end shows no token and no text, while usage
  counts the tokens it was given.
- Prompt logprobs go out once, on the first output after they are given; nothing is delivered before deliver().
- A request keyed apart from its request_id (a front end keys by call id) is named by its request_id.
"""

from __future__ import annotations

import pytest

from appliance.core.request import FinishReason, RequestOutput, SamplingParams, TokenLogprob, Usage
from appliance.core.tokenizer import Tokenizer
from appliance.engine.output import CoreOutput, OutputProcessor

TEXT = " Memory is the scarce resource. A page holds the rows"
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.build(512)


def added(tokenizer: Tokenizer, params: SamplingParams, request_id: str = "r"
          ) -> tuple[OutputProcessor, list[RequestOutput]]:
    outputs = OutputProcessor(tokenizer)
    got: list[RequestOutput] = []
    outputs.add_request(request_id, PROMPT, params, got.append)
    return outputs, got


def test_each_token_streams_its_text_holding_back_what_a_stop_string_could_claim(tokenizer):
    ids = tokenizer.encode(TEXT)
    outputs, got = added(tokenizer, SamplingParams(max_tokens=len(ids), stop=("zzzz",)))
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        done = outputs.process_outputs([CoreOutput("r", [token], finish_reason=FinishReason.LENGTH if last else None,
                                                   num_cached_tokens=2)])
        assert done.stopped == {}
        done.deliver()
        if not last:
            assert len("".join(o.new_text for o in got)) <= max(0, len(tokenizer.decode(ids[:i + 1])) - 3)
    assert [o.new_token_ids for o in got] == [(t,) for t in ids]
    assert "".join(o.new_text for o in got) == tokenizer.decode(ids)
    assert [o.finish_reason for o in got] == [None] * (len(ids) - 1) + [FinishReason.LENGTH]
    assert got[-1].usage == Usage(len(PROMPT), len(ids), 2) and all(o.usage is None for o in got[:-1])
    assert outputs.num_requests == 0


def test_a_stop_string_among_several_new_tokens_ends_the_request_at_its_token(tokenizer):
    ids = tokenizer.encode(TEXT)
    text = tokenizer.decode(ids)
    cut = text.find("scarce")
    completing = next(i for i in range(len(ids)) if len(tokenizer.decode(ids[:i + 1])) >= cut + len("scarce"))
    assert completing < len(ids) - 1
    outputs, got = added(tokenizer, SamplingParams(max_tokens=100, stop=("scarce",)))
    done = outputs.process_outputs([CoreOutput("r", ids)])
    assert done.stopped == {"r": completing + 1}
    assert got == []                                   # nothing is delivered before deliver()
    done.deliver()
    assert [t for o in got for t in o.new_token_ids] == ids[:completing + 1]
    assert "".join(o.new_text for o in got) == text[:cut]
    assert got[-1].finish_reason is FinishReason.STOP and got[-1].usage.completion_tokens == completing + 1
    assert outputs.num_requests == 0


def test_a_stop_string_on_the_core_s_last_token_turns_its_length_into_stop(tokenizer):
    ids = tokenizer.encode(" Memory is")
    outputs, got = added(tokenizer, SamplingParams(max_tokens=len(ids), stop=(" is",)))
    done = outputs.process_outputs([CoreOutput("r", ids, finish_reason=FinishReason.LENGTH)])
    done.deliver()
    assert done.stopped == {"r": len(ids)}
    assert got[-1].finish_reason is FinishReason.STOP and "".join(o.new_text for o in got) == " Memory"


def test_an_eos_adds_no_text_and_flushes_the_held_back_tail(tokenizer):
    ids = tokenizer.encode(" Memory")
    outputs, got = added(tokenizer, SamplingParams(max_tokens=10, stop=("never seen",)))
    outputs.process_outputs([CoreOutput("r", ids)]).deliver()
    assert "".join(o.new_text for o in got) == ""      # held back: shorter than the stop string
    done = outputs.process_outputs([CoreOutput("r", [tokenizer.eos_token_id], finish_reason=FinishReason.EOS)])
    done.deliver()
    assert done.stopped == {}
    assert got[-1].new_token_ids == (tokenizer.eos_token_id,) and got[-1].finish_reason is FinishReason.EOS
    assert "".join(o.new_text for o in got) == tokenizer.decode(ids)


def test_an_aborted_end_shows_nothing_new_but_counts_its_tokens(tokenizer):
    lp = TokenLogprob(token_id=40, logprob=-0.5, rank=1, top=())
    outputs, got = added(tokenizer, SamplingParams(max_tokens=10, logprobs=0, stop=("never seen",)))
    outputs.process_outputs([CoreOutput("r", [40], [lp])]).deliver()
    assert got[-1].logprobs == (lp,) and got[-1].new_text == "" and tokenizer.decode([40])    # (text held back)
    outputs.process_outputs([CoreOutput("r", [41], [lp], FinishReason.ABORTED, error="grammar gave up",
                                        error_field="structured_outputs.regex")]).deliver()
    final = got[-1]
    assert (final.new_token_ids, final.new_text, final.logprobs) == ((), "", ())
    assert final.finish_reason is FinishReason.ABORTED and final.usage == Usage(len(PROMPT), 2, 0)
    assert "".join(o.new_text for o in got) == ""                  # the held-back text is dropped
    assert (final.error, final.error_field) == ("grammar gave up", "structured_outputs.regex")
    assert outputs.num_requests == 0


def test_prompt_logprobs_go_out_once_on_the_first_output(tokenizer):
    prompt_lps = (None, TokenLogprob(token_id=6, logprob=-1.0, rank=3, top=()),
                  TokenLogprob(token_id=7, logprob=-2.0, rank=1, top=()))
    outputs, got = added(tokenizer, SamplingParams(max_tokens=10, prompt_logprobs=0))
    outputs.process_outputs([CoreOutput("r", tokenizer.encode(" Memory is"), prompt_logprobs=prompt_lps)]).deliver()
    assert got[0].prompt_logprobs == prompt_lps and got[0].prompt_token_ids == tuple(PROMPT)
    assert all(o.prompt_logprobs is None and o.prompt_token_ids is None for o in got[1:])


def test_a_request_id_is_taken_until_its_request_finishes(tokenizer):
    outputs, _ = added(tokenizer, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already"):
        outputs.add_request("r", PROMPT, SamplingParams(), lambda out: None)
    outputs.process_outputs([CoreOutput("r", [40], finish_reason=FinishReason.LENGTH)])
    outputs.add_request("r", PROMPT, SamplingParams(), lambda out: None)


def test_a_stop_token_id_adds_no_text(tokenizer):
    ids = tokenizer.encode(" Memory is")
    outputs, got = added(tokenizer, SamplingParams(max_tokens=10, stop_token_ids=(ids[-1],)))
    outputs.process_outputs([CoreOutput("r", ids, finish_reason=FinishReason.STOP)]).deliver()
    assert got[-1].new_token_ids == (ids[-1],) and got[-1].finish_reason is FinishReason.STOP
    assert "".join(o.new_text for o in got) == tokenizer.decode(ids[:-1]) != tokenizer.decode(ids)


def test_a_request_keyed_apart_from_its_request_id_is_named_by_it(tokenizer):
    """A front end keys requests by call id (two holders of one request_id may overlap there: an aborted one and its
    successor); CoreOutputs use the key, RequestOutputs the request_id."""
    outputs = OutputProcessor(tokenizer)
    got: list[RequestOutput] = []
    params = SamplingParams(max_tokens=2)
    outputs.add_request("1", PROMPT, params, got.append, name="same")
    outputs.add_request("2", PROMPT, params, got.append, name="same")
    assert "1" in outputs and "2" in outputs and "same" not in outputs
    ids = tokenizer.encode(TEXT)[:2]
    outputs.process_outputs([CoreOutput("1", [], finish_reason=FinishReason.ABORTED),
                             CoreOutput("2", ids, finish_reason=FinishReason.LENGTH)]).deliver()
    assert [o.request_id for o in got] == ["same"] * 3 and outputs.num_requests == 0
