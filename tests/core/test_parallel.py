"""Parallel sizes: resolved from device.count and the architecture, checked with key paths before any device work,
and the per-rank description mode=plan sizes with (each rank's shard of the weights, its page bytes)."""

import math

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.archs.deepseek_v4.weights import parameter_counts
from appliance.core.archs.qwen3 import tensor_parallel as qwen3
from appliance.core.errors import ConfigError
from appliance.core.estimate import rank_weight_bytes
from appliance.core.parallel import RankPlace, rank_places, split
from appliance.modes.plan import make_plan


def issues(overrides):
    with pytest.raises(ConfigError) as err:
        load_runtime_config(overrides)
    return {(i.path, i.value): i.rule for i in err.value.issues}


def test_split_covers_every_index_once_larger_parts_first():
    for size, parts in ((10, 3), (8, 4), (3, 5), (151936, 8)):
        ranges = [split(size, parts, i) for i in range(parts)]
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        lengths = [b - a for a, b in ranges]
        assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)


def test_nulls_resolve_from_the_device_count_and_the_experts():
    one = load_runtime_config([]).parallel
    assert (one.tensor_parallel_size, one.data_parallel_size, one.expert_parallel_size) == (1, 1, 1)
    a3 = load_runtime_config(["+model=dsv4", "mode=plan", "device=ascend_a3"]).parallel
    assert (a3.data_parallel_size, a3.expert_parallel_size) == (16, 16)        # 256 experts over 16 ranks
    tiny = load_runtime_config(["mode=plan", "device=ascend_a3"]).parallel       # dsv4_tiny: 8 experts
    assert (tiny.data_parallel_size, tiny.expert_parallel_size) == (16, 8)      # two expert groups of 8
    tp = load_runtime_config(["+model=qwen3_tiny", "device=cpu", "device.count=2",
                              "parallel.tensor_parallel_size=2"]).parallel
    assert (tp.data_parallel_size, tp.expert_parallel_size) == (1, 1)
    assert "data_parallel_size: 1" in load_runtime_config(["+model=qwen3_tiny", "device=cpu", "device.count=2",
                                                           "parallel.tensor_parallel_size=2"]).resolved_yaml


def test_bad_sizes_name_the_key_and_the_rule():
    qwen = ["+model=qwen3_tiny", "device=cpu"]
    found = issues(qwen + ["device.count=2", "parallel.tensor_parallel_size=3"])
    assert "must divide device.count (2)" in found["parallel.tensor_parallel_size", 3]
    found = issues(qwen + ["parallel.data_parallel_size=2"])
    assert "must equal device.count (1)" in found["parallel.data_parallel_size", 2]
    assert "Fix: device.count=2" in found["parallel.data_parallel_size", 2]
    found = issues(qwen + ["device.count=2", "parallel.expert_parallel_size=2"])
    assert "arch qwen3 supports data, tensor parallelism, not expert" in found["parallel.expert_parallel_size", 2]
    found = issues(["device=cpu", "device.count=2", "parallel.tensor_parallel_size=2"])
    assert "arch deepseek_v4 supports data, expert parallelism, not tensor" in \
        found["parallel.tensor_parallel_size", 2]
    found = issues(["device=cpu", "device.count=6", "parallel.expert_parallel_size=3"])
    assert "must divide model.layout.num_experts (8)" in found["parallel.expert_parallel_size", 3]
    found = issues(qwen + ["device.count=4", "parallel.tensor_parallel_size=4"])      # 2 kv heads
    assert "must divide model.layout.num_kv_heads (2)" in found["parallel.tensor_parallel_size", 4]
    found = issues(qwen + ["parallel.startup_timeout_s=0"])
    assert "must be > 0" in found["parallel.startup_timeout_s", 0]


def test_bad_sizes_exit_2_from_the_cli(cli):
    proc = cli("+model=qwen3_tiny", "mode=validate", "device=cpu", "device.count=2", "parallel.tensor_parallel_size=3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "parallel.tensor_parallel_size = 3: must divide device.count (2)" in proc.stderr


def test_ranks_are_data_major_and_experts_split_by_expert_group():
    rc = load_runtime_config(["+model=qwen3_tiny", "mode=plan", "device=ascend_a2", "parallel.tensor_parallel_size=2"])
    places = rank_places(rc.parallel)
    assert [(p.data_rank, p.tensor_rank) for p in places[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ep = RankPlace(5, tensor=1, data=8, expert=4)
    assert ep.expert_rank == 1 and ep.experts(256) == range(64, 128)


def test_qwen3_tensor_parallel_plan_uses_per_rank_shards_and_page_bytes():
    base = ["+model=qwen3_tiny", "mode=plan", "device=ascend_a2", "device.count=2", "plan.peak_non_kv_bytes=0"]
    tp1 = load_runtime_config(base + ["parallel.data_parallel_size=2"])
    tp2 = load_runtime_config(base + ["parallel.tensor_parallel_size=2"])
    one, two = make_plan(tp1), make_plan(tp2)
    assert two.bytes_per_slot * 2 == one.bytes_per_slot           # each rank keeps half of the kv heads
    assert two.group("kv").page_size_bytes * 2 == one.group("kv").page_size_bytes
    assert (one.data_parallel_size, two.data_parallel_size) == (2, 1)
    assert one.max_concurrency == 2 * one.capacity_slots and two.max_concurrency == two.capacity_slots
    lay = tp2.model.layout
    whole = rank_weight_bytes(tp2.model, RankPlace.single())
    shards = [rank_weight_bytes(tp2.model, p) for p in rank_places(tp2.parallel)]
    fp32 = 4
    replicated = fp32 * sum(math.prod(shape) for _, shape, dim in qwen3.parameters(lay) if dim is None)
    assert whole == fp32 * sum(math.prod(shape) for _, shape, _ in qwen3.parameters(lay))
    assert sum(shards) == whole + replicated                       # divided once, replicated on both


def test_dsv4_expert_parallel_plan_divides_only_the_routed_experts():
    rc = load_runtime_config(["+model=dsv4", "mode=plan", "device=ascend_a3", "max_model_len=8192"])
    counts = parameter_counts(rc.model.layout)
    plan = make_plan(rc)
    allowance = rc.plan.activation_allowance_bytes
    assert len(plan.devices) == 16
    assert {d.peak_non_kv_bytes for d in plan.devices} == {counts.replicated_bytes + counts.expert_bytes // 16
                                                            + allowance}
