"""Decode steps through static buffers, one per batch bucket (npu/graphs.py, Qwen3Runner.capture_graphs): the path a
GPU records as graphs and replays. On the CPU it runs eagerly on the same static buffers (device.graphs=true), so its
indexing is checked here: the same logits as the ordinary step for every batch size (padding rows included), no real
page written by a padding row, the same greedy tokens through the engine, and the step free of host syncs on fake
CUDA tensors (what a graph needs: tests/support/fake_cuda)."""

from __future__ import annotations

import random

import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.request import SamplingParams
from appliance.offline import Appliance
from npu.graphs import batch_buckets
from npu.qwen3.graph_step import GraphStep
from npu.qwen3.runner import Qwen3Runner
from npu.step import SeqStep, StepBatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_LEN = 128


def runner(graphs: bool) -> Qwen3Runner:
    r = Qwen3Runner(load_runtime_config(["+model=qwen3_tiny"]).model, "cpu")
    r.load_weights()
    r.allocate_pools({"kv": 40}, 8)
    r.execute(StepBatch([], new_pages={"kv": list(range(40))}))    # every page zeroed, as when first used
    if graphs:
        assert "buckets [1, 2, 4, 8]" in r.capture_graphs(8, record=False, max_model_len=MAX_LEN)
    return r


def test_buckets_are_powers_of_two_then_the_largest():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48)


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8])
def test_static_decode_gives_the_ordinary_steps_logits_and_touches_no_real_page_with_padding(rows):
    plain, static = runner(False), runner(True)
    rng = random.Random(rows)
    seqs = []
    for i in range(rows):
        n = rng.randint(1, 60)
        table = [4 * i + j for j in range(4)]
        seqs.append((f"r{i}", [rng.randrange(3, 500) for _ in range(n)], table))
        for r in (plain, static):
            r.execute(StepBatch([SeqStep(f"r{i}", seqs[-1][1], 0, {"kv": table}, sample=False)]))
    for step in range(3):
        batch = StepBatch([SeqStep(name, [rng.randrange(3, 500)], len(tokens) + step, {"kv": table})
                           for name, tokens, table in seqs])
        assert isinstance(static.prepare(batch), GraphStep)
        want, got = plain.execute(batch), static.execute(batch)
        assert got.shape == want.shape == (rows, 512)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    real = slice(0, 40)     # the real pages: equal up to rounding (a padding row's K/V would differ by far more)
    assert torch.allclose(plain.pools["kv"][:, real], static.pools["kv"][:, real], atol=1e-5, rtol=1e-5)
    assert static.pools["kv"][:, 40].abs().sum() > 0 if rows not in batch_buckets(8) else True   # padding: scratch


def test_steps_that_are_not_plain_decode_take_the_ordinary_path():
    static = runner(True)
    static.execute(StepBatch([SeqStep("a", list(range(3, 20)), 0, {"kv": [0, 1]}, sample=False)]))
    for batch in (StepBatch([SeqStep("a", [5, 6], 17, {"kv": [0, 1]})]),                      # a chunk
                  StepBatch([SeqStep("a", [5], 17, {"kv": [0, 1]}, all_logits=True)]),         # prompt logprobs
                  StepBatch([SeqStep(f"r{i}", [5], 0, {"kv": [2 + i]}) for i in range(9)])):  # beyond the buckets
        assert not isinstance(static.prepare(batch), GraphStep)
        static.execute(batch)


def test_the_engine_gives_the_same_greedy_tokens_with_static_decode():
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 90))] for _ in range(7)]
    outs = []
    for graphs in ("false", "true"):
        with Appliance.from_config(["+model=qwen3_tiny", "device=cpu", f"device.graphs={graphs}",
                                    f"max_model_len={MAX_LEN}", "max_num_seqs=8", "decode_batch=8"]) as app:
            results = app.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
            notes = app.report.notes
        outs.append([r.token_ids for r in results])
        assert any("through static buffers" in n for n in notes) == (graphs == "true")
    assert outs[0] == outs[1]


def test_a_static_decode_step_runs_on_the_device_alone():
    """The bucket's step on fake CUDA tensors: no host sync and nothing on the host (a graph could not hold it)."""
    from tests.npu.test_device_guard import QWEN3, fake_runner, step, tables
    from tests.support.fake_cuda import fake_cuda
    r, _ = fake_runner(QWEN3)
    with fake_cuda(loading=True):
        assert r.capture_graphs(4, record=False, max_model_len=128)
    a, b = tables(r, 0, 128), tables(r, 10, 128)
    step(r, StepBatch([SeqStep("a", list(range(3, 20)), 0, a), SeqStep("b", list(range(5, 9)), 0, b)]))
    batch = StepBatch([SeqStep("a", [7], 17, a), SeqStep("b", [11], 4, b), SeqStep("c", [3], 0, tables(r, 20, 128))])
    assert isinstance(r.prepare(batch), GraphStep)
    assert step(r, batch).shape[0] == 3
