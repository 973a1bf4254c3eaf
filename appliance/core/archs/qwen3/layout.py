"""Qwen3's layout (model.layout of arch qwen3) and its one cache group's name."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.core.config import Layout

KV = "kv"


@dataclass(frozen=True, kw_only=True)
class Qwen3Layout(Layout):
    """Qwen3: plain attention over every layer, then a dense MLP."""

    intermediate_size: int                 # dense MLP width
