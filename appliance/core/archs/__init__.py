"""The architecture registry: per `model.arch`, its rules and the parallelism it supports.

Torch-free, so the composer runs every architecture rule at `mode=validate` (exit 2 naming the key path)
before any device work. The runner of each arch is the device plane's table (npu/registry.py).

    arch          parallelism
    qwen3         tensor, data
    deepseek_v4   data, expert
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic

from appliance.core.archs import deepseek_v4, deepseek_v4_weights, qwen3
from appliance.core.archs.hf_config import HfLayout
from appliance.core.config import L, Layout, ModelSpec, ParallelSettings
from appliance.core.errors import ConfigError, ConfigIssue
from appliance.core.kv_cache_spec import CacheGroupSpec
from appliance.core.parallel import RankPlace, resolve_parallel
from appliance.core.prefix_reuse import LengthDependentKv


def _flat(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(cfg)


def _same_groups(model: ModelSpec[Any], place: RankPlace) -> tuple[CacheGroupSpec, ...]:
    return model.cache_groups


def _no_rules(layout: Layout, parallel: ParallelSettings) -> list[ConfigIssue]:
    return []


def _no_layout_rules(layout: Layout) -> list[ConfigIssue]:
    return []


def _tokens_alone(layout: Layout) -> LengthDependentKv | None:
    return None


@dataclass(frozen=True)
class Architecture(Generic[L]):
    name: str
    validate: Callable[[ModelSpec[L]], list[ConfigIssue]]  # layout and cache-group rules, with key paths
    parallelism: frozenset[str]                            # among "tensor", "data", "expert"
    config_keys: dict[str, str]                            # checkpoint config.json key -> layout key
    # Ranks: the checkpoint bytes one rank loads (its shard; the runner loads exactly these tensors), the cache
    # groups as one rank stores them (tensor parallel keeps only its kv heads), and what the sizes must divide.
    rank_weight_bytes: Callable[[L, RankPlace], int]
    rank_cache_groups: Callable[[ModelSpec[L], RankPlace], tuple[CacheGroupSpec, ...]] = _same_groups
    parallel_rules: Callable[[L, ParallelSettings], list[ConfigIssue]] = _no_rules
    config_view: Callable[[dict[str, Any]], dict[str, Any]] = _flat   # config.json -> the keys config_keys names
    config_fixed: dict[str, Any] = field(default_factory=dict)        # config.json keys with one supported value
    # The parameters as released (names, shapes, stored formats), when the arch describes them torch-free:
    # the runner's expected weights, the plan's weight estimate and mode=validate's counts all read it.
    parameters: Callable[[L], deepseek_v4_weights.ParameterCounts] | None = None
    # Serving a checkpoint directory (+model=hf): its config.json "architectures" names, the layout it gives,
    # and the cache groups a finished layout needs (model-YAML shaped dicts).
    hf_architectures: tuple[str, ...] = ()
    hf_model_types: tuple[str, ...] = ()
    hf_value_kinds: dict[str, Any] = field(default_factory=dict)   # config.json keys read besides config_keys
    layout_from_hf_config: Callable[[dict[str, Any]], HfLayout] | None = None
    cache_groups_for: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = None
    # The architecture's own frozen layout type (model.layout), and its rules the cache groups derive from
    # (checked before they are derived; `validate` runs after).
    layout: type[L] = field(kw_only=True)
    layout_rules: Callable[[L], list[ConfigIssue]] = field(default=_no_layout_rules, kw_only=True)
    # Where a cached page stops depending on the prompt's tokens alone (core/prefix_reuse.py); None: nowhere.
    length_dependent_kv: Callable[[L], LengthDependentKv | None] = field(default=_tokens_alone, kw_only=True)


ARCHITECTURES: dict[str, Architecture[Any]] = {a.name: a for a in (
    Architecture("qwen3", qwen3.validate, frozenset({"tensor", "data"}), qwen3.CONFIG_KEYS,
                 qwen3.rank_weight_bytes, qwen3.rank_cache_groups, qwen3.parallel_issues, hf_architectures=qwen3.HF_ARCHITECTURES, hf_model_types=qwen3.HF_MODEL_TYPES,
                 hf_value_kinds=qwen3.HF_VALUE_KINDS, layout_from_hf_config=qwen3.layout_from_hf_config,
                 cache_groups_for=qwen3.cache_groups_for, layout=qwen3.Qwen3Layout,
                 layout_rules=qwen3.layout_rules),
    Architecture("deepseek_v4", deepseek_v4.validate,
                 frozenset({"data", "expert"}), deepseek_v4.CONFIG_KEYS, deepseek_v4_weights.rank_weight_bytes,
                 config_view=deepseek_v4.config_view, config_fixed=deepseek_v4.CONFIG_FIXED,
                 parameters=deepseek_v4_weights.parameter_counts,
                 hf_architectures=deepseek_v4.HF_ARCHITECTURES, hf_model_types=deepseek_v4.HF_MODEL_TYPES,
                 hf_value_kinds=deepseek_v4.HF_VALUE_KINDS,
                 layout_from_hf_config=deepseek_v4.layout_from_hf_config,
                 cache_groups_for=deepseek_v4.cache_groups_for,
                 layout=deepseek_v4.DeepseekV4Layout, layout_rules=deepseek_v4.layout_rules,
                 length_dependent_kv=deepseek_v4.length_dependent_kv),
)}
HF_ARCHITECTURES: dict[str, Architecture[Any]] = {hf: a for a in ARCHITECTURES.values() for hf in a.hf_architectures}


def architecture(name: str) -> Architecture[Any]:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ConfigError([ConfigIssue("model.arch", name, f"must be one of {sorted(ARCHITECTURES)}")]) from None


def architecture_for_hf(names: list[str]) -> Architecture[Any]:
    """The architecture serving a config.json whose "architectures" are `names`; KeyError lists the supported."""
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    raise KeyError(f"architectures {names} is not supported; supported: {sorted(HF_ARCHITECTURES)}")


def resolve_model_parallel(model: ModelSpec[Any], parallel: ParallelSettings, device_count: int | None
                           ) -> tuple[ParallelSettings, list[ConfigIssue]]:
    """The parallel sizes resolved for this model (appliance.core.parallel) and every rule they break, the
    architecture's own included."""
    arch = architecture(model.arch)
    resolved, issues = resolve_parallel(parallel, device_count, arch.parallelism, model.layout.num_routed_experts,
                                       arch.name)
    return resolved, issues or arch.parallel_rules(model.layout, resolved)


def rank_cache_groups(model: ModelSpec[Any], place: RankPlace) -> tuple[CacheGroupSpec, ...]:
    """The cache groups as the rank at `place` stores them (the planner sizes these; its pools hold them)."""
    return architecture(model.arch).rank_cache_groups(model, place)


def check_model(model: ModelSpec[Any]) -> None:
    """Raise ConfigError with every rule the model breaks for its architecture."""
    issues = architecture(model.arch).validate(model)
    if issues:
        raise ConfigError(issues)
