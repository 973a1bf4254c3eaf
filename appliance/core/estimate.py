"""Offline estimate of peak non-KV memory per rank, for `mode=plan` without hardware.

weights: the checkpoint bytes each rank loads, from the architecture's own description of its shard
(appliance.core.archs: deepseek_v4 holds its replicated weights and 1 / expert_parallel_size of the routed
experts; qwen3 holds 1 / tensor_parallel_size of every layer and of the head, the embedding and norms whole),
the same description the runner loads from; plus a stated activation allowance (plan.activation_allowance_bytes).
It is an estimate: give plan.peak_non_kv_bytes to plan with a measured figure instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.core.archs import architecture
from appliance.core.config import ModelSpec, RuntimeConfig
from appliance.core.errors import ConfigError, ConfigIssue
from appliance.core.parallel import RankPlace, rank_places
from appliance.core.planner import DeviceMemory, non_torch_margin


@dataclass(frozen=True)
class PeakEstimate:
    weight_bytes_total: int          # the whole checkpoint
    weight_bytes_per_device: int     # what the rank's device holds: its shard
    activation_allowance_bytes: int

    @property
    def peak_non_kv_bytes(self) -> int:
        return self.weight_bytes_per_device + self.activation_allowance_bytes


def rank_weight_bytes(model: ModelSpec, place: RankPlace) -> int:
    """Checkpoint bytes the rank at `place` loads (RankPlace.single(): the whole checkpoint)."""
    return architecture(model.arch).rank_weight_bytes(model.layout, place)


def estimate_peak_non_kv(model: ModelSpec, place: RankPlace, activation_allowance_bytes: int) -> PeakEstimate:
    return PeakEstimate(rank_weight_bytes(model, RankPlace.single()), rank_weight_bytes(model, place),
                        activation_allowance_bytes)


def offline_devices(rc: RuntimeConfig) -> list[DeviceMemory]:
    """The planner's devices for mode=plan, one per rank: the profile's memory per device (all of it free), an
    estimated (or given) peak of that rank's shard, and the same non-torch margin the runtime keeps on a device
    of that kind."""
    dev = rc.device
    if dev.memory_bytes_per_device is None:
        raise ConfigError([ConfigIssue(
            "device.memory_bytes_per_device", None,
            "mode=plan needs memory per device: pick a planning profile (device=ascend_a2, device=ascend_a3) "
            "or set device.memory_bytes_per_device")])
    prefix = "cpu" if dev.kind in ("cpu", "auto") else dev.kind
    total = dev.memory_bytes_per_device
    margin = non_torch_margin(dev, prefix)
    devices = []
    for place in rank_places(rc.parallel):
        peak = rc.plan.peak_non_kv_bytes
        if peak is None:
            peak = estimate_peak_non_kv(rc.model, place, rc.plan.activation_allowance_bytes).peak_non_kv_bytes
        devices.append(DeviceMemory(f"{prefix}:{place.rank}", total, total, peak, margin))
    return devices
