"""Offline estimate of peak non-KV memory per device, for `mode=plan` without hardware.

weights: parameter counts from the layout times their dtypes, sharded evenly over the devices
(expert + tensor parallel); plus a stated activation allowance (plan.activation_allowance_bytes).
It is an estimate: give plan.peak_non_kv_bytes to plan with a measured figure instead.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def weight_bytes(model: ModelSpec) -> int:
    lay = model.layout
    dense = DTYPE_BYTES[lay.dtype]
    h, heads, hd = lay.hidden_size, lay.num_heads, lay.head_dim
    layers = lay.num_layers + lay.num_mtp_layers
    embed = lay.vocab_size * h * (1 if lay.tie_word_embeddings else 2)
    if model.arch == "deepseek_v4":
        q = h * lay.q_lora_rank + lay.q_lora_rank * heads * hd if lay.q_lora_rank else h * heads * hd
        attn = q + h * hd + heads * hd * h            # q, shared latent kv, output
        attn += h * (lay.index_num_heads or 0) * (lay.index_head_dim or 0)   # indexer queries
    else:
        attn = h * heads * hd + 2 * h * lay.num_kv_heads * hd + heads * hd * h
    if lay.num_experts:
        inter = lay.moe_intermediate_size or lay.intermediate_size
        expert_bytes = DTYPE_BYTES[lay.expert_dtype or lay.dtype]
        experts = lay.num_experts * 3 * h * inter * expert_bytes
        shared = lay.num_shared_experts * 3 * h * inter * dense + h * lay.num_experts * dense
        mlp_bytes = experts + shared
    else:
        mlp_bytes = 3 * h * lay.intermediate_size * dense
    return embed * dense + layers * (attn * dense + mlp_bytes)


def estimate_peak_non_kv(model: ModelSpec, num_devices: int, activation_allowance_bytes: int) -> PeakEstimate:
    total = weight_bytes(model)
    return PeakEstimate(total, -(-total // num_devices), activation_allowance_bytes)


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
