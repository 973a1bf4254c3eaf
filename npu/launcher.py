"""Startup: backend -> runner -> weights -> one profiling step -> measured memory -> plan -> pools -> report.

    runner, report = launch(rc)

1. open the backend: select it (device=auto: npu, then cuda, then cpu, logged with why) and check that every
   device can hold the weights estimated from the layout, before any weight is materialized;
2. build the runner for model.arch (found through the architecture registry, imported when chosen);
3. load weights (timed);
4. allocate scratch-only pools (0 blocks + decode_batch scratch pages), reset the peak, run the largest
   step the config allows (max_num_batched_tokens over min(max_num_seqs, ...) sequences; deepseek_v4
   caps a sequence's step at layout.tokens_in_flight), and read each device's probe;
   peak_non_kv = peak allocated + non-torch growth - the scratch pools (the planner counts scratch itself);
5. appliance.core.planner.plan_capacity on those numbers (the same function mode=plan calls);
6. allocate every group's pool (plan blocks + decode_batch scratch pages); on an allocation failure free
   everything and re-plan one slot fewer (num_slots_override), until it fits;
7. return the runner and a StartupReport of what was finally allocated.

The planning half runs unchanged with npu.fake's FakeBackend and ShapeOnlyRunner, so NPU-scale startups
are tested on a CPU without allocating anything.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from appliance.core.config import ModelSpec, RuntimeConfig
from appliance.core.estimate import estimate_peak_non_kv
from appliance.core.kv_cache_spec import bytes_per_slot, scratch_bytes
from appliance.core.planner import (
    CapacityPlan,
    DeviceMemory,
    InsufficientMemoryError,
    format_bytes,
    plan_for_config,
)
from appliance.core.startup_report import StartupReport
from npu.backends import Backend, select_backend
from npu.registry import build_runner
from npu.runner import ModelRunner

log = logging.getLogger("npu.launcher")

def profile_shape(rc: RuntimeConfig) -> tuple[int, int]:
    """(tokens, sequences) of the largest step the config allows."""
    per_seq = rc.max_model_len
    if rc.model.arch == "deepseek_v4" and rc.model.layout.tokens_in_flight:
        per_seq = min(per_seq, rc.model.layout.tokens_in_flight)
    num_seqs = max(1, min(rc.max_num_seqs, rc.max_num_batched_tokens))
    return min(rc.max_num_batched_tokens, num_seqs * per_seq), num_seqs


def pool_bytes(runner: ModelRunner) -> int:
    return sum(t.numel() * t.element_size() for t in runner.pools.values())


@dataclass(frozen=True)
class Measurement:
    """What startup measured: the planner's inputs per device, and how they were obtained."""

    devices: tuple[DeviceMemory, ...]
    peak_allocated_bytes: tuple[int, ...]   # probe peak per device (weights + scratch pools + activations)
    non_torch_bytes: tuple[int, ...]
    scratch_pool_bytes: int
    profile_tokens: int
    profile_seqs: int
    load_seconds: float
    profile_seconds: float


def measure(rc: RuntimeConfig, backend: Backend, runner: ModelRunner) -> Measurement:
    """Load weights, run one max-size step on scratch pages, and turn each device's probe into a DeviceMemory.

    The runner lives on device 0; every device hosts a replica (a data-parallel rank), so a device's
    peak_non_kv is the larger of its own probe and device 0's.
    """
    t0 = time.perf_counter()
    runner.load_weights()
    backend.synchronize()
    load_s = time.perf_counter() - t0
    log.info("weights loaded in %.2f s (%s)", load_s, weights_label(rc.model))

    runner.allocate_pools({s.name: 0 for s in rc.model.cache_groups}, rc.decode_batch)
    scratch = pool_bytes(runner)
    tokens, seqs = profile_shape(rc)
    batch = runner.profile_batch(tokens, seqs)
    t0 = time.perf_counter()
    try:
        backend.reset_peak()
        with torch.inference_mode(), backend.tracking() as tracker:
            if tracker is not None:
                tracker.adopt(runner.pools.values())
            runner.execute(batch)
            backend.synchronize()
        stats = [backend.memory(i) for i in range(backend.count)]
    finally:
        runner.free_pools()
    profile_s = time.perf_counter() - t0
    ref = stats[0].peak_allocated_bytes + stats[0].non_torch_bytes
    devices = []
    for i, s in enumerate(stats):
        peak = max(s.peak_allocated_bytes + s.non_torch_bytes, ref) - scratch
        devices.append(DeviceMemory(backend.device_name(i), s.total_bytes, s.free_bytes, max(0, peak)))
    log.info("profiled %d tokens over %d sequences in %.2f s: peak non-KV %s", tokens, seqs, profile_s,
             ", ".join(f"{d.name} {d.peak_non_kv_bytes:,} B" for d in devices[:4]) + (" ..." if len(devices) > 4 else ""))
    return Measurement(tuple(devices), tuple(s.peak_allocated_bytes for s in stats),
                       tuple(s.non_torch_bytes for s in stats), scratch, tokens, seqs, load_s, profile_s)


def allocate(rc: RuntimeConfig, backend: Backend, runner: ModelRunner, plan: CapacityPlan,
             devices: Sequence[DeviceMemory]) -> tuple[CapacityPlan, int]:
    """Allocate the plan's pools; on failure free everything and re-plan one slot fewer. Returns (plan, retries)."""
    retries = 0
    while True:
        try:
            runner.allocate_pools(plan.num_blocks, rc.decode_batch)
            backend.synchronize()
            return plan, retries
        except (RuntimeError, MemoryError) as exc:
            runner.free_pools()
            gc.collect()
            backend.empty_cache()
            if plan.capacity_slots <= 1:
                raise InsufficientMemoryError(
                    f"allocating the KV-cache pools failed even at 1 slot on {backend.device_name(0)} "
                    f"({plan.scratch_bytes + plan.bytes_per_slot:,} B): {exc}") from exc
            retries += 1
            log.warning("allocating %d slots failed (%s); freeing and retrying with %d", plan.capacity_slots,
                        str(exc).splitlines()[0], plan.capacity_slots - 1)
            plan = plan_for_config(rc, devices, num_slots_override=plan.capacity_slots - 1)


def check_weights_fit(rc: RuntimeConfig, backend: Backend) -> None:
    """Fail at once, before any weight is materialized, when a device cannot hold the model at all.

    Each device needs the model's weights plus the least KV cache the planner accepts (decode_batch scratch
    pages and one capacity slot) within total x npu_memory_utilization. The weights are estimated from
    model.layout by the estimate mode=plan uses (appliance.core.estimate); each device holds a full copy
    (the runner is not sharded, so one shard is the whole model). Activations are not guessed here: the
    profiling step measures them right after loading (mode=plan's plan.activation_allowance_bytes, sized
    for NPU-scale models, would refuse the embedded tiny model on its 1 GiB CPU budget).
    """
    specs = rc.model.cache_groups
    weights = estimate_peak_non_kv(rc.model, 1, rc.plan.activation_allowance_bytes).weight_bytes_per_device
    kv_floor = scratch_bytes(specs, rc.decode_batch) + bytes_per_slot(specs)
    need = weights + kv_floor
    u = rc.npu_memory_utilization
    log.info("%s needs at least %s per device before loading: estimated weights %s (from model.layout) + "
             "scratch pages and one slot of KV cache %s", rc.model.name, format_bytes(need), format_bytes(weights),
             format_bytes(kv_floor))
    for i in range(backend.count):
        total = backend.memory(i).total_bytes
        usable = int(total * u)
        if need <= usable:
            continue
        fallback = (f" (device=auto found no NPU or GPU and fell back to the host CPU with a budget of "
                    f"device.cpu_memory_bytes={rc.device.cpu_memory_bytes})"
                    if rc.device.kind == "auto" and backend.kind == "cpu" else "")
        raise InsufficientMemoryError(
            f"{rc.model.name} does not fit on device {backend.device_name(i)}{fallback}; nothing was loaded:\n"
            f"  total x npu_memory_utilization  {format_bytes(total)} x {u} = {format_bytes(usable)}\n"
            f"  estimated weights               {format_bytes(weights)} (from model.layout, as mode=plan "
            f"estimates them; a full copy on each device)\n"
            f"  least KV cache                  {format_bytes(kv_floor)} ({rc.decode_batch} scratch pages + one "
            f"slot at max_model_len {rc.max_model_len})\n"
            f"  shortfall                       {format_bytes(need - usable)}\n"
            f"Fix: serve it on devices with at least {format_bytes(math.ceil(need / u))} each (device=npu, "
            f"device=cuda), plan the deployment offline first with the same overrides plus mode=plan "
            f"device=ascend_a3, or pick a smaller model (e.g. +model=dsv4_tiny)")


def open_backend(rc: RuntimeConfig) -> Backend:
    """The backend for rc.device (device=auto says which it chose and why), checked to hold the weights."""
    backend = select_backend(rc.device)
    check_weights_fit(rc, backend)
    return backend


def weights_label(model: ModelSpec) -> str:
    return f"random (seed {model.weights_seed})" if model.weights == "random" else model.weights


def launch(rc: RuntimeConfig, backend: Backend | None = None,
          runner: ModelRunner | None = None) -> tuple[ModelRunner, StartupReport]:
    """The startup sequence; InsufficientMemoryError (naming the device) propagates before any pool exists.

    A backend passed in has been opened by the caller (open_backend, or a fake one for tests).
    """
    backend = backend or open_backend(rc)
    runner = runner or build_runner(rc.model, backend.torch_device(0))
    log.info("starting %s (%s) on %d x %s", rc.model.name, rc.model.arch, backend.count, backend.kind)
    m = measure(rc, backend, runner)
    plan = plan_for_config(rc, m.devices)
    t0 = time.perf_counter()
    plan, retries = allocate(rc, backend, runner, plan, m.devices)
    alloc_s = time.perf_counter() - t0
    notes = [
        f"profiling step: {m.profile_tokens} tokens over {m.profile_seqs} sequences on scratch pages",
        f"peak_non_kv = probe peak allocated + non-torch growth - scratch pools ({m.scratch_pool_bytes:,} B); "
        f"{backend.device_name(0)} measured {m.peak_allocated_bytes[0]:,} B allocated at peak",
    ]
    if backend.count > 1:
        notes.append(f"the runner was profiled on {backend.device_name(0)}; each device is planned with at least "
                     "that peak (identical data-parallel replicas)")
    if retries:
        notes.append(f"pool allocation failed {retries} time(s); gave back {retries} slot(s)")
    log.info("allocated %d slots (%s) in %.2f s", plan.capacity_slots,
             ", ".join(f"{g.name}={g.num_blocks}" for g in plan.groups), alloc_s)
    report = StartupReport(
        model_name=rc.model.name, arch=rc.model.arch, device_kind=backend.kind, device_count=backend.count,
        plan=plan, resolved_config_yaml=rc.resolved_yaml, weights=weights_label(rc.model),
        load_seconds=m.load_seconds, profile_seconds=m.profile_seconds, allocate_seconds=alloc_s,
        allocation_retries=retries, notes=tuple(notes))
    return runner, report
