"""OmegaConf nodes as plain Python containers, typed.

OmegaConf's stubs type `to_container` as any container (a dict with any key kind, a list, a string or None) for any
node; the composer only ever converts a mapping node to a dict with string keys, or a sequence node to a list. These
say which one, and fail loudly when a node is not what the caller expects, so no caller needs a cast.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf


def plain_dict(node: DictConfig, resolve: bool = True, throw_on_missing: bool = False) -> dict[str, Any]:
    """A mapping node as a dict (keys as strings), interpolations resolved unless asked not to."""
    out = OmegaConf.to_container(node, resolve=resolve, throw_on_missing=throw_on_missing)
    if not isinstance(out, dict):
        raise TypeError(f"expected a mapping config node, got {type(out).__name__}")
    return {str(k): v for k, v in out.items()}


def plain_list(node: ListConfig, resolve: bool = False) -> list[Any]:
    """A sequence node as a list."""
    out = OmegaConf.to_container(node, resolve=resolve)
    if not isinstance(out, list):
        raise TypeError(f"expected a sequence config node, got {type(out).__name__}")
    return out
