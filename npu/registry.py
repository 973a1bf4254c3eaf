"""Runner classes found through the architecture registry (appliance.core.archs), imported on first use."""

from __future__ import annotations

import importlib

import torch

from appliance.core.archs import architecture
from appliance.core.config import ModelSpec
from appliance.core.parallel import RankPlace
from npu.runner import ModelRunner


def runner_class(arch: str) -> type[ModelRunner]:
    """The ModelRunner subclass of `arch` (ConfigError naming model.arch for an unknown one)."""
    target = architecture(arch).runner
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"the runner for model.arch={arch!r} ({target}) is not available: {exc}") from exc


def build_runner(model: ModelSpec, device: torch.device, place: RankPlace | None = None) -> ModelRunner:
    """The runner of model.arch on `device`, holding the part of the model the rank at `place` holds (None: all)."""
    return runner_class(model.arch)(model, device, place=place)
