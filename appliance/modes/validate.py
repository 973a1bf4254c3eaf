"""`mode=validate`: print the resolved config, the derived cache-group table and, for an architecture that
describes its parameters, their counts and checkpoint bytes; a checkpoint's config.json is checked against
the layout. Touches no device and imports no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from appliance.core.archs import architecture
from appliance.core.checkpoint_config import check_checkpoint_config
from appliance.core.config import RuntimeConfig
from appliance.core.tables import cache_group_table, parameter_table

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
    result: dict[str, Any] = {"status": "ok", "mode": "validate", "model": rc.model.name}
    describe = architecture(rc.model.arch).parameters
    if describe is not None:
        counts = describe(rc.model.layout)
        print(f"== parameters of {rc.model.name} ==")
        print(parameter_table(counts))
        result["parameters"] = {"total": counts.total, "active": counts.active, "mtp": counts.mtp,
                                "checkpoint_bytes": counts.total_bytes}
    if rc.model.weights != "random":
        check_checkpoint_config(rc.model.weights, rc.model)
        print(f"checkpoint {rc.model.weights}: config.json agrees with model.layout")
    return result
