"""`mode=validate`: print the resolved config and the derived cache-group table; touches no device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from appliance.core.config import RuntimeConfig
from appliance.core.tables import cache_group_table


RANDOM_WEIGHTS_NOTE = ("random weights: the text it generates is meaningless; serve a checkpoint with "
                       "model.weights=DIR (config.json, *.safetensors, tokenizer.json)")


def selected_model_line(rc: RuntimeConfig) -> str:
    """Which model this config selected (the embedded default when no +model= is given) and its weights."""
    m = rc.model
    line = (f"selected model: {m.name} (arch {m.arch}, {m.layout.num_layers} layers, vocab {m.layout.vocab_size:,}), "
            f"weights {m.weights_label}")
    return line + (f"\n  {RANDOM_WEIGHTS_NOTE}" if m.weights == "random" else "")


def run_validate(rc: RuntimeConfig, output_dir: Path | None = None) -> dict[str, Any]:
    print(rc.resolved_yaml)
    print(f"== cache groups of {rc.model.name} ({rc.model.arch}) ==")
    print(cache_group_table(rc.model.cache_groups, rc.max_model_len, rc.decode_batch))
    print(selected_model_line(rc))
    return {"status": "ok", "mode": "validate", "model": rc.model.name}
