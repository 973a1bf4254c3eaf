"""StartupReport: what the engine resolved and allocated at startup (the gRPC Startup response's source)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from appliance.core.planner import CapacityPlan


@dataclass(frozen=True)
class StartupReport:
    model_name: str
    arch: str
    device_kind: str               # npu | cuda | cpu (what device=auto chose)
    device_count: int
    plan: CapacityPlan             # per-device memory, scratch, bytes_per_slot, capacity_slots, per-group blocks
    resolved_config_yaml: str
    weights: str                   # "random (seed N)" or the checkpoint path
    load_seconds: float = 0.0
    profile_seconds: float = 0.0
    allocate_seconds: float = 0.0
    allocation_retries: int = 0    # slots given back because allocation failed
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def num_blocks(self) -> dict[str, int]:
        return self.plan.num_blocks

    @property
    def capacity_slots(self) -> int:
        return self.plan.capacity_slots

    def to_dict(self) -> dict:
        return asdict(self)
