"""Logprobs through the engine equal transformers' log_softmax on the same weights (float32, within 1e-4): of
each prompt token (prompt_logprobs) and each sampled token (logprobs), with their top-N, for Qwen3 and DeepSeek
V4 tiny checkpoints, under chunked prefill, a prefix-cache hit the prompt logprobs must not skip, and sampling.

The oracle is transformers' forward pass over prompt + generated tokens (teacher forcing): position j's
log_softmax gives the logprob of token j + 1.
"""

from __future__ import annotations

import random

import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.request import SamplingParams
from appliance.offline import Appliance
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.kv import free_blocks, total_blocks

TOL = 1e-4
TOP = 4
CHUNKED = ["device=cpu", "max_model_len=128", "max_num_seqs=8", "decode_batch=4", "max_num_batched_tokens=32"]


def oracle_logprobs(model_class: str, checkpoint, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] log_softmax of transformers' logits at every position."""
    transformers = pytest.importorskip("transformers")
    net = getattr(transformers, model_class).from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return net(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def assert_matches(got, expected_row: torch.Tensor, token: int, top: int, where: str) -> None:
    assert got.token_id == token, where
    assert abs(got.logprob - expected_row[token].item()) < TOL, (where, got.logprob, expected_row[token].item())
    assert got.rank == int((expected_row > expected_row[token]).sum()) + 1 or \
        abs(expected_row.sort(descending=True).values[got.rank - 1] - got.logprob) < TOL, where
    assert len(got.top) == top, where
    best = expected_row.topk(top).values
    for (tid, lp), want in zip(got.top, best, strict=True):
        assert abs(lp - want.item()) < TOL, (where, "top", lp, want.item())
        assert abs(lp - expected_row[tid].item()) < TOL, (where, "top id", tid)


@pytest.mark.parametrize("name, oracle", [("qwen3_tiny", "Qwen3ForCausalLM"), ("dsv4_tiny", "DeepseekV4ForCausalLM")])
def test_logprobs_equal_transformers_log_softmax(name, oracle, tmp_path, one_torch_thread):
    model = load_runtime_config([f"+model={name}"]).model
    checkpoint = write_tiny_checkpoint(tmp_path / name, model, seed=5, std=0.1)
    rng = random.Random(3)
    shared = [rng.randrange(3, model.layout.vocab_size) for _ in range(48)]
    prompts = [shared + [rng.randrange(3, model.layout.vocab_size) for _ in range(n)] for n in (5, 30)]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP)
    sampled = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=7, logprobs=TOP, prompt_logprobs=2)
    with Appliance.from_config([f"+model={name}", f"model.weights={checkpoint}", *CHUNKED]) as app:
        warm = app.generate([shared + [3]], SamplingParams(max_tokens=1))          # fills the prefix cache
        results = app.generate(prompts, [greedy, sampled])
        assert free_blocks(app.engine) == total_blocks(app.engine)
    assert warm[0].prompt_logprobs == [] and warm[0].logprobs == []
    for prompt, params, result in zip(prompts, [greedy, sampled], results):
        # 53 and 78 tokens at 32 per step: the prompt is prefilled in chunks, and its shared 48 tokens were cached,
        # yet every prompt position is computed.
        assert result.usage.cached_prompt_tokens == 0
        tokens = prompt + result.token_ids
        expected = oracle_logprobs(oracle, checkpoint, tokens)
        assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
        for j in range(1, len(prompt)):
            assert_matches(result.prompt_logprobs[j], expected[j - 1], prompt[j], params.prompt_logprobs,
                           f"prompt token {j}")
        assert len(result.logprobs) == len(result.token_ids) == 6
        for k, token in enumerate(result.token_ids):
            assert_matches(result.logprobs[k], expected[len(prompt) + k - 1], token, TOP, f"output token {k}")
