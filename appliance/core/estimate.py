"""Offline estimate of peak non-KV memory per device, for `mode=plan` without hardware.

weights: the checkpoint's bytes from the layout (for deepseek_v4 from its parameter description, the same one
the runner loads: replicated weights on every device, routed experts divided over them), plus a stated
activation allowance (plan.activation_allowance_bytes).
It is an estimate: give plan.peak_non_kv_bytes to plan with a measured figure instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.core.archs import architecture
from appliance.core.config import ModelSpec, RuntimeConfig
from appliance.core.errors import ConfigError, ConfigIssue
from appliance.core.kv_cache_spec import DTYPE_BYTES
from appliance.core.planner import DeviceMemory, non_torch_margin


@dataclass(frozen=True)
class PeakEstimate:
    weight_bytes_total: int
    weight_bytes_per_device: int
    activation_allowance_bytes: int

    @property
    def peak_non_kv_bytes(self) -> int:
        return self.weight_bytes_per_device + self.activation_allowance_bytes


def weight_bytes_per_device(model: ModelSpec, num_devices: int) -> tuple[int, int]:
    """(total, per device) checkpoint bytes. An architecture that describes its parameters (deepseek_v4) is
    counted from that description: every device holds the replicated weights (data-parallel attention) and
    1 / num_devices of the routed experts (expert parallel). Otherwise (qwen3) everything is sharded evenly
    (tensor parallel)."""
    describe = architecture(model.arch).parameters
    if describe is not None:
        counts = describe(model.layout)
        return counts.total_bytes, counts.replicated_bytes + -(-counts.expert_bytes // num_devices)
    lay = model.layout
    dense = DTYPE_BYTES[lay.dtype]
    h, heads, hd = lay.hidden_size, lay.num_heads, lay.head_dim
    embed = lay.vocab_size * h * (1 if lay.tie_word_embeddings else 2)
    attn = h * heads * hd + 2 * h * lay.num_kv_heads * hd + heads * hd * h
    total = (embed + lay.num_layers * (attn + 3 * h * lay.intermediate_size)) * dense
    return total, -(-total // num_devices)


def estimate_peak_non_kv(model: ModelSpec, num_devices: int, activation_allowance_bytes: int) -> PeakEstimate:
    total, per_device = weight_bytes_per_device(model, num_devices)
    return PeakEstimate(total, per_device, activation_allowance_bytes)


def offline_devices(rc: RuntimeConfig) -> list[DeviceMemory]:
    """The planner's devices for mode=plan: the profile's memory per device (all of it free), an estimated (or
    given) peak, and the same non-torch margin the runtime keeps on a device of that kind."""
    dev = rc.device
    if dev.memory_bytes_per_device is None:
        raise ConfigError([ConfigIssue(
            "device.memory_bytes_per_device", None,
            "mode=plan needs memory per device: pick a planning profile (device=ascend_a2, device=ascend_a3) "
            "or set device.memory_bytes_per_device")])
    count = dev.count or 1
    if rc.plan.peak_non_kv_bytes is not None:
        peak = rc.plan.peak_non_kv_bytes
    else:
        peak = estimate_peak_non_kv(rc.model, count, rc.plan.activation_allowance_bytes).peak_non_kv_bytes
    prefix = "cpu" if dev.kind in ("cpu", "auto") else dev.kind
    total = dev.memory_bytes_per_device
    margin = non_torch_margin(dev, prefix)
    return [DeviceMemory(f"{prefix}:{i}", total, total, peak, margin) for i in range(count)]
