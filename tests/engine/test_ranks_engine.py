"""The engine over two ranks (this process the owner, one rank spawned, gloo): greedy tokens equal one process's.

- Qwen3 tensor parallel 2 (column-parallel qkv / gate / up, row-parallel o / down with all-reduce, kv heads
  split, vocab-parallel head) against tensor parallel 1 and against transformers on the same checkpoint;
- DeepSeek V4 data parallel 2 x expert parallel 2 (each rank its own sequences and pools, half the routed
  experts, tokens exchanged all-to-all: by counts, and in fixed shapes as on an accelerator) against one process,
  with concurrent requests on both data ranks.
"""

from __future__ import annotations

import random

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.request import SamplingParams
from appliance.offline import Appliance
from npu.deepseek_v4 import runner as dsv4_runner
from npu.deepseek_v4.moe import EXPERT_EXCHANGE_ENV
from npu.device_group import DeviceGroup
from tests.engine.test_engine_oracles import NEW_TOKENS, assert_same_greedy, transformers_greedy
from tests.support.checkpoints import write_tiny_checkpoint

ONE_THREAD = ["device=cpu", "device.cpu_threads=1", "parallel.startup_timeout_s=120"]
TWO_RANKS = ["device.count=2"]


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 45))] for _ in range(n)]


def greedy(overrides: list[str], work: list[list[int]]) -> list[list[int]]:
    """Every prompt submitted at once (continuous batching), greedy, NEW_TOKENS each."""
    with Appliance.from_config(overrides) as app:
        done = app.generate(work, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    return [r.token_ids for r in done]


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    rc = load_runtime_config(["+model=qwen3_tiny"])
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_tiny_tp"), rc.model, seed=3, std=0.1)


def test_qwen3_tensor_parallel_2_gives_the_tokens_of_one_rank_and_of_transformers(qwen3_checkpoint, one_torch_thread):
    base = ["+model=qwen3_tiny", f"model.weights={qwen3_checkpoint}", "max_model_len=128", *ONE_THREAD]
    work = prompts(512, 6, seed=7)
    one = greedy(base, work)
    two = greedy(base + TWO_RANKS + ["parallel.tensor_parallel_size=2"], work)
    assert two == one
    assert_same_greedy(work, two, transformers_greedy("Qwen3ForCausalLM", qwen3_checkpoint, work, NEW_TOKENS))


@pytest.mark.parametrize("exchange", ["auto", "fixed"])
def test_dsv4_data_2_expert_2_gives_the_tokens_of_one_process_with_requests_on_both_ranks(monkeypatch, exchange,
                                                                                       one_torch_thread):
    """auto on a CPU: the exchange by counts, each picked expert run on its rows; fixed: each rank's experts stacked
    and exchanged in fixed shapes (moe.exchange_experts_fixed), as on an accelerator. The ranks inherit the variable."""
    monkeypatch.setenv(EXPERT_EXCHANGE_ENV, exchange)
    base = ["+model=dsv4_tiny", "max_model_len=128", "max_num_seqs=4", *ONE_THREAD]
    work = prompts(512, 6, seed=11)
    one = greedy(base, work)

    seen: list[set[str]] = [set(), set()]
    idle_steps = []                     # steps where one data rank had no sequence (it still served its experts)
    execute = DeviceGroup.execute_partitions

    def recording(self, batches):
        for part, batch in zip(seen, batches, strict=True):
            part.update(s.request_id for s in batch.seqs)
        idle_steps.extend(b for b in batches if not b.seqs)
        return execute(self, batches)

    monkeypatch.setattr(DeviceGroup, "execute_partitions", recording)
    fixed_calls = []                    # this process is rank 0: its exchanges in fixed shapes (the bound each used)
    fixed = dsv4_runner.exchange_experts_fixed

    def counting(*args, **kwargs):
        fixed_calls.append(args[-1])
        return fixed(*args, **kwargs)

    monkeypatch.setattr(dsv4_runner, "exchange_experts_fixed", counting)
    dp_ep = base + TWO_RANKS + ["parallel.data_parallel_size=2", "parallel.expert_parallel_size=2"]
    two = greedy(dp_ep, work)
    assert two == one
    assert seen[0] and seen[1] and not seen[0] & seen[1]       # spread over both data ranks, each on one
    assert len(seen[0] | seen[1]) == len(work)
    assert bool(fixed_calls) == (exchange == "fixed")

    # One request alone: the other data rank has no sequence at every step, yet must step (its experts
    # serve the busy rank's tokens), and the tokens still equal one process's.
    idle_steps.clear()
    assert greedy(dp_ep, work[:1]) == one[:1]
    assert idle_steps
