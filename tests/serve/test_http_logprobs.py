"""Logprobs over HTTP with the official openai client, in vLLM's shapes, equal to transformers' log_softmax on the
same weights (float32, within 1e-4) for Qwen3 and DeepSeek V4 tiny checkpoints: completions `logprobs: N`, lm-eval's
scoring request (echo, max_tokens 0, logprobs 1, the prompt as a list of token-id lists), and chat
`logprobs` / `top_logprobs`, streaming and not."""

from __future__ import annotations

import random
import re

import pytest
import torch

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

from appliance.config.compose import load_runtime_config  # noqa: E402
from appliance.core.tokenizer import Tokenizer  # noqa: E402
from tests.serve.test_http_e2e import write_chat_checkpoint  # noqa: E402
from tests.serve.test_server_e2e import ServerProcess, wait_for  # noqa: E402
from tests.support.checkpoints import write_tiny_checkpoint  # noqa: E402

TOL = 1e-4
OVERRIDES = ["device=cpu", "max_model_len=256", "max_num_seqs=4", "max_num_batched_tokens=32", "server.port=0",
             "server.http_port=0"]
MODELS = {"qwen3": ("Qwen3ForCausalLM", ["+model=hf"]), "dsv4": ("DeepseekV4ForCausalLM", ["+model=dsv4_tiny"])}


@pytest.fixture(scope="module", params=sorted(MODELS))
def served(request, tmp_path_factory):
    """(openai client, checkpoint, transformers model) for a server on a tiny checkpoint."""
    oracle_class, model_args = MODELS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        checkpoint = write_chat_checkpoint(directory)
    else:
        checkpoint = write_tiny_checkpoint(directory, load_runtime_config(model_args).model, seed=5, std=0.1)
    srv = ServerProcess(*model_args, f"model.weights={checkpoint}", *OVERRIDES,
                        run_dir=tmp_path_factory.mktemp("run"))
    try:
        srv.wait_address()
        wait_for(lambda: "SERVING on" in srv.output or srv.proc.poll() is not None, 300, "SERVING")
        assert srv.proc.poll() is None, srv.output
        port = int(re.search(r"^http listening on 127\.0\.0\.1:(\d+) ", srv.output, re.M).group(1))
        net = getattr(transformers, oracle_class).from_pretrained(checkpoint, dtype=torch.float32).eval()
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120) as c:
            yield request.param, c, Tokenizer.from_file(checkpoint / "tokenizer.json"), net
    finally:
        srv.proc.terminate()
        srv.proc.wait(60)


def log_softmax(net, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return net(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def prompt_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def test_lm_eval_scoring_request_gives_transformers_prompt_logprobs(served):
    """lm-eval's local-completions loglikelihood request: echo, max_tokens 0, logprobs 1, [[token ids]]."""
    _, client, tok, net = served
    ids = prompt_ids(1, 70)                          # more than one 32-token step: chunked prefill
    r = client.completions.create(model=None, prompt=[ids], echo=True, max_tokens=0, logprobs=1, temperature=0,
                                  seed=1234)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tok.decode(ids)
    assert lp.tokens == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = log_softmax(net, ids)
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - expected[j - 1, ids[j]].item()) < TOL, j
        # The prompt token and the most likely one (keyed by their text, so two tokens of one text share an entry).
        top, want = lp.top_logprobs[j], (expected[j - 1, ids[j]].item(), expected[j - 1].max().item())
        assert 1 <= len(top) <= 2 and all(min(abs(v - w) for w in want) < TOL for v in top.values()), j
    offsets = [sum(len(t) for t in lp.tokens[:k]) for k in range(len(ids))]
    assert lp.text_offset == offsets


def test_completion_logprobs_give_transformers_log_softmax(served):
    _, client, tok, net = served
    ids = prompt_ids(2, 20)
    r = client.completions.create(model=None, prompt=ids, max_tokens=5, logprobs=3, temperature=0)
    lp = r.choices[0].logprobs
    generated = []
    for k in range(5):                                # greedy: transformers' argmax, teacher-forced
        expected = log_softmax(net, ids + generated)[-1]
        best = int(expected.argmax())
        assert lp.tokens[k] == tok.decode([best], skip_special_tokens=False)
        assert abs(lp.token_logprobs[k] - expected[best].item()) < TOL
        values, want = lp.top_logprobs[k].values(), expected.topk(3).values.tolist()    # keyed by text, as vLLM
        assert 1 <= len(values) <= 3 and all(min(abs(v - w) for w in want) < TOL for v in values), (values, want)
        generated.append(best)
    assert r.usage.completion_tokens == 5


def test_chat_logprobs_and_top_logprobs_streamed_and_not(served):
    name, client, _, _ = served
    if name != "qwen3":
        pytest.skip("the DeepSeek V4 tiny checkpoint has no chat template")
    messages = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model=None, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)  # greedy
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.bytes == list(entry.token.encode("utf-8", "replace"))
    streamed = [e for chunk in client.chat.completions.create(model=None, messages=messages, max_tokens=6,
                                                              temperature=0, logprobs=True, top_logprobs=3,
                                                              stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]       # the second run hits the prefix cache:
    assert all(abs(a.logprob - b.logprob) < TOL for a, b in zip(streamed, content))   # equal up to rounding
    plain = client.chat.completions.create(model=None, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_sampled_chat_top_logprobs_have_exactly_n_entries(served):
    """Sampling picks tokens outside the N most likely too; their entry still lists N candidates (the chosen token
    first, then the most likely without it), streamed and not."""
    name, client, _, _ = served
    if name != "qwen3":
        pytest.skip("the DeepSeek V4 tiny checkpoint has no chat template")
    messages = [{"role": "user", "content": "Say something."}]
    sampled = dict(model=None, messages=messages, max_tokens=12, temperature=2.0, seed=3, logprobs=True,
                   top_logprobs=2)
    content = client.chat.completions.create(**sampled).choices[0].logprobs.content
    streamed = [e for chunk in client.chat.completions.create(**sampled, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    for entries in (content, streamed):
        assert len(entries) == 12 and all(len(e.top_logprobs) == 2 for e in entries)
        assert all((e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob) for e in entries)
    # The case that matters happened: a token chosen outside the 2 most likely (seen with the same seed and 20).
    wide = client.chat.completions.create(**{**sampled, "top_logprobs": 20}).choices[0].logprobs.content
    assert [e.token for e in wide] == [e.token for e in content]
    assert any(sum(t.logprob > e.logprob for t in w.top_logprobs[1:]) >= 2 for e, w in zip(content, wide))


@pytest.mark.parametrize("route, extra, field", [
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"echo": True, "stream": True}, "echo"),
])
def test_bad_logprobs_fields_are_refused_naming_them(served, route, extra, field):
    name, client, _, _ = served
    if route == "chat" and name != "qwen3":
        pytest.skip("no chat template")
    with pytest.raises(openai.BadRequestError) as err:
        if route == "chat":
            client.chat.completions.create(model=None, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                           **extra)
        else:
            client.completions.create(model=None, prompt="x", max_tokens=2, **extra)
    assert err.value.body["param"] == field, err.value.body
