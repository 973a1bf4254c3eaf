"""The OpenAI-compatible HTTP front end of the real server process (`python -m appliance`), driven by the official
`openai` package: completions and chat, streaming and not, equal to the offline engine's greedy outputs; errors
with their HTTP status and field; the wait-queue limit (429) and disconnects that free blocks; JSON logs."""

from __future__ import annotations

import http.client
import json
import re
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from appliance.config.compose import load_runtime_config  # noqa: E402
from appliance.core.request import SamplingParams  # noqa: E402
from appliance.offline import Appliance  # noqa: E402
from appliance.serve.chat_template import load_chat_template  # noqa: E402
from tests.serve.test_server_e2e import ServerProcess, wait_for  # noqa: E402
from tests.support.checkpoints import write_tiny_checkpoint  # noqa: E402

TOKEN = "test-token-7f3a"
# A ChatML template with a system default, special tokens, loop controls and raise_exception, so rendering
# exercises what checkpoint templates use.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are terse.<|im_end|>\\n' }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MODEL_OVERRIDES = ["model.name=qwen3-tiny", "device=cpu", "max_model_len=1024", "max_num_seqs=4", "max_waiting_requests=2",
                   "kv_cache.num_slots_override=8"]
MESSAGES = [{"role": "user", "content": "Say something about the weather."}]


def write_chat_checkpoint(directory: Path) -> Path:
    rc = load_runtime_config(["+model=qwen3_tiny"])
    path = write_tiny_checkpoint(directory, rc.model, seed=5, std=0.1)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": CHAT_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_chat_checkpoint(tmp_path_factory.mktemp("qwen3_chat"))


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    srv = ServerProcess("+model=hf", f"model.weights={checkpoint}", *MODEL_OVERRIDES, "server.port=0",
                        "server.http_port=0", f"server.auth_token={TOKEN}", "logging.format=json",
                        f"server.http_max_body_bytes={32 << 20}",       # a 16 MB chat reaches the chat bound
                        run_dir=run_dir)
    try:
        srv.wait_address()
        wait_for(lambda: "SERVING on" in srv.output or srv.proc.poll() is not None, 300, "SERVING")
        assert srv.proc.poll() is None, srv.output
        port = int(re.search(r"^http listening on 127\.0\.0\.1:(\d+) ", srv.output, re.M).group(1))
        yield srv, port
    finally:
        srv.proc.terminate()
        srv.proc.wait(60)


@pytest.fixture(scope="module")
def client(served):
    _, port = served
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline(checkpoint):
    with Appliance.from_config(["+model=hf", f"model.weights={checkpoint}", *MODEL_OVERRIDES]) as app:
        yield app


def get(port: int, path: str, token: str | None = TOKEN) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def used_blocks(port: int) -> dict[str, float]:
    _, text = get(port, "/metrics")
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^appliance:kv_cache_used_blocks\{group="([^"]+)",model_name="[^"]+"\} (\S+)$', text, re.M)}


# -- completions and chat equal the offline engine ---------------------------------------------------------

def test_completion_equals_offline_greedy(client, offline):
    prompt = "The cache holds pages"
    [expected] = offline.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    r = client.completions.create(model="qwen3-tiny", prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(expected.prompt_token_ids), 10)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10 and r.object == "text_completion"

    ids = expected.prompt_token_ids                            # the same prompt as token ids
    by_ids = client.completions.create(model="qwen3-tiny", prompt=ids, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == expected.text


def test_streamed_completion_with_usage_equals_the_whole(client, offline):
    prompt = "Weather notes from a small town"
    [expected] = offline.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    chunks = list(client.completions.create(model="qwen3-tiny", prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1]) and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_chat_renders_the_template_and_equals_offline(client, offline, checkpoint):
    template = load_chat_template(offline.rc.model)
    ids = offline.engine.tokenizer.encode(template.render(MESSAGES, add_generation_prompt=True))
    [expected] = offline.generate([ids], SamplingParams(max_tokens=9, ignore_eos=True))
    r = client.chat.completions.create(model="qwen3-tiny", messages=MESSAGES, max_tokens=9, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected.text
    assert r.usage.prompt_tokens == len(ids) and r.object == "chat.completion"

    stream = client.chat.completions.create(model="qwen3-tiny", messages=MESSAGES, max_tokens=9, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.prompt_tokens == len(ids)


def test_models_and_health(client, served):
    _, port = served
    assert [m.id for m in client.models.list().data] == ["qwen3-tiny"]
    assert get(port, "/health", token=None) == (200, '{"status":"serving"}')


# -- errors ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, param", [
    (dict(prompt="hi", max_tokens=5000), "max_tokens"),
    (dict(prompt="hi", temperature=-1), "temperature"),
    (dict(prompt="", max_tokens=2), "prompt"),
    (dict(prompt=[10**6], max_tokens=2), "prompt"),
    (dict(prompt="hi", n=0), "n"),
    (dict(prompt="hi", max_tokens="many"), "max_tokens"),
    (dict(prompt="hi", max_tokens=True), "max_tokens"),                                 # strict: not 1
    (dict(prompt="hi", temperature=1, seed=2**64), "seed"),              # failed in the sampling step (a 500)
    (dict(prompt="hi", temperature=1, extra_body={"top_k": 2**63}), "top_k"),
])
def test_bad_requests_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="qwen3-tiny", **kwargs)
    assert info.value.status_code == 400 and info.value.body["param"] == param
    assert param in info.value.body["message"]


def test_auth_model_and_template_errors(client, served):
    _, port = served
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert get(port, "/metrics", token="wrong")[0] == 401
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="qwen3-tiny", messages=[{"role": "tool", "content": "x"}], max_tokens=2)
    assert "unknown role tool" in info.value.body["message"]


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"messages": [{"role": "\ud800", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]}, "messages[0].content[0].text"),
    ({"messages": MESSAGES, "chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x" * (16 << 20)}]}, "messages"),
])
def test_bad_chats_are_400_naming_the_field(served, body, param):
    """Through the real tokenizer and template; each was a 500 (or a 16 MB tokenization) before issue 24."""
    _, port = served
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    assert info.value.code == 400 and json.loads(info.value.read())["error"]["param"] == param


def open_stream(port: int, max_tokens: int = 1000) -> http.client.HTTPConnection:
    """A long streaming completion, accepted by the engine (its response headers arrived), left unread."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": "tell me a long story", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}),
        {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    assert conn.getresponse().status == 200
    return conn


def test_queue_full_is_429_and_disconnects_free_blocks(client, served):
    _, port = served
    streams = [open_stream(port) for _ in range(6)]          # 4 running + 2 waiting fill the engine
    wait_for(lambda: any(used_blocks(port).values()), 60, "the streams to run")
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="qwen3-tiny", prompt="one too many", max_tokens=2)
    assert info.value.status_code == 429
    for conn in streams:
        conn.close()                                          # the client goes away mid-stream
    wait_for(lambda: not any(used_blocks(port).values()), 60, "blocks freed after disconnects")

    # A non-streaming request whose client disconnects is aborted too.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 1000, "ignore_eos": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    wait_for(lambda: any(used_blocks(port).values()), 60, "the request to run")
    conn.close()
    wait_for(lambda: not any(used_blocks(port).values()), 60, "blocks freed after a non-streaming disconnect")
    _, text = get(port, "/metrics")
    assert re.search(r'^appliance:request_success_total\{finished_reason="aborted",model_name="qwen3-tiny"\} '
                     r'([1-9]\d*)\.0$', text, re.M)


def test_logs_are_json_lines_with_request_ids(client, served):
    srv, _ = served
    client.completions.with_raw_response.create(model="qwen3-tiny", prompt="hi", max_tokens=2,
                                                extra_headers={"x-request-id": "req-json-log-1"})
    def logged():
        for line in srv.lines:
            if line.startswith("{"):
                entry = json.loads(line)
                assert {"time", "level", "logger", "message"} <= set(entry)
                if entry.get("request_id") == "req-json-log-1":
                    return entry
    entry = wait_for(logged, 30, "a JSON log line with the request id") or logged()
    assert entry["logger"] == "appliance.serve.http" and "request finished" in entry["message"]
    assert sum(line.startswith("{") for line in srv.lines) >= 2     # the engine's startup table too
