"""The engine serving a DeepSeek V4 checkpoint gives transformers' greedy tokens, whatever the engine does with
the requests: concurrent batching with chunked prefill, prefix-cache hits (ring groups included), preemption; its
pools start full of NaN (tests/support/pools.py), so no row it never wrote can reach the math."""

import random

import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.request import SamplingParams
from appliance.offline import Appliance
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.pools import pools_start_full_of_nan

transformers = pytest.importorskip("transformers")

NEW = 8


@pytest.fixture(autouse=True)
def nan_pools(monkeypatch):
    pools_start_full_of_nan(monkeypatch)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = load_runtime_config([]).model
    return write_tiny_checkpoint(tmp_path_factory.mktemp("dsv4_engine"), model, seed=21, std=0.1)


@pytest.fixture(scope="module")
def oracle(checkpoint):
    """prompt -> transformers' greedy tokens (its own cache, one sequence at a time)."""
    from transformers.cache_utils import DynamicCache

    net = transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    cache_of: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache_of:
            cache = DynamicCache(config=net.config)
            tokens = []
            with torch.no_grad():
                out = net(torch.tensor([prompt]), cache=cache, use_cache=True)
                for _ in range(NEW):
                    tokens.append(int(out.logits[0, -1].argmax()))
                    out = net(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            cache_of[key] = tokens
        return cache_of[key]

    return run


def config(checkpoint, *extra):
    return ["+model=dsv4_tiny", f"model.weights={checkpoint}", "device=cpu", "device.cpu_threads=1",
            "max_model_len=192", *extra]


def prompts(n, lo, hi, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


def test_concurrent_chunked_requests_give_transformers_tokens(checkpoint, oracle):
    batch = prompts(6, 1, 90, seed=1)
    with Appliance.from_config(config(checkpoint, "max_num_seqs=8", "decode_batch=4",
                                      "max_num_batched_tokens=48")) as app:
        results = app.generate(batch, GREEDY)
    assert [r.token_ids for r in results] == [oracle(p) for p in batch]


def test_prefix_hits_give_transformers_tokens(checkpoint, oracle):
    shared = prompts(1, 70, 70, seed=7)[0]
    batch = [shared + tail for tail in prompts(3, 1, 20, seed=8)]
    with Appliance.from_config(config(checkpoint)) as app:
        first = app.generate([batch[0]], GREEDY)[0]
        rest = app.generate(batch[1:], GREEDY)
    assert all(r.usage.cached_prompt_tokens == 64 for r in rest)          # 4 blocks of 16 from the cache
    assert [first.token_ids] + [r.token_ids for r in rest] == [oracle(p) for p in batch]


def test_preempted_requests_give_transformers_tokens(checkpoint, oracle):
    batch = prompts(10, 1, 90, seed=1)
    with Appliance.from_config(config(checkpoint, "max_model_len=128", "max_num_seqs=8",
                                      "kv_cache.num_slots_override=2")) as app:
        results = app.generate(batch, GREEDY)
        assert app.engine.scheduler.num_preemptions > 0
    assert [r.token_ids for r in results] == [oracle(p) for p in batch]
