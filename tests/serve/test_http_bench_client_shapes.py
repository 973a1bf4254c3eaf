"""The exact requests the serving benchmarks' own clients send, answered in the shapes they parse, without the
clients installed (bench/bench_serve_peers.py runs the real ones): `vllm bench serve` 0.32 (openai backend,
random dataset, --temperature 0: vllm/benchmarks/lib/endpoint_request_func.py async_request_openai_completions;
serve.py get_first_model_from_server) and GuideLLM 0.8.1 (openai_http backend, /v1/completions with fixed
output lengths: guidellm/backends/openai/request_handlers.py TextCompletionsRequestHandler.format)."""

from __future__ import annotations

import json

from tests.serve.test_http_inputs import COMPLETIONS, post, served  # noqa: F401 - the fake-engine server fixture
from tests.serve.test_http_tokenize import get_json

PROMPT = "t5 t6 t7 t8"


def sse_data(events: str) -> list[dict | str]:
    """The data payloads of a server-sent event stream, JSON-decoded except the final [DONE]."""
    payloads = [line.removeprefix("data: ") for line in events.split("\n\n") if line.startswith("data: ")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def test_vllm_bench_serve_completion_request_streams(served):  # noqa: F811
    body = {"model": served.srv.engine.rc.model.name, "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 5,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 0.0}
    status, answer = post(served.port, COMPLETIONS, body)
    assert status == 200, answer
    chunks = sse_data(answer["events"])
    assert chunks[-1] == "[DONE]"
    # vLLM's client: text from every chunk with choices (the first one's arrival is the TTFT), output tokens from
    # the usage of the chunk without choices.
    texts = [c["choices"][0]["text"] for c in chunks[:-1] if c["choices"]]
    assert len("".join(texts)) == 5
    usages = [c["usage"] for c in chunks[:-1] if not c["choices"]]
    assert [u["completion_tokens"] for u in usages] == [5] and usages[0]["prompt_tokens"] == len(PROMPT)


def test_vllm_bench_serve_finds_the_model_without_model_flag(served):  # noqa: F811
    """`vllm bench serve` without --model reads data[0]["id"] and data[0]["root"] of GET /v1/models."""
    status, answer = get_json(served.port, "/v1/models")
    assert status == 200
    assert answer["data"][0]["root"] == answer["data"][0]["id"] == served.srv.engine.rc.model.name


def test_guidellm_completion_request_gets_usage_in_every_chunk(served):  # noqa: F811
    body = {"model": served.srv.engine.rc.model.name, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": 4, "stop": None, "ignore_eos": True, "prompt": PROMPT}
    status, answer = post(served.port, COMPLETIONS, body)
    assert status == 200, answer
    chunks = sse_data(answer["events"])[:-1]
    # vLLM's continuous usage: every chunk carries the prompt's tokens and the completion's tokens so far.
    assert all(c["usage"]["prompt_tokens"] == len(PROMPT) for c in chunks), chunks
    with_text = [c for c in chunks if c["choices"] and c["choices"][0]["text"]]
    so_far = [c["usage"]["completion_tokens"] for c in with_text]
    assert so_far == sorted(so_far) and so_far[-1] == 4
    assert sum(len(c["choices"][0]["text"]) for c in with_text) == 4        # one byte per token here
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)


def test_continuous_usage_without_include_usage_sends_no_usage(served):  # noqa: F811
    """vLLM sends continuous usage only with include_usage; without it the chunks stay as OpenAI's."""
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    status, answer = post(served.port, COMPLETIONS, body)
    assert status == 200, answer
    assert all("usage" not in c for c in sse_data(answer["events"])[:-1])
