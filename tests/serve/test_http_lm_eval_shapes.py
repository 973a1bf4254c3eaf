"""The exact requests lm-evaluation-harness's `local-completions` model sends (lm_eval/models/openai_completions.py,
0.4.x), answered in the shapes it parses, without lm-eval installed: a loglikelihood request (echo, logprobs 1,
max_tokens 1, the prompt as a list of one token-id list) and a generate_until request; and vLLM's echo with
max_tokens 0 (the prompt and its logprobs back, nothing generated)."""

from __future__ import annotations

from tests.serve.test_http_inputs import COMPLETIONS, post, served  # noqa: F401 - the fake-engine server fixture

CONTEXT, CONTINUATION = list(b"The sky is"), list(b" blue")


def lm_eval_loglikelihood(answer: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's parse_logprobs for one choice: the continuation's summed logprob and whether it was greedy."""
    lp = answer["choices"][0]["logprobs"]
    tokens, tops = lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]
    return sum(tokens), all(t == max(top.values()) for t, top in zip(tokens, tops))


def test_loglikelihood_request_as_lm_eval_sends_it(served):  # noqa: F811
    prompt = CONTEXT + CONTINUATION
    status, answer = post(served.port, COMPLETIONS, {"model": "deepseek-v4-tiny", "prompt": [prompt], "temperature": 0,
                                                     "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
    assert status == 200, answer
    lp = answer["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1                   # the prompt echoed, then the generated token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][:len(prompt)] == [chr(t) for t in prompt]
    # The fake engine gives every prompt token (after the first) logprob -2 at rank 2, each generated one -1.
    assert lm_eval_loglikelihood(answer, len(CONTEXT)) == (-2.0 * len(CONTINUATION), False)
    assert lp["token_logprobs"][-1] == -1.0
    assert answer["choices"][0]["text"].startswith("The sky is blue")


def test_echo_with_max_tokens_0_returns_only_the_prompt(served):  # noqa: F811
    prompt = CONTEXT + CONTINUATION
    status, answer = post(served.port, COMPLETIONS, {"prompt": [prompt], "max_tokens": 0, "logprobs": 1, "echo": True})
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["text"] == "The sky is blue" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [chr(t) for t in prompt]
    assert choice["logprobs"]["token_logprobs"] == [None] + [-2.0] * (len(prompt) - 1)
    assert choice["logprobs"]["text_offset"] == list(range(len(prompt)))


def test_generate_until_request_as_lm_eval_sends_it(served):  # noqa: F811
    status, answer = post(served.port, COMPLETIONS, {"prompt": [CONTEXT], "model": "deepseek-v4-tiny", "max_tokens": 4,
                                                     "temperature": 0, "stop": ["\n\n"], "seed": 1234})
    assert status == 200, answer
    assert answer["choices"][0]["logprobs"] is None and answer["usage"]["completion_tokens"] == 4


def test_max_tokens_0_without_echo_is_refused_naming_max_tokens(served):  # noqa: F811
    status, answer = post(served.port, COMPLETIONS, {"prompt": "hi", "max_tokens": 0})
    assert status == 400 and answer["error"]["param"] == "max_tokens"
