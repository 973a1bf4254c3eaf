"""What a Hugging Face config.json says about model.layout: the shared vocabulary of the per-arch mappings.

Each architecture module reads its own config.json format (`layout_from_hf_config(cfg) -> HfLayout`) and
derives the cache groups its runner needs from the finished layout (`cache_groups_for(layout) -> list of
cache-group dicts`, the same shape as a model YAML's `cache_groups`). The composer (appliance/config) fills
model.layout from an HfLayout: a YAML value that disagrees with `from_file` is an error naming both;
`defaults` are serving choices config.json does not make (block size, ...), which YAML may override.
"""

from __future__ import annotations

import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from appliance.core.config import Layout

DTYPE_KEYS = ("dtype", "torch_dtype")       # transformers >= 4.56 writes "dtype", older releases "torch_dtype"


class HfConfigError(ValueError):
    """config.json lacks a key the layout needs, or asks for something the runner does not support."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


@dataclass(frozen=True)
class HfLayout:
    from_file: dict[str, tuple[str, Any]] = field(default_factory=dict)   # layout key -> (config.json key, value)
    defaults: dict[str, Any] = field(default_factory=dict)                 # layout key -> serving default

    def values(self) -> dict[str, Any]:
        return {**self.defaults, **{k: v for k, (_, v) in self.from_file.items()}}


def values_agree(mine: Any, theirs: Any) -> bool:
    """A layout value and a config.json value are the same (floats to 1e-12 relative, tuples as lists)."""
    if isinstance(mine, tuple):
        mine = list(mine)
    if isinstance(mine, float) or isinstance(theirs, float):
        try:
            return abs(float(mine) - float(theirs)) <= 1e-12 * max(1.0, abs(float(mine)))
        except (TypeError, ValueError):
            return False
    return mine == theirs


def read(cfg: dict[str, Any], key: str, default: Any = ...) -> Any:
    """cfg[key]; absent (or null) falls back to the default transformers' config class uses, if there is one.
    No default: a required key (it sets a tensor shape), never guessed."""
    value = cfg.get(key)
    if value is not None:
        return value
    if default is ...:
        raise HfConfigError(key, "is missing from config.json (required: it sets the model's shapes)")
    return default


# -- value kinds ----------------------------------------------------------------------------------------
# JSON gives bool, int, float, str, list, dict or null; Python's bool is an int, so a kind is checked
# exactly: `true` is no layer count and 64.5 no width. Checked before any mapping reads a value, so a bad
# file is one message naming the key, never a traceback or a silently truncated number.

def layout_kinds(layout_type: type[Layout]) -> dict[str, Any]:
    """The kind of every key of an architecture's layout type (and main_layer_ratios, which some files give)."""
    return {**typing.get_type_hints(layout_type), "main_layer_ratios": tuple[int, ...] | None}


def kind_fits(value: Any, kind: Any) -> bool:
    """`value` (as json.loads gives it) is of `kind` (int, float, bool, str, dict, list[...], tuple[...], unions)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (types.UnionType, typing.Union):
        return any(kind_fits(value, a) for a in args)
    if kind is type(None):
        return value is None
    if origin in (list, tuple):
        return isinstance(value, list) and all(kind_fits(v, args[0]) for v in value)
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind)


def kind_name(kind: Any) -> str:
    """What a kind reads as in a message: "an integer", "a list of strings", "a number or null"."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(kind_name(a) for a in args)
    if origin in (list, tuple):
        return "a list of " + {int: "integers", str: "strings"}.get(args[0], kind_name(args[0]))
    names: dict[Any, str] = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string",
                             dict: "an object", type(None): "null"}
    return names.get(kind, kind.__name__)


def check_kind(key: str, value: Any, kind: Any, layout_key: str | None = None) -> None:
    """HfConfigError naming the key, the value and the kind expected (and the layout key it fills)."""
    if not kind_fits(value, kind):
        fills = f" (model.layout.{layout_key})" if layout_key else ""
        raise HfConfigError(key, f"{json.dumps(value, default=repr)} is not {kind_name(kind)}{fills}")


def json_kind(value: Any) -> str:
    """What JSON calls the kind of a json.loads value: list, null, string, number, boolean or object."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else "boolean"
    kinds: dict[type, str] = {list: "list", str: "string", dict: "object"}
    return kinds.get(type(value), "number")


def config_object(cfg: Any) -> dict[str, Any]:
    """config.json's top level: an object, or HfConfigError."""
    if not isinstance(cfg, dict):
        raise HfConfigError("(top level)", f"is a JSON {json_kind(cfg)}, not an object")
    return cfg


def check_value_kinds(cfg: dict[str, Any], config_keys: dict[str, str], extra_kinds: dict[str, Any],
                      layout_type: type[Layout]) -> None:
    """Every top-level key an architecture reads (`config_keys`: config.json key -> layout key, and
    `extra_kinds`) holds its kind when present; null stands for absent."""
    check_kind("architectures", cfg.get("architectures"), list[str] | None)
    check_kind("model_type", cfg.get("model_type"), str | None)
    for file_key, layout_key in config_keys.items():
        if "." not in file_key and cfg.get(file_key) is not None:
            check_kind(file_key, cfg[file_key], layout_kinds(layout_type)[layout_key], layout_key)
    for file_key, kind in extra_kinds.items():
        if cfg.get(file_key) is not None:
            check_kind(file_key, cfg[file_key], kind)


def check_layout_kinds(hf: HfLayout, layout_type: type[Layout]) -> None:
    """The layout a mapping made (nested and derived values included) has the kinds its layout type declares."""
    for layout_key, (file_key, value) in hf.from_file.items():
        check_kind(file_key, value, layout_kinds(layout_type)[layout_key], layout_key)


def identity_issue(cfg: dict[str, Any], hf_architectures: tuple[str, ...], model_types: tuple[str, ...]) -> str | None:
    """Why config.json describes another architecture (its `architectures` or `model_type`), or None."""
    names = cfg.get("architectures")
    if names and not set(names) & set(hf_architectures):
        return f"architectures={names} (expected one of {list(hf_architectures)})"
    kind = cfg.get("model_type")
    if kind is not None and kind not in model_types:
        return f"model_type={kind!r} (expected {' or '.join(map(repr, model_types))})"
    return None


def dtype_of(cfg: dict[str, Any]) -> tuple[str, str]:
    """(config.json key, dtype) of the weights; float32 when config.json names none (as transformers loads it)."""
    for key in DTYPE_KEYS:
        if isinstance(cfg.get(key), str):
            return key, cfg[key]
    return DTYPE_KEYS[0], "float32"


def plain_rope_theta(cfg: dict[str, Any], default: float) -> tuple[str, float]:
    """(config.json key, theta) of plain RoPE; rope scaling of any kind is refused (the runners compute plain RoPE).

    transformers >= 5 writes `rope_parameters: {rope_type, rope_theta}`, older releases `rope_theta` and
    `rope_scaling`."""
    scaling = cfg.get("rope_scaling")
    if scaling:
        raise HfConfigError("rope_scaling", f"{scaling!r} is not supported (plain RoPE only)")
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise HfConfigError("rope_parameters.rope_type", f"{kind!r} is not supported (plain RoPE only)")
        if "rope_theta" in params:
            check_kind("rope_parameters.rope_theta", params["rope_theta"], float, "rope_theta")
            return "rope_parameters.rope_theta", float(params["rope_theta"])
    return "rope_theta", float(read(cfg, "rope_theta", default))
