"""Keys the schema defines: any other key is a ConfigIssue that suggests the closest valid one.

Hydra rejects `decode_btach=4` against the schema, but its hint is to append the key (`+decode_btach=4`), and
`+key=value` or `++key=value` then adds any key at all, which the appliance would silently ignore. So every
key path, whether from an override or in the composed config, is checked here against the schema's
dataclasses (appliance/config/schema.py, derived from the settings declared in appliance/core/config.py); a
subtree the schema leaves free (a field typed Any, such as a cache group's `layers` selector) is not.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from functools import cache
from typing import Any

from omegaconf import DictConfig

from appliance.config.plain import plain_dict
from appliance.config.schema import appliance_schema
from appliance.core.config import RuntimeConfig
from appliance.core.errors import ConfigIssue

FREE = object()          # a subtree whose keys the schema does not fix
HYDRA_KEY = "hydra"      # Hydra's own settings: its schema, not ours


@cache
def _fields(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else FREE
    return tp


def _child(tp: Any, key: str) -> Any:
    """The schema type under `key` of a node of type `tp`; None when the schema has no such key."""
    tp = _unwrap_optional(tp)
    if tp is Any or tp is FREE:
        return FREE
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _fields(tp).get(key)
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return typing.get_args(tp)[0] if key.isdigit() and typing.get_args(tp) else None
    if origin is dict:
        return FREE
    return None                     # a value (int, str, ...) has no keys


def _all_paths(tp: Any, prefix: str = "") -> list[str]:
    """Every key path the schema defines (list items as `.0`), for suggestions across levels."""
    tp = _unwrap_optional(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        out = []
        for name, sub in _fields(tp).items():
            path = f"{prefix}{name}"
            out += [path, *_all_paths(sub, path + ".")]
        return out
    if typing.get_origin(tp) in (list, tuple) and typing.get_args(tp):
        return _all_paths(typing.get_args(tp)[0], prefix + "0.")
    return []


def _suggestion(root: Any, parent: str, parent_type: Any, key: str) -> str:
    siblings = list(_fields(_unwrap_optional(parent_type))) if dataclasses.is_dataclass(
        _unwrap_optional(parent_type)) else []
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        return f"did you mean {parent}{close[0]}?"
    by_leaf = {p.rsplit(".", 1)[-1]: p for p in _all_paths(root)}
    close = difflib.get_close_matches(key, list(by_leaf), n=1, cutoff=0.8)
    if close:
        return f"did you mean {by_leaf[close[0]]}?"
    where = f"under {parent.rstrip('.')}" if parent else "at the top level"
    return f"the keys {where} are: {', '.join(siblings)}" if siblings else "this key holds a value, not keys"


def schema_key_issue(path: str, value: object, runtime_type: type = RuntimeConfig) -> ConfigIssue | None:
    """None when `path` (dotted; list items as `.0` or `[0]`) is a key the schema of `runtime_type` defines."""
    parts = [p for p in re.split(r"[.\[\]]+", path) if p]
    root: Any = appliance_schema(runtime_type)
    tp = root
    for i, key in enumerate(parts):
        sub = _child(tp, key)
        if sub is FREE:
            return None
        if sub is None:
            parent = "".join(f"{p}." for p in parts[:i])
            return ConfigIssue(path, value, f"not a key of the schema (appliance/core/config.py); "
                                            f"{_suggestion(root, parent, tp, key)}")
        tp = sub
    return None


def unknown_key_issues(cfg: DictConfig, runtime_type: type = RuntimeConfig) -> list[ConfigIssue]:
    """Every key of a composed config that the schema does not define (the topmost one of each subtree)."""
    issues: list[ConfigIssue] = []

    def walk(node: Any, prefix: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            path = f"{prefix}{key}"
            issue = schema_key_issue(path, value, runtime_type)
            if issue is not None:
                issues.append(issue)
            else:
                walk(value, path + ".")

    plain = plain_dict(cfg, resolve=False)
    walk({k: v for k, v in plain.items() if k != HYDRA_KEY}, "")
    return issues
