"""`+model=hf model.weights=DIR`: a model filled from its checkpoint's config.json before validation.

Why in the composer: the filled model then passes every rule a hand-written model YAML passes (layout,
derived cache groups, the architecture's validator) at `mode=validate`, before any device work. Which
config.json keys give which layout keys, and which cache groups an architecture needs, is the architecture's
(appliance/core/archs, `layout_from_hf_config` and `cache_groups_for`); here is only the merge: keys whose
value is still the `${config_json:}` placeholder of conf/model/hf.yaml are filled, a value given instead that
disagrees with config.json is an error naming both, and serving defaults fill what config.json does not say.

Why a placeholder rather than `???`: OmegaConf never lets `???` override a schema default, so a layout key
with a default (rope_theta, dtype, ...) could not tell "not given" from "given the default value".
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, Node, OmegaConf

from appliance.config import schema
from appliance.config.plain import plain_dict
from appliance.core import bounded_json
from appliance.core.archs import architecture_for_hf, hf_config
from appliance.core.archs.hf_config import HfConfigError, values_agree
from appliance.core.errors import ConfigIssue
from appliance.core.kv_cache_spec import CacheGroupSettings


def _unset(node: DictConfig, key: str) -> bool:
    """Still the placeholder (or ???): the composer fills it."""
    if OmegaConf.is_missing(node, key):
        return True
    child = node._get_node(key)
    return (OmegaConf.is_interpolation(node, key) and isinstance(child, Node)
            and child._value() == schema.CONFIG_JSON_PLACEHOLDER)


def fill_from_checkpoint(model: DictConfig) -> list[ConfigIssue]:
    """Fill `model` in place from <model.weights>/config.json; the issues found (nothing is filled past one)."""
    if OmegaConf.is_missing(model, "weights") or model.weights == "random":
        return [ConfigIssue("model.weights", None if OmegaConf.is_missing(model, "weights") else model.weights,
                            "+model=hf serves a checkpoint directory: give model.weights=DIR (with config.json)")]
    path = Path(model.weights) / "config.json"
    if not path.is_file():
        return [ConfigIssue("model.weights", model.weights, f"{path} does not exist: model.weights must be a "
                                                            f"checkpoint directory with config.json")]
    try:
        cfg = hf_config.config_object(bounded_json.loads(path.read_text()))
        hf_config.check_kind("architectures", cfg.get("architectures"), list[str] | None)
        arch = architecture_for_hf(cfg.get("architectures") or [])
        read_layout, groups_for = arch.layout_from_hf_config, arch.cache_groups_for
        if read_layout is None or groups_for is None:
            raise HfConfigError("architectures", f"arch {arch.name} is not served from a checkpoint directory")
        hf_config.check_value_kinds(cfg, arch.config_keys, arch.hf_value_kinds, arch.layout)
        if hf_config.identity_issue(cfg, arch.hf_architectures, arch.hf_model_types):
            raise HfConfigError("model_type", f"{json.dumps(cfg['model_type'])} disagrees with architectures="
                                              f"{cfg['architectures']} (model_type of {arch.name}: "
                                              f"{' or '.join(arch.hf_model_types)})")
        hf = read_layout(cfg)
        hf_config.check_layout_kinds(hf, arch.layout)
    except (OSError, UnicodeDecodeError) as exc:
        return [ConfigIssue("model.weights", model.weights, f"{path} is not readable: {exc}")]
    except json.JSONDecodeError as exc:
        return [ConfigIssue("model.weights", model.weights, f"{path} is not valid JSON: {exc}")]
    except KeyError as exc:
        return [ConfigIssue("model.weights", model.weights, f"{path}: {exc.args[0]}")]
    except HfConfigError as exc:
        return [ConfigIssue("model.weights", model.weights, f"{path}: {exc}")]

    issues = []
    if _unset(model, "arch"):
        model.arch = arch.name
    elif model.arch != arch.name:
        issues.append(ConfigIssue("model.arch", model.arch, f"disagrees with {path}: architectures="
                                                            f"{cfg.get('architectures')} (arch {arch.name})"))
    if _unset(model, "name"):
        model.name = Path(model.weights).resolve().name
    lay = model.layout
    for key, (file_key, value) in hf.from_file.items():
        if _unset(lay, key):
            lay[key] = value
        elif not values_agree(lay[key], value):
            given = OmegaConf.to_container(lay[key]) if OmegaConf.is_list(lay[key]) else lay[key]
            issues.append(ConfigIssue(f"model.layout.{key}", given, f"disagrees with {path}: {file_key}={value!r}"))
    for key, value in hf.defaults.items():
        if _unset(lay, key):
            lay[key] = value
    schema_defaults = OmegaConf.structured(schema.layout_schema())
    for key in lay:
        if _unset(lay, key):        # neither config.json nor a serving default: ??? (the arch layout's default)
            lay[key] = schema_defaults._get_node(key)._value()
    if issues:
        return issues
    if not model.cache_groups:
        try:
            groups = groups_for(plain_dict(lay, resolve=False))
            model.cache_groups = [OmegaConf.merge(OmegaConf.structured(schema.schema_class(CacheGroupSettings)), g) for g in groups]
        except HfConfigError as exc:
            return [ConfigIssue("model.weights", model.weights, f"{path}: {exc}")]
    return []
