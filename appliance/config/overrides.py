"""Command-line overrides checked before Hydra composes: every key one the schema defines (the closest one named
for a typo), every group choice a file of conf/<group>/ with `+` exactly where Hydra needs it, and no model.* key
without a model selected. Hydra would refuse each of these too, with its search path or an OmegaConf traceback.
"""

from __future__ import annotations

import difflib
import functools
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from appliance.config.schema_keys import schema_key_issue
from appliance.core.config import RuntimeConfig
from appliance.core.errors import ConfigError, ConfigIssue

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def config_groups() -> set[str]:
    """The config groups of conf/ (model, device, server, sweep): `group=option` selects a file, not a key."""
    return {p.name for p in CONF_DIR.iterdir() if p.is_dir()}


def check_override_keys(overrides: list[str], runtime_type: type = RuntimeConfig) -> None:
    """Every override's key must be one the schema defines, before Hydra composes (ConfigError naming the
    closest valid key); a group choice must name a file of conf/<group>/, with `+` exactly for the groups that are
    not in the defaults list (+model=, +sweep=); a model.* key needs a +model= on the same line.

    Hydra's own settings (hydra.*, hydra/...) and overrides Hydra cannot parse are left to Hydra.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return                                   # Hydra reports a malformed override itself
    groups = config_groups()
    chosen = {o.key_or_group for o in parsed if o.key_or_group in groups and not o.is_delete()}
    issues = []
    for o in parsed:
        key = o.key_or_group
        if o.is_hydra_override() or o.package is not None or "/" in key:
            continue
        if key in groups:
            issues += group_choice_issues(o)
            continue
        if key.partition(".")[0] == "model" and "model" not in chosen:
            issues.append(model_key_without_model_issue(o, parsed))
            continue
        value = (o.input_line or "").partition("=")[2] if o.is_sweep_override() else o.value()
        issue = schema_key_issue(key, value, runtime_type)
        if issue is None and o.is_add():
            issue = ConfigIssue(f"+{key}", value, f"'+' adds a key, and {key} already exists: write {key}={value} "
                                                  f"('+' is only for the groups +model= and +sweep=)")
        if issue is not None:
            issues.append(issue)
    if issues:
        raise ConfigError(issues)


@functools.cache
def defaults_list_groups() -> frozenset[str]:
    """The groups conf/config.yaml's defaults list selects (device, server): chosen as group=option, no '+'."""
    entries = OmegaConf.load(CONF_DIR / "config.yaml").defaults
    return frozenset(str(k) for e in entries if isinstance(e, DictConfig) for k in e if " " not in str(k))


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def group_choice_issues(o: Any) -> list[ConfigIssue]:
    """A group override that Hydra would refuse with its search path: an option with no YAML file (the closest
    one suggested), '+' on a group of the defaults list, or no '+' on a group outside it (model, sweep)."""
    group = o.key_or_group
    if o.is_delete():
        return []
    plus = "++" if o.is_force_add() else "+" if o.is_add() else ""
    values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
    in_defaults = group in defaults_list_groups()
    if plus == "+" and in_defaults:
        return [ConfigIssue(f"+{group}", values[0], f"'+' only selects the groups outside the defaults list "
                                                    f"(+model=, +sweep=): write {group}={values[0]}")]
    if not plus and not in_defaults:
        return [ConfigIssue(group, values[0], f"the {group} group is not in the defaults list: select it with a "
                                              f"leading '+', +{group}={values[0]}")]
    options = group_options(group)
    issues = []
    for value in values:
        if str(value) not in options:
            close = difflib.get_close_matches(str(value), options, n=1)
            hint = f"did you mean {plus}{group}={close[0]}? " if close else ""
            issues.append(ConfigIssue(f"{plus}{group}", value, f"no such {group} (conf/{group}/{value}.yaml); "
                                                               f"{hint}the {group} options are: {', '.join(options)}"))
    return issues


def model_key_without_model_issue(o: Any, parsed: list[Any]) -> ConfigIssue:
    """A model.* key given with no +model=: the embedded default is loaded only after the command line, so there is
    no model to set it on yet (Hydra would fail with an OmegaConf traceback); say which selection the key needs."""
    line = (o.input_line or "").lstrip("+")
    default = next((str(p.value()) for p in parsed if p.key_or_group == "default_model"), None) \
        or OmegaConf.load(CONF_DIR / "config.yaml").default_model
    fix = f"+model={default} {line} (the embedded default)"
    if o.key_or_group == "model.weights":
        fix = (f"+model=hf {line} (a checkpoint directory, its layout read from config.json), or "
               f"+model={default} {line} (the embedded default's layout)")
    value = line.partition("=")[2] if o.is_sweep_override() else o.value()
    return ConfigIssue(o.key_or_group, value, f"select a model first: +model=NAME ({', '.join(available_models())}), "
                                              f"e.g. {fix}")


def available_models() -> list[str]:
    return group_options("model")
