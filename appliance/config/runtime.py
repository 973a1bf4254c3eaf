"""The frozen, typed runtime config the rest of the appliance reads (never the DictConfig)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from appliance.config import schema
from appliance.kv_cache_spec import CacheGroupSpec


def _frozen_twin(schema_cls: type, name: str) -> type:
    """A frozen dataclass with the same fields as a (mutable) schema dataclass; lists become tuples."""
    fields = [(f.name, f.type, dataclasses.field(default=None)) for f in dataclasses.fields(schema_cls)]
    twin = dataclasses.make_dataclass(name, fields, frozen=True)
    twin.__module__ = __name__
    return twin


Layout = _frozen_twin(schema.LayoutConfig, "Layout")
DeviceSettings = _frozen_twin(schema.DeviceConfig, "DeviceSettings")
ServerSettings = _frozen_twin(schema.ServerConfig, "ServerSettings")
KvCacheSettings = _frozen_twin(schema.KvCacheConfig, "KvCacheSettings")
PlanSettings = _frozen_twin(schema.PlanConfig, "PlanSettings")
BenchSettings = _frozen_twin(schema.BenchConfig, "BenchSettings")


def freeze(twin: type, values: dict[str, Any]) -> Any:
    return twin(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str
    layout: Any                      # Layout
    cache_groups: tuple[CacheGroupSpec, ...]
    weights: str
    tokenizer: str | None
    weights_seed: int

    @property
    def main_layer_ratios(self) -> tuple[int, ...]:
        """Compress ratio of each main (non-MTP) layer; plain attention layouts have none."""
        ratios = self.layout.compress_ratios or ()
        return tuple(ratios[: self.layout.num_layers])

    def group(self, name: str) -> CacheGroupSpec:
        for spec in self.cache_groups:
            if spec.name == name:
                return spec
        raise KeyError(f"model {self.name!r} has no cache group {name!r}")


@dataclass(frozen=True)
class RuntimeConfig:
    mode: str
    model: ModelSpec
    device: Any                      # DeviceSettings
    server: Any                      # ServerSettings
    kv_cache: Any                    # KvCacheSettings
    plan: Any                        # PlanSettings
    bench: Any                       # BenchSettings
    npu_memory_utilization: float
    decode_batch: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting_requests: int
    enable_prefix_caching: bool
    seed: int
    resolved_yaml: str               # the composed config, as YAML, for reports

    @property
    def block_size(self) -> int:
        return self.model.layout.block_size
