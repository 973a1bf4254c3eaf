"""Capacity planner: device memory -> per-group KV-cache block counts. A pure function of numbers.

The runtime (with measured peak memory) and `mode=plan` (with estimated peak memory) call the same
`plan_capacity`, through the one config adapter `plan_for_config`, so a plan made offline with the
runtime's inputs equals the runtime allocation.

    budget          = total_bytes x utilization - peak_non_kv_bytes - non_torch_margin_bytes   (per device)
    capacity_slots  = (min budget - scratch_bytes) // bytes_per_slot
    num_blocks[g]   = capacity_slots x max_blocks_per_seq[g]

Before any of that, each device must have free_bytes >= total_bytes x utilization (measured before this
process loaded anything): a device another process already uses cannot give what the plan assumes, and
failing there, naming the device, beats an out-of-memory error after minutes of loading.

non_torch_margin_bytes is memory the profile cannot see because it is allocated outside torch's allocator
after startup: collective buffers (HCCL reserves 2 x HCCL_BUFFSIZE = 400 MB per communication domain at
its default of 200 MB; NCCL keeps per-channel buffers), runtime workspaces and graph caches. It comes from
device.non_torch_margin_bytes (conf/device/*.yaml); non_torch_margin() resolves it for the runtime and
mode=plan alike, so both subtract the same figure.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

from appliance.core.archs import rank_cache_groups
from appliance.core.config import DeviceSettings, RuntimeConfig
from appliance.core.errors import StartupError
from appliance.core.kv_cache_spec import CacheGroupSpec, bytes_per_slot, scratch_bytes
from appliance.core.parallel import place_of
from appliance.core.units import human_bytes


@dataclass(frozen=True)
class DeviceMemory:
    """What one device offers: total memory, free memory before loading, the peak of everything but KV,
    and the margin kept for memory outside torch's allocator."""

    name: str
    total_bytes: int
    free_bytes: int
    peak_non_kv_bytes: int
    non_torch_margin_bytes: int = 0


@dataclass(frozen=True)
class DeviceBudget:
    name: str
    total_bytes: int
    free_bytes: int
    peak_non_kv_bytes: int
    non_torch_margin_bytes: int
    usable_bytes: int          # total x utilization
    budget_bytes: int          # usable - peak_non_kv - margin: what KV cache and scratch may take
    headroom_bytes: int        # budget left after scratch and the planned slots


@dataclass(frozen=True)
class GroupPlan:
    name: str
    history: str
    num_layers: int
    rows_per_block: int
    page_size_bytes: int
    max_blocks_per_seq: int
    num_blocks: int
    bytes: int
    share_of_budget: float


@dataclass(frozen=True)
class CapacityPlan:
    utilization: float
    decode_batch: int
    max_model_len: int
    block_size: int
    devices: tuple[DeviceBudget, ...]
    limiting_device: str
    budget_bytes: int          # on the limiting device
    scratch_bytes: int
    bytes_per_slot: int
    capacity_slots: int        # sequences at max_model_len one device's pools hold
    groups: tuple[GroupPlan, ...]
    kv_cache_bytes: int        # capacity_slots x bytes_per_slot
    unused_bytes: int          # budget - scratch - kv_cache_bytes; always < bytes_per_slot unless overridden
    kv_tokens_per_device: int  # capacity_slots x max_model_len
    max_concurrency: int       # capacity_slots x data_parallel_size (each data-parallel rank has its own pools)
    override: str | None       # "kv_cache_memory_bytes=..." or "num_slots_override=..." when pinned
    data_parallel_size: int = 1   # ranks with their own sequences and pools

    def group(self, name: str) -> GroupPlan:
        return next(g for g in self.groups if g.name == name)

    @property
    def num_blocks(self) -> dict[str, int]:
        return {g.name: g.num_blocks for g in self.groups}

    def to_dict(self) -> dict:
        return asdict(self)


class InsufficientMemoryError(StartupError, RuntimeError):
    """A device cannot give what the config asks: too little free memory at startup, or a budget that cannot
    hold the scratch pages plus one capacity slot. Raised before any pool is allocated; the CLI exits 2."""


def format_bytes(n: int) -> str:
    """Exact bytes for checking, a readable unit for reading: '1,073,741,824 B (1.00 GiB)', '512 B'."""
    return f"{n:,} B" if abs(n) < 1024 else f"{n:,} B ({human_bytes(n)})"


_ADVICE = ("raise npu_memory_utilization, lower max_model_len or decode_batch, "
           "or use more devices (smaller weight shards)")


def non_torch_margin(device: DeviceSettings, kind: str) -> int:
    """device.non_torch_margin_bytes for a device of `kind`; device=auto falling back to the host CPU keeps
    none, as cpu.yaml does (its budget is already the cap device.cpu_memory_bytes)."""
    if device.kind == "auto" and kind == "cpu":
        return 0
    return device.non_torch_margin_bytes


def usable_bytes(total_bytes: int, utilization: float) -> int:
    """total x npu_memory_utilization: what the appliance may use of a device. The one place it is computed: free
    memory is checked against it, the KV budget and the weights' fit (npu/launcher.py) come out of it."""
    return int(total_bytes * utilization)


def least_kv_bytes(specs: Sequence[CacheGroupSpec], decode_batch: int) -> int:
    """The least KV cache a plan accepts: decode_batch scratch pages plus one capacity slot."""
    return scratch_bytes(specs, decode_batch) + bytes_per_slot(specs)


def kv_shortfall(budget_bytes: int, specs: Sequence[CacheGroupSpec], decode_batch: int) -> int:
    """Bytes a KV budget lacks for the least KV cache (0 when it fits): the one fit check, made before loading
    (budget: usable - estimated weights) and when planning (budget: usable - measured peak - margin)."""
    return max(0, least_kv_bytes(specs, decode_batch) - budget_bytes)


def check_weights_fit(devices: Sequence[tuple[str, int]], weight_bytes: int, specs: Sequence[CacheGroupSpec], *,
                      model_name: str, utilization: float, decode_batch: int, max_model_len: int, shard: str,
                      fallback: str = "") -> None:
    """Fail before any weight is materialized when a device (name, total bytes) cannot hold its rank's shard at all:

        usable    = total x utilization                                  (usable_bytes)
        shortfall = weight_bytes + scratch + one slot - usable           (kv_shortfall of usable - weight_bytes)

    weight_bytes is the rank's shard as mode=plan estimates it (appliance.core.estimate); `shard` says which shard
    that is, `fallback` why this device was chosen when device=auto fell back. Activations are not guessed here: the
    profiling step measures them right after loading (mode=plan's activation allowance, sized for NPU-scale models,
    would refuse the embedded tiny model on its 1 GiB CPU budget)."""
    least_kv = least_kv_bytes(specs, decode_batch)
    need = weight_bytes + least_kv
    for name, total in devices:
        usable = usable_bytes(total, utilization)
        shortfall = kv_shortfall(usable - weight_bytes, specs, decode_batch)
        if not shortfall:
            continue
        raise InsufficientMemoryError(
            f"{model_name} does not fit on device {name}{fallback}; nothing was loaded:\n"
            f"  total x npu_memory_utilization  {format_bytes(total)} x {utilization} = {format_bytes(usable)}\n"
            f"  estimated weights               {format_bytes(weight_bytes)} (from model.layout, as mode=plan "
            f"estimates them; {shard})\n"
            f"  least KV cache                  {format_bytes(least_kv)} ({decode_batch} scratch pages + one "
            f"slot at max_model_len {max_model_len})\n"
            f"  shortfall                       {format_bytes(shortfall)}\n"
            f"Fix: serve it on devices with at least {format_bytes(math.ceil(need / utilization))} each (device=npu, "
            f"device=cuda), spread it over more devices (device.count and parallel.*: smaller shards), plan the "
            f"deployment offline first with the same overrides plus mode=plan device=ascend_a3, or pick a smaller "
            f"model (e.g. +model=dsv4_tiny)")


def check_free_memory(devices: Sequence[DeviceMemory], utilization: float) -> None:
    """Every device has at least total x utilization free (vLLM refuses to start below that too)."""
    for dev in devices:
        wanted = usable_bytes(dev.total_bytes, utilization)
        if dev.free_bytes < wanted:
            fits = dev.free_bytes / dev.total_bytes if dev.total_bytes else 0.0
            raise InsufficientMemoryError(
                f"device {dev.name}: free memory {format_bytes(dev.free_bytes)} is less than total {format_bytes(dev.total_bytes)} "
                f"x npu_memory_utilization {utilization} = {format_bytes(wanted)}; something else holds "
                f"{format_bytes(dev.total_bytes - dev.free_bytes)} of it. Fix: free the device (npu-smi info / nvidia-smi "
                f"show its processes) or lower npu_memory_utilization to at most {fits:.3f}.")


# When the devices report room for a plan whose allocation just failed (fragmentation, or a host that
# overcommits), the report cannot size the retry; give back this fraction of the slots (at least one) so
# that a large plan converges in a few retries instead of one per slot.
UNEXPLAINED_FAILURE_SHRINK = 8


def slots_that_fit(plan: CapacityPlan, devices: Sequence[DeviceMemory], free_bytes: Sequence[int],
                   held_bytes: Sequence[int]) -> int:
    """Capacity slots the devices can still take after an allocation of `plan` failed, from what they report
    once the pools are freed: per device, free - margin - the activation peak still to come (peak_non_kv -
    what this process holds now) - scratch, in whole slots. Always fewer than the plan's, so a retry shrinks."""
    fits = plan.capacity_slots
    for dev, free, held in zip(devices, free_bytes, held_bytes):
        activations = max(0, dev.peak_non_kv_bytes - held)
        room = free - dev.non_torch_margin_bytes - activations - plan.scratch_bytes
        fits = min(fits, room // plan.bytes_per_slot)
    if fits >= plan.capacity_slots:
        fits = plan.capacity_slots - max(1, plan.capacity_slots // UNEXPLAINED_FAILURE_SHRINK)
    return max(0, fits)


def plan_capacity(
    specs: Sequence[CacheGroupSpec],
    devices: Sequence[DeviceMemory],
    *,
    utilization: float,
    decode_batch: int,
    max_model_len: int,
    block_size: int,
    kv_cache_memory_bytes: int | None = None,
    num_slots_override: int | None = None,
    data_parallel_size: int = 1,
) -> CapacityPlan:
    """Size every group from the most constrained device; fail fast with what to change.

    `devices` are the ranks' devices (every rank allocates the same blocks per group: the minimum budget
    wins); `specs` the cache groups as one rank stores them. Sequences are spread over data_parallel_size
    ranks, each with its own pools; tensor-parallel ranks of one data-parallel rank share its sequences."""
    if not devices:
        raise ValueError("plan_capacity needs at least one device")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization {utilization!r} must be in (0, 1]")
    slot = bytes_per_slot(specs)
    scratch = scratch_bytes(specs, decode_batch)

    check_free_memory(devices, utilization)
    budgets: list[tuple[DeviceMemory, int, int]] = []
    for dev in devices:
        usable = usable_bytes(dev.total_bytes, utilization)
        derived = usable - dev.peak_non_kv_bytes - dev.non_torch_margin_bytes
        head = (f"device {dev.name}: total {format_bytes(dev.total_bytes)}, free {format_bytes(dev.free_bytes)}, "
                f"peak_non_kv {format_bytes(dev.peak_non_kv_bytes)}, non-torch margin {format_bytes(dev.non_torch_margin_bytes)}, "
                f"utilization {utilization}")
        if derived <= 0:
            what = ("peak_non_kv alone exceeds" if dev.peak_non_kv_bytes >= usable else
                    "peak_non_kv + the non-torch margin exceed")
            raise InsufficientMemoryError(
                f"{head}: {what} total x utilization ({format_bytes(usable)}) by {format_bytes(-derived)}; no memory is left "
                f"for the KV cache. Fix: {_ADVICE}.")
        budget = derived
        if kv_cache_memory_bytes is not None:
            if kv_cache_memory_bytes > derived:
                raise InsufficientMemoryError(
                    f"{head}: kv_cache.kv_cache_memory_bytes {format_bytes(kv_cache_memory_bytes)} exceeds the "
                    f"budget {format_bytes(derived)} by {format_bytes(kv_cache_memory_bytes - derived)}. "
                    f"Fix: lower it or {_ADVICE}.")
            budget = kv_cache_memory_bytes
        shortfall = kv_shortfall(budget, specs, decode_batch)
        if shortfall:
            raise InsufficientMemoryError(
                f"{head}: budget {format_bytes(budget)} cannot hold scratch {format_bytes(scratch)} + one slot "
                f"{format_bytes(slot)} (max_model_len {max_model_len}); shortfall {format_bytes(shortfall)}. "
                f"Fix: {_ADVICE}.")
        budgets.append((dev, usable, budget))

    limiting, _, limit_budget = min(budgets, key=lambda b: b[2])
    slots = (limit_budget - scratch) // slot
    override = None
    if kv_cache_memory_bytes is not None:
        override = f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
    if num_slots_override is not None:
        if scratch + num_slots_override * slot > limit_budget:
            raise InsufficientMemoryError(
                f"device {limiting.name}: kv_cache.num_slots_override {num_slots_override} needs "
                f"{format_bytes(scratch + num_slots_override * slot)} but the budget is "
                f"{format_bytes(limit_budget)}; at most {slots} slots fit. Fix: lower it or {_ADVICE}.")
        slots = num_slots_override
        override = f"num_slots_override={num_slots_override}"

    kv_bytes = slots * slot
    return CapacityPlan(
        utilization=utilization, decode_batch=decode_batch, max_model_len=max_model_len, block_size=block_size,
        devices=tuple(
            DeviceBudget(dev.name, dev.total_bytes, dev.free_bytes, dev.peak_non_kv_bytes, dev.non_torch_margin_bytes,
                         usable, budget, budget - scratch - kv_bytes)
            for dev, usable, budget in budgets),
        limiting_device=limiting.name, budget_bytes=limit_budget, scratch_bytes=scratch, bytes_per_slot=slot,
        capacity_slots=slots, groups=_group_plans(specs, slots, limit_budget), kv_cache_bytes=kv_bytes,
        unused_bytes=limit_budget - scratch - kv_bytes, kv_tokens_per_device=slots * max_model_len,
        max_concurrency=slots * data_parallel_size, override=override, data_parallel_size=data_parallel_size,
    )


def _group_plans(specs: Sequence[CacheGroupSpec], slots: int, budget: int) -> tuple[GroupPlan, ...]:
    return tuple(
        GroupPlan(
            name=s.name, history=s.history, num_layers=s.num_layers, rows_per_block=s.rows_per_block,
            page_size_bytes=s.page_size_bytes, max_blocks_per_seq=s.max_blocks_per_seq,
            num_blocks=slots * s.max_blocks_per_seq, bytes=slots * s.max_memory_usage_bytes,
            share_of_budget=(slots * s.max_memory_usage_bytes / budget) if budget else 0.0,
        )
        for s in specs)


def plan_for_config(rc: RuntimeConfig, devices: Sequence[DeviceMemory],
                    num_slots_override: int | None = None) -> CapacityPlan:
    """plan_capacity with a config's settings (what mode=plan and the launcher both call), on the cache groups
    as a rank stores them (tensor parallel: its kv heads only; every rank's are the same size).

    num_slots_override (the launcher's retry after a failed allocation) wins over the config's own.
    """
    return plan_capacity(
        rank_cache_groups(rc.model, place_of(rc.parallel, 0)), devices, utilization=rc.npu_memory_utilization,
        decode_batch=rc.decode_batch, max_model_len=rc.max_model_len, block_size=rc.block_size,
        kv_cache_memory_bytes=rc.kv_cache.kv_cache_memory_bytes,
        num_slots_override=num_slots_override if num_slots_override is not None else rc.kv_cache.num_slots_override,
        data_parallel_size=rc.parallel.data_parallel_size or 1)
