"""One architecture's entry in the registry (appliance.core.archs): its layout type, rules, parallelism, how its
checkpoint's config.json reads, and what one rank holds. Built by keyword: a field added later cannot shift others."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic

from appliance.core.archs.hf_config import HfLayout
from appliance.core.archs.parameter_counts import ParameterCounts
from appliance.core.config import L, Layout, ModelSpec, ParallelSettings
from appliance.core.errors import ConfigIssue
from appliance.core.kv_cache_spec import CacheGroupSpec
from appliance.core.parallel import RankPlace
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


@dataclass(frozen=True, kw_only=True)
class Architecture(Generic[L]):
    name: str
    # The architecture's own frozen layout type (model.layout), and its rules the cache groups derive from
    # (checked before they are derived; `validate` runs after).
    layout: type[L]
    layout_rules: Callable[[L], list[ConfigIssue]] = _no_layout_rules
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
    parameters: Callable[[L], ParameterCounts] | None = None
    # Serving a checkpoint directory (+model=hf): its config.json "architectures" names, the layout it gives,
    # and the cache groups a finished layout needs (model-YAML shaped dicts).
    hf_architectures: tuple[str, ...] = ()
    hf_model_types: tuple[str, ...] = ()
    hf_value_kinds: dict[str, Any] = field(default_factory=dict)   # config.json keys read besides config_keys
    layout_from_hf_config: Callable[[dict[str, Any]], HfLayout] | None = None
    cache_groups_for: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = None
    # Where a cached page stops depending on the prompt's tokens alone (core/prefix_reuse.py); None: nowhere.
    length_dependent_kv: Callable[[L], LengthDependentKv | None] = _tokens_alone
