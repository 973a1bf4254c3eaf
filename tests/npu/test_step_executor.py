"""A ModelRunner is a StepExecutor of one data-parallel rank: what the engine calls on a DeviceGroup (every rank)
it can call on a runner in this process too, without asking which it holds."""

from __future__ import annotations

import pytest

from appliance.config.compose import load_runtime_config
from npu.step import SeqStep, StepBatch
from tests.support.fake_device import ShapeOnlyRunner


def test_a_runner_steps_one_partition_and_has_no_rank_to_lose():
    model = load_runtime_config(["+model=qwen3_tiny"]).model
    runner = ShapeOnlyRunner(model)
    batch = StepBatch([SeqStep("a", [1, 2, 3], 0, {}), SeqStep("b", [4], 7, {})])
    assert runner.execute_partitions([batch]).shape == runner.execute(batch).shape == (2, model.layout.vocab_size)
    with pytest.raises(ValueError, match="got 2 batches"):
        runner.execute_partitions([batch, batch])
    lost: list[str] = []
    runner.watch(lost.append)
    runner.shutdown()
    assert lost == []
