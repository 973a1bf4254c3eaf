"""`n` > 1 over HTTP with the official openai client on the real engine: n choices, the later ones reading the
prompt's KV pages from the prefix cache (the first choice is prefilled first), usage counting the prompt once,
choice i sampled with seed + i, streamed and not."""

from __future__ import annotations

import re
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from tests.serve.test_server_e2e import ServerProcess, wait_for  # noqa: E402

BLOCK = 16                                   # qwen3_tiny's block_size
PROMPT = list(range(10, 50))                 # 40 tokens: 2 full blocks a later choice reads from the cache


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv = ServerProcess("+model=qwen3_tiny", "device=cpu", "max_model_len=256", "max_num_seqs=8", "server.port=0",
                        "server.http_port=0", run_dir=tmp_path_factory.mktemp("run"))
    try:
        srv.wait_address()
        wait_for(lambda: "SERVING on" in srv.output or srv.proc.poll() is not None, 300, "SERVING")
        assert srv.proc.poll() is None, srv.output
        port = int(re.search(r"^http listening on 127\.0\.0\.1:(\d+) ", srv.output, re.M).group(1))
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120) as c:
            yield c, port
    finally:
        srv.proc.terminate()
        srv.proc.wait(60)


def prefix_hits(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return float(re.search(r"^appliance:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M).group(1))


def test_n_choices_share_the_prompt_pages_and_count_it_once(served):
    client, port = served
    before = prefix_hits(port)
    r = client.completions.create(model=None, prompt=PROMPT, n=3, max_tokens=4, temperature=1.0, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPT), 3 * 4)
    assert prefix_hits(port) - before >= 2 * (len(PROMPT) // BLOCK) * BLOCK     # choices 1 and 2 read the cache
    singles = [client.completions.create(model=None, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=5 + i)
               for i in range(3)]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]


def test_n_chat_streamed_gives_every_choice(served):
    client, _ = served
    # qwen3_tiny has no chat template: completions streamed instead.
    texts = {}
    finished = set()
    for chunk in client.completions.create(model=None, prompt=PROMPT, n=2, max_tokens=3, temperature=0,
                                           stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and texts[0] == texts[1]          # greedy: the same text twice


def test_n_out_of_range_is_refused(served):
    client, _ = served
    for n in (0, 129):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=None, prompt="hi", n=n, max_tokens=2)
        assert err.value.body["param"] == "n"
