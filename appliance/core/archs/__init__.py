"""The architecture registry: per `model.arch`, its rules and the parallelism it supports.

Torch-free, so the composer runs every architecture rule at `mode=validate` (exit 2 naming the key path)
before any device work. The runner of each arch is the device plane's table (npu/registry.py).

    arch          parallelism
    qwen3         tensor, data
    deepseek_v4   data, expert
"""

from __future__ import annotations

from typing import Any

from appliance.core.archs.architecture import Architecture
from appliance.core.archs.deepseek_v4 import cache_groups as dsv4_groups
from appliance.core.archs.deepseek_v4 import config_json as dsv4_config
from appliance.core.archs.deepseek_v4 import prefix_ties as dsv4_ties
from appliance.core.archs.deepseek_v4 import rules as dsv4_rules
from appliance.core.archs.deepseek_v4 import weights as dsv4_weights
from appliance.core.archs.deepseek_v4.layout import DeepseekV4Layout
from appliance.core.archs.qwen3 import config_json as qwen3_config
from appliance.core.archs.qwen3 import rules as qwen3_rules
from appliance.core.archs.qwen3 import tensor_parallel as qwen3_tp
from appliance.core.archs.qwen3.layout import Qwen3Layout
from appliance.core.config import ModelSpec, ParallelSettings
from appliance.core.errors import ConfigError, ConfigIssue
from appliance.core.kv_cache_spec import CacheGroupSpec
from appliance.core.parallel import RankPlace, resolve_parallel

QWEN3: Architecture[Qwen3Layout] = Architecture(
    name="qwen3", layout=Qwen3Layout, parallelism=frozenset({"tensor", "data"}),
    validate=qwen3_rules.validate, layout_rules=qwen3_rules.layout_rules, parallel_rules=qwen3_rules.parallel_issues,
    rank_weight_bytes=qwen3_tp.rank_weight_bytes, rank_cache_groups=qwen3_tp.rank_cache_groups,
    config_keys=qwen3_config.CONFIG_KEYS, hf_architectures=qwen3_config.HF_ARCHITECTURES,
    hf_model_types=qwen3_config.HF_MODEL_TYPES, hf_value_kinds=qwen3_config.HF_VALUE_KINDS,
    layout_from_hf_config=qwen3_config.layout_from_hf_config, cache_groups_for=qwen3_config.cache_groups_for)

DEEPSEEK_V4: Architecture[DeepseekV4Layout] = Architecture(
    name="deepseek_v4", layout=DeepseekV4Layout, parallelism=frozenset({"data", "expert"}),
    validate=dsv4_rules.validate, layout_rules=dsv4_rules.layout_rules,
    rank_weight_bytes=dsv4_weights.rank_weight_bytes, parameters=dsv4_weights.parameter_counts,
    config_keys=dsv4_config.CONFIG_KEYS, config_view=dsv4_config.config_view, config_fixed=dsv4_config.CONFIG_FIXED,
    hf_architectures=dsv4_config.HF_ARCHITECTURES, hf_model_types=dsv4_config.HF_MODEL_TYPES,
    hf_value_kinds=dsv4_config.HF_VALUE_KINDS, layout_from_hf_config=dsv4_config.layout_from_hf_config,
    cache_groups_for=dsv4_groups.cache_groups_for, length_dependent_kv=dsv4_ties.length_dependent_kv)

ARCHITECTURES: dict[str, Architecture[Any]] = {a.name: a for a in (QWEN3, DEEPSEEK_V4)}
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
