"""What a Hugging Face config.json says about model.layout: the shared vocabulary of the per-arch mappings.

Each architecture module reads its own config.json format (`layout_from_hf_config(cfg) -> HfLayout`) and
derives the cache groups its runner needs from the finished layout (`cache_groups_for(layout) -> list of
cache-group dicts`, the same shape as a model YAML's `cache_groups`). The composer (appliance/config) fills
model.layout from an HfLayout: a YAML value that disagrees with `from_file` is an error naming both;
`defaults` are serving choices config.json does not make (block size, ...), which YAML may override.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    """cfg[key]; absent (or null) falls back to the default transformers' config class uses, if there is one."""
    value = cfg.get(key)
    if value is not None:
        return value
    if default is ...:
        raise HfConfigError(key, "is missing from config.json")
    return default


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
            return "rope_parameters.rope_theta", float(params["rope_theta"])
    return "rope_theta", float(read(cfg, "rope_theta", default))
