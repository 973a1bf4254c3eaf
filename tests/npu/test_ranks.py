"""Capacity agreed by every rank: two real rank processes (gloo) whose devices' memory comes from a fake probe.

Each rank loads its tensor-parallel shard, profiles its own steps and probes its own (scripted) device; the
ranks exchange what they measured, plan from the same numbers and allocate the same blocks: those of the
device with the least room, which the startup response names. A rank whose device cannot hold one slot fails
the launch before anything is allocated, and every rank says which one and by how much; a rank that never
arrives ends the rendezvous after parallel.startup_timeout_s, named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from appliance.config.compose import load_runtime_config
from appliance.core.planner import DeviceMemory, plan_for_config
from tests.conftest import REPO
from tests.npu.rank_launch import OVERRIDES, PEAK_BYTES

MiB = 1 << 20


def launch_two(total0: int, total1: int, *rank1_args: str) -> tuple[tuple[int, str], tuple[int, str]]:
    """(exit status, last output line) of rank 0 and rank 1."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    cmd = [sys.executable, "-m", "tests.npu.rank_launch"]
    first = subprocess.Popen(cmd + ["0", str(total0)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        port = first.stdout.readline().split()[1]
        second = subprocess.run(cmd + ["1", str(total1), "--port", port, *rank1_args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                text=True, timeout=240)
        out0, _ = first.communicate(timeout=240)
    finally:
        first.kill()
    return (first.returncode, out0.strip().splitlines()[-1]), (second.returncode, second.stdout.strip().splitlines()[-1])


def test_a_rank_that_never_arrives_ends_the_rendezvous_after_the_timeout_naming_it():
    proc = subprocess.run([sys.executable, "-m", "tests.npu.rank_launch", "0", str(1024 * MiB), "--timeout", "3"],
                          cwd=REPO, env={k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = proc.stdout.strip().splitlines()[-1]
    assert "not every rank reached 'joining' within parallel.startup_timeout_s=3 s" in error
    assert "rank 1 is at 'not started'" in error


def test_every_rank_allocates_the_capacity_of_the_rank_with_least_memory():
    (code0, out0), (code1, out1) = launch_two(1024 * MiB, 600 * MiB)
    assert code0 == code1 == 0, (out0, out1)
    zero, one = json.loads(out0), json.loads(out1)
    assert zero == one                                                  # one plan, agreed by both
    assert zero["limiting"] == zero["response_limiting"] == "cpu:0 (rank 1)"
    assert [d[:2] for d in zero["devices"]] == [["cpu:0 (rank 0)", 1024 * MiB], ["cpu:0 (rank 1)", 600 * MiB]]
    rc = load_runtime_config(OVERRIDES)
    scratch_pages = rc.decode_batch
    assert zero["pool_pages"] == {g: n + scratch_pages for g, n in zero["num_blocks"].items()}
    # The plan rank 1's memory alone gives (its peak is the probe's, less the scratch pools the planner counts).
    page = rc.model.cache_groups[0].page_size_bytes // 2                 # TP 2: each rank holds half the kv heads
    peak = PEAK_BYTES - scratch_pages * page
    alone = plan_for_config(rc, [DeviceMemory("cpu:0 (rank 1)", 600 * MiB, 600 * MiB, peak)])
    assert zero["capacity_slots"] == alone.capacity_slots < plan_for_config(
        rc, [DeviceMemory("cpu:0 (rank 0)", 1024 * MiB, 1024 * MiB, peak)]).capacity_slots


def test_a_rank_whose_device_cannot_hold_one_slot_fails_the_launch_naming_it_and_the_shortfall():
    rc = load_runtime_config(OVERRIDES)
    page = rc.model.cache_groups[0].page_size_bytes // 2
    scratch_pages, slot = rc.decode_batch, page * rc.model.cache_groups[0].max_blocks_per_seq
    peak = PEAK_BYTES - scratch_pages * page
    short = 1000                                                         # bytes missing on rank 1
    total1 = int((peak + scratch_pages * page + slot - short) / rc.npu_memory_utilization) + 1
    (code0, out0), (code1, out1) = launch_two(1024 * MiB, total1)
    assert code0 == code1 == 2, (out0, out1)
    for out in (out0, out1):
        assert out.startswith("error: device cpu:0 (rank 1): total"), out
        assert "cannot hold scratch" in out and "shortfall" in out and "Fix:" in out


def test_a_rank_whose_allocation_fails_and_shrinks_sets_every_rank_s_capacity():
    """Both devices plan the same N slots; rank 1's allocation fails and its device then has room for N // 2.
    Every rank must re-allocate the fewest slots any rank holds (min, not max: a rank cannot hold more than
    its device gave it, and the scheduler plans one capacity for all of them)."""
    rc = load_runtime_config(OVERRIDES)
    page = rc.model.cache_groups[0].page_size_bytes // 2                 # TP 2: each rank holds half the kv heads
    scratch = rc.decode_batch * page
    slot = page * rc.model.cache_groups[0].max_blocks_per_seq
    peak = PEAK_BYTES - scratch
    total = 256 * MiB
    planned = plan_for_config(rc, [DeviceMemory(f"cpu:0 (rank {r})", total, total, peak) for r in (0, 1)])
    fits = planned.capacity_slots // 2
    assert fits >= 1 and (planned.bytes_per_slot, planned.scratch_bytes) == (slot, scratch)
    # After the failure the device reports room for exactly `fits` slots (and half of one more): free memory
    # less the margin, the activations still to come and the scratch pages.
    free_after = rc.device.non_torch_margin_bytes + peak + scratch + fits * slot + slot // 2
    (code0, out0), (code1, out1) = launch_two(total, total, "--pool-limit", str(scratch + fits * slot),
                                              "--free-after", str(free_after))
    assert code0 == code1 == 0, (out0, out1)
    zero, one = json.loads(out0), json.loads(out1)
    assert zero["capacity_slots"] == one["capacity_slots"] == fits
    assert zero["pool_pages"] == one["pool_pages"] == {g: n + rc.decode_batch for g, n in one["num_blocks"].items()}
    assert zero["retries"] == 1                      # rank 0 allocated N, then re-allocated rank 1's capacity
