"""Engine-level oracles: greedy tokens through appliance.offline.Appliance, with prefix-cache hits, chunked
prefill and preemption all asserted to happen, against an implementation that shares no code with the
engine: transformers' `generate` with Qwen3ForCausalLM and DeepseekV4ForCausalLM, loading the tiny
checkpoint the test writes.

A divergence is accepted only where the oracle's own top two logits are within NEAR_TIE (float rounding
between two correct implementations), and at most one prompt may diverge at all. The pools start full of NaN (the
worst an uninitialized pool can hold: tests/support/pools.py), Qwen3's decode rows on the CPU paged kernel and,
with the kernels off, on gather + SDPA.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.request import FinishReason, SamplingParams
from appliance.offline import Appliance
from tests.engine.instrumented import hooked_runner, runner_for_engine
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.kv import free_blocks, total_blocks
from tests.support.pools import pools_start_full_of_nan

NEW_TOKENS = 16
NEAR_TIE = 1e-4
# Small pools and step budget: two capacity slots at max_model_len 128 for ten requests, 32-token steps.
PRESSURE = ["device=cpu", "max_model_len=128", "max_num_seqs=16", "decode_batch=4", "max_num_batched_tokens=32",
            "kv_cache.num_slots_override=2"]


@dataclass
class Greedy:
    tokens: list[int]
    step_logits: list[torch.Tensor]     # the oracle's logits each token was chosen from


def workload(vocab: int) -> list[list[int]]:
    """Prompts sharing a 40-token prefix (prefix hits), long ones (chunked prefill), short ones."""
    rng = random.Random(21)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    tails = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 50))] for _ in range(6)]
    others = [[rng.randrange(3, vocab) for _ in range(n)] for n in (90, 3, 61, 17)]
    return [shared + tail for tail in tails] + others


def transformers_greedy(model_class: str, checkpoint: Path, prompts: list[list[int]], new_tokens: int) -> list[Greedy]:
    """transformers' `generate` (greedy) with transformers.<model_class> loaded from the checkpoint directory."""
    transformers = pytest.importorskip("transformers")
    model = getattr(transformers, model_class).from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = []
    for prompt in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=2,
                                 output_logits=True, return_dict_in_generate=True)
        out.append(Greedy(gen.sequences[0, len(prompt):].tolist(), [s[0].float() for s in gen.logits]))
    return out


def assert_same_greedy(prompts: list[list[int]], ours: list[list[int]], expected: list[Greedy]) -> None:
    diverged = 0
    for prompt, got, oracle in zip(prompts, ours, expected, strict=True):
        assert len(got) == len(oracle.tokens) == NEW_TOKENS
        k = next((i for i, (a, b) in enumerate(zip(got, oracle.tokens, strict=True)) if a != b), None)
        if k is None:
            continue
        diverged += 1
        top2 = oracle.step_logits[k].topk(2).values
        assert (top2[0] - top2[1]).item() < NEAR_TIE, (
            f"prompt of {len(prompt)} tokens: the engine's token {k} is {got[k]}, the oracle's {oracle.tokens[k]} "
            f"(oracle logit gap {(top2[0] - top2[1]).item():.2e}, not a near-tie); engine {got}, oracle "
            f"{oracle.tokens}")
    assert diverged <= 1, f"{diverged} prompts diverge from the oracle; near-ties must be rare"


def run_appliance(overrides: list[str], prompts: list[list[int]]):
    """The first prompt alone (it fills the prefix cache), then the rest at once; the runner records steps. Returns
    the greedy tokens and the runner."""
    rc = load_runtime_config(overrides)
    runner = hooked_runner(rc.model)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with runner_for_engine(runner), Appliance.from_config(rc) as app:
        results = app.generate(prompts[:1], greedy) + app.generate(prompts[1:], greedy)
        preemptions = app.engine.scheduler.num_preemptions
        assert free_blocks(app.engine) == total_blocks(app.engine)
    rows = [row for step in runner.steps for row in step if not row[0].startswith("profile")]
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    # What the oracle comparison must have gone through:
    assert preemptions > 0, "no request was preempted"
    assert any(r.usage.cached_prompt_tokens > 0 for r in results), "no prefix-cache hit"
    assert any(not sample for _, _, _, sample in rows), "no prompt was prefilled in several chunks"
    assert any(start > 0 and n > 1 for _, start, n, _ in rows), "no chunk continued a prefill"
    return [r.token_ids for r in results], runner


@pytest.mark.parametrize("name, seed, oracle, kernels", [("qwen3_tiny", 11, "Qwen3ForCausalLM", "1"),
                                                          ("qwen3_tiny", 11, "Qwen3ForCausalLM", "0"),
                                                          ("dsv4_tiny", 12, "DeepseekV4ForCausalLM", "1")],
                         ids=["qwen3", "qwen3_gather", "dsv4"])
def test_engine_greedy_equals_transformers_generate(name, seed, oracle, kernels, tmp_path, one_torch_thread,
                                                    monkeypatch):
    pools_start_full_of_nan(monkeypatch)
    monkeypatch.setenv("APPLIANCE_CPU_KERNELS", kernels)       # "0": Qwen3's decode rows through gather + SDPA
    model = load_runtime_config([f"+model={name}"]).model
    checkpoint = write_tiny_checkpoint(tmp_path / name, model, seed=seed, std=0.1)
    prompts = workload(model.layout.vocab_size)
    ours, runner = run_appliance([f"+model={name}", f"model.weights={checkpoint}", *PRESSURE], prompts)
    if name == "qwen3_tiny":
        assert (runner.paged_decode is None) == (kernels == "0")
    assert_same_greedy(prompts, ours, transformers_greedy(oracle, checkpoint, prompts, NEW_TOKENS))
