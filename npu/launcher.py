"""Startup: backend -> free memory -> runner -> weights -> worst-step profile -> plan -> pools -> report.

    runner, report = launch(rc)

1. open the backend: select it (device=auto: npu, then cuda, then cpu, logged with why) and check that every
   device can hold the weights estimated from the layout, before any weight is materialized; make its device
   this thread's current one;
2. check every configured device has free >= total x npu_memory_utilization, before anything is loaded
   (InsufficientMemoryError naming the device, total, free and utilization: the CLI exits 2);
3. build the runner for model.arch (npu/registry.py);
4. load weights (timed);
5. allocate scratch-only pools (0 blocks + decode_batch scratch pages), reset the peak, run every step of
   appliance.core.step_limits.worst_steps (the heaviest steps the scheduler can issue: it reads the same
   step_limits), then its least steps (least_steps: kernel variants chosen by a step's size are built before the
   first request), and the sampler at its largest batch with temperature, top-k and top-p, then read each
   device's probe as the driver sees it; peak_non_kv = the caching allocator's peak reserved bytes (allocated
   ones, its cache and fragmentation; the CPU: allocated) + this process's memory outside torch (runtime context,
   library workspaces) - the scratch pools (the planner counts scratch itself); then free the scratch pools and
   empty the allocator's cache, so the pools are planned and allocated from the memory the driver reports;
6. appliance.core.planner.plan_capacity on those numbers and the config's non-torch margin (the same
   function and margin mode=plan uses);
7. allocate every group's pool (plan blocks + decode_batch scratch pages); when an allocation fails, free
   everything and re-plan from the free memory the devices then report (planner.slots_that_fit);
8. with device.graphs on (null: on for accelerators), capture the runner's decode graphs over the final pools (the
   profile captured them once on the scratch pools, so their memory is in peak_non_kv; npu/graphs.py);
9. from here on, log each Triton kernel variant built as a warning (npu.triton_runtime.watch_compiles: the profile
   launched every step size, so a later build is a compile a request waits for);
10. return the runner and a StartupReport of what was finally allocated.

The planning half runs unchanged with a scripted backend and a shape-only runner (tests/support/fake_device.py),
so NPU-scale startups are tested on a CPU without allocating anything.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

import torch

from appliance.core.archs import rank_cache_groups
from appliance.core.config import RuntimeConfig
from appliance.core.estimate import estimate_peak_non_kv
from appliance.core.parallel import RankPlace
from appliance.core.planner import (
    CapacityPlan,
    DeviceMemory,
    InsufficientMemoryError,
    check_free_memory,
    check_weights_fit,
    format_bytes,
    least_kv_bytes,
    non_torch_margin,
    plan_for_config,
    slots_that_fit,
)
from appliance.core.startup_report import StartupReport
from appliance.core.step_limits import StepLimits, least_steps, step_limits, worst_steps
from appliance.core.units import human_bytes
from npu.backends import Backend, MemoryStats, select_backend
from npu.registry import build_runner
from npu.runner import ModelRunner
from npu.sampler import Sampler, worst_case_rows
from npu.triton_runtime import watch_compiles
from npu.weights import check_checkpoint_tensors

if TYPE_CHECKING:
    from npu.ranks import RankGroup

log = logging.getLogger("npu.launcher")

T = TypeVar("T")
Phase = Callable[[str, Callable[[], T]], T]     # runs one startup phase (alone, or agreed by every rank)

# The device (of the backend's count) the runner lives on; every other configured device is planned as an
# identical data-parallel replica. Threads that run the runner make it their current device.
RUNNER_DEVICE = 0


def pool_bytes(runner: ModelRunner) -> int:
    return sum(t.numel() * t.element_size() for t in runner.pools.values())


@dataclass(frozen=True)
class Measurement:
    """What startup measured: the planner's inputs per device, and how they were obtained."""

    devices: tuple[DeviceMemory, ...]
    peak_allocated_bytes: tuple[int, ...]   # probe peak per device (weights + scratch pools + activations)
    non_torch_bytes: tuple[int, ...]
    peak_reserved_bytes: tuple[int, ...]    # the caching allocator's peak (allocated + its cache and fragmentation)
    scratch_pool_bytes: int
    profiled_steps: tuple[str, ...]         # "name: tokens over seqs" of each worst step, then the sampler
    load_seconds: float
    profile_seconds: float


def probe_devices(backend: Backend) -> list[MemoryStats]:
    """Every configured device's memory as its probe sees it now (no other device is touched)."""
    return [backend.memory(i) for i in range(backend.count)]


def check_free_memory_at_start(rc: RuntimeConfig, backend: Backend, place: RankPlace | None = None
                               ) -> list[MemoryStats]:
    """Fail fast, before any weight is loaded, when a device has less free memory than total x utilization."""
    stats = probe_devices(backend)
    check_free_memory([DeviceMemory(rank_device_name(backend, i, place or RankPlace.single()), s.total_bytes,
                                    s.free_bytes, 0) for i, s in enumerate(stats)], rc.npu_memory_utilization)
    return stats


def profile_steps(runner: ModelRunner, limits: StepLimits) -> tuple[str, ...]:
    """Run every worst step on scratch pages, then the least ones (so that kernel variants picked by a step's size
    are built now, not at the first request), then the sampler at its largest batch; returns what ran.

    A shape-only runner (meta tensors) has no memory to measure and no random generator, so its sampler
    run is skipped."""
    ran = []
    for step in (*worst_steps(limits), *least_steps(limits)):
        runner.execute(runner.scratch_batch(step))
        ran.append(f"{step.name}: {step.num_tokens} tokens over {len(step.seqs)} sequences")
    if runner.device.type != "meta":
        rows = limits.max_sampled_rows
        logits = torch.zeros(rows, runner.model.layout.vocab_size, dtype=torch.float32, device=runner.device)
        Sampler(runner.device).sample(logits, worst_case_rows(rows))
        ran.append(f"sampler: {rows} rows with temperature, top-k and top-p")
    return tuple(ran)


def run_alone(name: str, fn: Callable[[], T]) -> T:
    """A startup phase of a one-process deployment: nobody to agree with."""
    return fn()


def measure(rc: RuntimeConfig, backend: Backend, runner: ModelRunner, at_start: Sequence[MemoryStats],
            phase: Phase = run_alone) -> Measurement:
    """Load weights, run the worst steps on scratch pages, and turn each device's probe into a DeviceMemory
    (with its total and free memory from `at_start`, before anything was loaded).

    The runner lives on RUNNER_DEVICE; any other device of this backend hosts a replica (a data-parallel rank
    planned alike), so a device's peak_non_kv is the larger of its own probe and the runner device's. With
    several ranks each process has one device and measures its own; `phase` runs loading and profiling as
    phases every rank agrees on (npu.ranks.RankGroup.phase).
    """
    log.info("[1/4] loading weights: %s", rc.model.weights_label)

    def load() -> float:
        t0 = time.perf_counter()
        runner.load_weights()
        backend.synchronize()
        return time.perf_counter() - t0

    load_s = phase("loading weights", load)
    log.info("weights loaded in %.2f s (%s)", load_s, rc.model.weights_label)

    runner.allocate_pools({s.name: 0 for s in rc.model.cache_groups}, rc.decode_batch)
    scratch = pool_bytes(runner)
    limits = step_limits(rc)
    log.info("[2/4] profiling the heaviest steps the scheduler can issue (budget %d tokens, %d sequences) and "
             "the sampler, to measure peak memory", limits.max_tokens, limits.max_seqs)

    def profile() -> tuple[tuple[str, ...], list[MemoryStats], float]:
        t0 = time.perf_counter()
        try:
            backend.reset_peak()
            with torch.inference_mode(), backend.tracking() as tracker:
                if tracker is not None:     # every weight is resident, also those no profiled step reads
                    tracker.adopt([*runner.pools.values(), *runner.weight_tensors()])
                ran = profile_steps(runner, limits)
                graphs = capture_graphs(rc, backend, runner)    # on scratch pages: their memory is in the peak
                if graphs:
                    ran += (f"decode graphs: {graphs}",)
                backend.synchronize()
            stats = probe_devices(backend)
        finally:
            runner.free_pools()
            gc.collect()
            backend.empty_cache()       # the profile's cached blocks go back: the pools are planned without them
        return ran, stats, time.perf_counter() - t0

    ran, stats, profile_s = phase("profiling", profile)
    ref = stats[RUNNER_DEVICE].peak_torch_bytes + stats[RUNNER_DEVICE].non_torch_bytes
    margin = non_torch_margin(rc.device, backend.kind)
    devices = []
    for i, (start, s) in enumerate(zip(at_start, stats)):
        peak = max(s.peak_torch_bytes + s.non_torch_bytes, ref) - scratch
        devices.append(DeviceMemory(rank_device_name(backend, i, runner.place), start.total_bytes, start.free_bytes,
                                    max(0, peak), margin))
    log.info("profiled %d steps in %.2f s: peak non-KV %s", len(ran), profile_s,
             ", ".join(f"{d.name} {d.peak_non_kv_bytes:,} B" for d in devices[:4]) + (" ..." if len(devices) > 4 else ""))
    return Measurement(tuple(devices), tuple(s.peak_allocated_bytes for s in stats),
                       tuple(s.non_torch_bytes for s in stats), tuple(s.peak_reserved_bytes for s in stats), scratch,
                       ran, load_s, profile_s)


def graphs_on(rc: RuntimeConfig, backend: Backend) -> bool:
    """device.graphs, or when null: on for accelerators, off on the CPU (nothing to record there)."""
    return rc.device.graphs if rc.device.graphs is not None else backend.kind in ("cuda", "npu")


def capture_graphs(rc: RuntimeConfig, backend: Backend, runner: ModelRunner) -> str | None:
    """The runner's decode graphs for batches up to decode_batch, where device.graphs is on (npu/graphs.py)."""
    if not graphs_on(rc, backend):
        return None
    return runner.capture_graphs(rc.decode_batch, backend.kind in ("cuda", "npu"), rc.max_model_len)


def memory_note(m: Measurement, backend: Backend) -> str:
    """How peak_non_kv was measured on the runner's device, each part named (the startup report's note)."""
    name = m.devices[RUNNER_DEVICE].name
    allocated, reserved = m.peak_allocated_bytes[RUNNER_DEVICE], m.peak_reserved_bytes[RUNNER_DEVICE]
    outside = m.non_torch_bytes[RUNNER_DEVICE]
    if backend.kind == "cpu":
        return (f"peak_non_kv = peak allocated - scratch pools ({m.scratch_pool_bytes:,} B); {name} measured "
                f"{allocated:,} B allocated at peak")
    context = ("its runtime context included (others' use read from the driver before it opened)"
               if getattr(backend, "context_counted", False) else
               "its runtime context not included (no NVML): non_torch_margin_bytes covers it")
    return (f"peak_non_kv = allocator peak reserved + memory outside torch - scratch pools ({m.scratch_pool_bytes:,} "
            f"B); {name} measured {allocated:,} B allocated and {reserved:,} B reserved at peak, {outside:,} B outside "
            f"torch ({context})")


def allocate(rc: RuntimeConfig, backend: Backend, runner: ModelRunner, plan: CapacityPlan,
             devices: Sequence[DeviceMemory]) -> tuple[CapacityPlan, int]:
    """Allocate the plan's pools; when that fails, free everything and re-plan from the free memory the devices
    report then (so a device that lost memory to another process shrinks in one step, not slot by slot).
    Returns (plan, retries)."""
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
            now = probe_devices(backend)
            slots = slots_that_fit(plan, devices, [s.free_bytes for s in now], [s.allocated_bytes for s in now])
            if slots < 1:
                raise InsufficientMemoryError(
                    f"allocating {plan.capacity_slots} slot(s) of KV-cache pools failed ({str(exc).splitlines()[0]}) "
                    f"and the devices now report too little free memory for one slot "
                    f"({plan.scratch_bytes + plan.bytes_per_slot:,} B with scratch): "
                    + ", ".join(f"{backend.device_name(i)} free {s.free_bytes:,} B" for i, s in enumerate(now))
                    + ". Fix: free the devices or lower npu_memory_utilization.") from exc
            retries += 1
            log.warning("allocating %d slots failed (%s); the devices now fit %d, retrying with that",
                        plan.capacity_slots, str(exc).splitlines()[0], slots)
            plan = plan_for_config(rc, devices, num_slots_override=slots)


def check_backend_fit(rc: RuntimeConfig, backend: Backend, place: RankPlace | None = None) -> None:
    """planner.check_weights_fit on the backend's devices, before any weight is materialized: each needs its rank's
    shard of the weights (estimated from model.layout as mode=plan estimates it) plus the least KV cache the planner
    accepts, within total x npu_memory_utilization."""
    place = place or RankPlace.single()
    specs = rank_cache_groups(rc.model, place)
    weights = estimate_peak_non_kv(rc.model, place, rc.plan.activation_allowance_bytes).weight_bytes_per_device
    kv_floor = least_kv_bytes(specs, rc.decode_batch)
    log.info("%s needs at least %s per device before loading: estimated weights %s (from model.layout) + "
             "scratch pages and one slot of KV cache %s", rc.model.name, format_bytes(weights + kv_floor),
             format_bytes(weights), format_bytes(kv_floor))
    shard = ("a full copy on each device" if place.world == 1 else
             f"rank {place.rank}'s shard: {place.describe()}")
    fallback = (f" (device=auto found no NPU or GPU and fell back to the host CPU with a budget of "
                f"device.cpu_memory_bytes={rc.device.cpu_memory_bytes})"
                if rc.device.kind == "auto" and backend.kind == "cpu" else "")
    devices = [(rank_device_name(backend, i, place), backend.memory(i).total_bytes) for i in range(backend.count)]
    check_weights_fit(devices, weights, specs, model_name=rc.model.name, utilization=rc.npu_memory_utilization,
                      decode_batch=rc.decode_batch, max_model_len=rc.max_model_len, shard=shard, fallback=fallback)


def rank_device_name(backend: Backend, index: int, place: RankPlace) -> str:
    """`npu:3`, or `npu:3 (rank 11)` when there are several ranks: reports and errors say which rank it is."""
    name = backend.device_name(index)
    return name if place.world == 1 else f"{name} (rank {place.rank})"


def open_backend(rc: RuntimeConfig, place: RankPlace | None = None, local_index: int = 0) -> Backend:
    """The backend for rc.device (device=auto says which it chose and why), checked to hold the weights.

    With several ranks each process opens only its own device, `local_index` on this host."""
    place = place or RankPlace.single()
    device = rc.device if place.world == 1 else dataclasses.replace(rc.device, count=1)
    backend = select_backend(device, local_index, ranks_on_host=place.world)
    check_backend_fit(rc, backend, place)
    return backend


def prepare_rank(rc: RuntimeConfig, place: RankPlace | None = None, local_index: int = 0
                 ) -> tuple[Backend, ModelRunner]:
    """The device plane's checks before anything is loaded, for one rank: its backend (whose device can hold its
    shard: check_backend_fit), the runner of its shard without weights, and the checkpoint's tensor names and
    shapes against what the runner expects (headers only)."""
    place = place or RankPlace.single()
    backend = open_backend(rc, place, local_index)
    runner = build_runner(rc.model, backend.torch_device(RUNNER_DEVICE), place)
    if rc.model.weights != "random":
        check_checkpoint_tensors(rc.model.weights, runner.expected_weights())
    return backend, runner


def launch(rc: RuntimeConfig, backend: Backend | None = None, runner: ModelRunner | None = None,
           group: RankGroup | None = None) -> tuple[ModelRunner, StartupReport]:
    """The startup sequence; InsufficientMemoryError (naming the device) propagates before any pool exists.

    A backend passed in has been opened by the caller (open_backend, or a fake one for tests). With several
    ranks, every rank runs this with its `group`: each loads its shard, profiles its own worst steps and
    probes its own device; one collective gives every rank every rank's memory, so all of them plan from the
    same numbers (the minimum budget wins) and allocate the same blocks per group.
    """
    place = group.place if group is not None else RankPlace.single()
    phase: Phase = group.phase if group is not None else run_alone
    backend = backend or open_backend(rc, place)
    backend.set_device(RUNNER_DEVICE)
    at_start = phase("free memory check", lambda: check_free_memory_at_start(rc, backend, place))
    runner = runner or build_runner(rc.model, backend.torch_device(RUNNER_DEVICE), place)
    if group is not None:
        runner.use_collectives(group.tensor, group.expert)
    log.info("starting %s (%s) on %d x %s%s", rc.model.name, rc.model.arch, backend.count, backend.kind,
             "" if group is None else f" as {place.describe()}")
    m = measure(rc, backend, runner, at_start, phase)
    devices = m.devices if group is None else tuple(
        d for rank_devices in group.all_gather("planning", m.devices) for d in rank_devices)
    log.info("[3/4] planning the KV cache from %d device(s)' measured memory", len(devices))
    plan = plan_for_config(rc, devices)
    log.info("[4/4] allocating %d slots (%s of KV cache per device)", plan.capacity_slots,
             human_bytes(plan.kv_cache_bytes))
    t0 = time.perf_counter()
    plan, retries = phase("allocating", lambda: allocate(rc, backend, runner, plan, devices))
    if group is not None:
        slots = group.all_gather("allocating", plan.capacity_slots)
        if len(set(slots)) > 1:                # a rank had to shrink: every rank re-allocates the fewest slots
            log.warning("ranks allocated %s slots; every rank re-allocates %d", slots, min(slots))
            plan = plan_for_config(rc, devices, num_slots_override=min(slots))
            plan, _ = phase("re-allocating", lambda: allocate(rc, backend, runner, plan, devices))
            retries += 1
    graphs = phase("capturing graphs", lambda: capture_graphs(rc, backend, runner))
    alloc_s = time.perf_counter() - t0
    if backend.kind != "cpu" and watch_compiles():
        log.info("kernels built for every step size; a Triton kernel built from now on is logged as a warning")
    notes = [
        "profiled on scratch pages: " + "; ".join(m.profiled_steps),
        memory_note(m, backend),
    ]
    if group is not None:
        notes.append(f"{place.world} ranks (tensor {place.tensor} x data {place.data}, expert {place.expert}): each "
                     f"loaded its shard, profiled its own steps and probed its own device; every rank allocated "
                     f"the blocks of the limiting device {plan.limiting_device}")
    elif backend.count > 1:
        notes.append(f"the runner was profiled on {backend.device_name(RUNNER_DEVICE)}; each device is planned with "
                     "at least that peak (identical data-parallel replicas)")
    if graphs:
        notes.append(graphs)
    if retries:
        notes.append(f"pool allocation failed {retries} time(s); re-planned from the free memory the devices "
                     f"reported, down to {plan.capacity_slots} slot(s)")
    log.info("allocated %d slots (%s) in %.2f s", plan.capacity_slots,
             ", ".join(f"{g.name}={g.num_blocks}" for g in plan.groups), alloc_s)
    report = StartupReport(
        model_name=rc.model.name, arch=rc.model.arch, device_kind=backend.kind, device_count=len(devices),
        plan=plan, resolved_config_yaml=rc.resolved_yaml, weights=rc.model.weights_label,
        load_seconds=m.load_seconds, profile_seconds=m.profile_seconds, allocate_seconds=alloc_s,
        allocation_retries=retries, notes=tuple(notes))
    return runner, report
