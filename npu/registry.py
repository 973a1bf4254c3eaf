"""The device plane's half of the architecture registry: which ModelRunner runs each `model.arch`.

The core registry (appliance.core.archs) keeps each architecture's rules, parallelism and config keys, torch-free;
the runners are torch code, so the device plane owns this table and imports them plainly (tests/test_layers.py
sees these imports; a `module:Class` string loaded by importlib it could not).
"""

from __future__ import annotations

import torch

from appliance.core.archs import architecture
from appliance.core.config import ModelSpec
from appliance.core.parallel import RankPlace
from npu.deepseek_v4.runner import DeepseekV4Runner
from npu.qwen3.runner import Qwen3Runner
from npu.runner import ModelRunner

RUNNERS: dict[str, type[ModelRunner]] = {
    "qwen3": Qwen3Runner,
    "deepseek_v4": DeepseekV4Runner,
}


def runner_class(arch: str) -> type[ModelRunner]:
    """The ModelRunner subclass of `arch` (ConfigError naming model.arch for an unknown one)."""
    name = architecture(arch).name
    try:
        return RUNNERS[name]
    except KeyError:
        raise RuntimeError(f"model.arch={arch!r} has no runner in npu/registry.py") from None


def build_runner(model: ModelSpec, device: torch.device, place: RankPlace | None = None) -> ModelRunner:
    """The runner of model.arch on `device`, holding the part of the model the rank at `place` holds (None: all)."""
    return runner_class(model.arch)(model, device, place=place)
