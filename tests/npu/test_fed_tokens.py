"""Fed tokens (npu.step.FedTokens, ModelRunner.feed_rows): async scheduling launches a step before the host has read
the previous one's sampled ids, so a decode row's token comes from a device tensor instead of its SeqStep.

- A fed step gives bit for bit the logits of the same step with the tokens written out, on Qwen3's ordinary step, its
  decode graphs' static buffers (replayed eagerly on the CPU) and DeepSeek V4's, with fed and written rows mixed, the
  source's ids in another order than the batch's, and a prompt chunk before them in the batch (a step lays its decode
  rows out first, so a fed row's flat row is not its batch index).
- On fake CUDA tensors a fed step runs with no host sync (the source is a device tensor the host never reads).
"""

from __future__ import annotations

import pytest
import torch

from appliance.config.compose import load_runtime_config
from npu.qwen3.graph_step import GraphStep
from npu.registry import build_runner
from npu.runner import ModelRunner
from npu.step import FedTokens, SeqStep, StepBatch
from tests.npu.test_device_guard import DSV4, QWEN3, fake_runner, step, tables
from tests.support.fake_cuda import fake_cuda

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PLACEHOLDER = 0


def cpu_runner(overrides: list[str], graphs: bool = False) -> ModelRunner:
    rc = load_runtime_config(overrides)
    runner = build_runner(rc.model, torch.device("cpu"))
    runner.load_weights()
    runner.allocate_pools({g.name: 64 for g in rc.model.cache_groups}, rc.decode_batch)
    runner.execute(StepBatch([], new_pages={g.name: list(range(64)) for g in rc.model.cache_groups}))
    if graphs:
        assert runner.capture_graphs(4, record=False, max_model_len=128)
    return runner


def prefilled(runner: ModelRunner) -> list[tuple[str, dict[str, list[int]], int]]:
    """Three sequences prefilled to 40, 8 and 33 tokens (contexts far enough apart for Qwen3's decode buckets to split
    them); (request id, block tables, next position)."""
    seqs = [("a", tables(runner, 0, 128), 40), ("b", tables(runner, 20, 128), 8), ("c", tables(runner, 40, 128), 33)]
    for rid, t, n in seqs:
        for start in range(0, n, 16):       # chunks on 16-token blocks (DeepSeek V4's tiny tokens_in_flight)
            end = min(start + 16, n)
            runner.execute(StepBatch([SeqStep(rid, list(range(3 + start, 3 + end)), start, t, sample=False,
                                              prompt_len=n)]))
    return seqs


@pytest.mark.parametrize("overrides, graphs", [(QWEN3, False), (QWEN3, True), (DSV4, False)],
                         ids=["qwen3", "qwen3_static_buffers", "dsv4"])
def test_a_fed_step_gives_the_logits_of_the_step_with_its_tokens_written(overrides, graphs):
    runner = cpu_runner(overrides, graphs)
    seqs = prefilled(runner)
    tokens = {"a": 71, "b": 12, "c": 45}
    # A prompt's first chunk first in the batch (except for a graph step, all decode rows): a step lays decode rows
    # out first, so a fed row's flat row is not its batch index.
    chunk = [] if graphs else [SeqStep("d", list(range(50, 66)), 0, tables(runner, 60, 128), prompt_len=16)]
    first = len(chunk)

    def batch(fed_rows: set[str], fed: FedTokens | None = None) -> StepBatch:
        return StepBatch(chunk + [SeqStep(rid, [PLACEHOLDER if rid in fed_rows else tokens[rid]], n, t)
                                  for rid, t, n in seqs], fed=fed)
    # Rows a and c fed from a source whose order is not the batch's; b written out.
    source = torch.tensor([99, tokens["c"], 5, tokens["a"]])
    fed = batch({"a", "c"}, FedTokens(source, [(first, 3), (first + 2, 1)]))
    if graphs:
        assert isinstance(runner.prepare(fed), GraphStep)
    want = runner.execute(batch(set())).clone()   # (a graph step's logits are its buffer's: the next replay's too)
    got = runner.execute(fed)                     # the same rows' K/V written again, with the same values
    assert torch.equal(got, want)
    placeholder = runner.execute(batch({"a", "c"}))
    assert not torch.equal(placeholder[first], want[first]), "the placeholder's logits must differ (else nothing is fed)"


@pytest.mark.parametrize("overrides", [QWEN3, DSV4], ids=["qwen3", "dsv4"])
def test_a_fed_step_runs_on_the_device_alone(overrides):
    runner, _ = fake_runner(overrides)
    a, b = tables(runner, 0, 128), tables(runner, 10, 128)
    step(runner, StepBatch([SeqStep("a", list(range(3, 19)), 0, a, sample=False, prompt_len=16),
                            SeqStep("b", list(range(5, 21)), 0, b, sample=False, prompt_len=16)]))
    with fake_cuda():
        source = torch.zeros(2, dtype=torch.long, device="cuda")
    logits = step(runner, StepBatch([SeqStep("a", [PLACEHOLDER], 16, a), SeqStep("b", [PLACEHOLDER], 16, b)],
                                    fed=FedTokens(source, [(0, 1), (1, 0)])))
    assert logits.shape[0] == 2
