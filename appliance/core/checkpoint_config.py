"""A checkpoint directory's config.json checked against model.layout, before any tensor is read. No torch."""

from __future__ import annotations

import json
from pathlib import Path

from appliance.core import bounded_json
from appliance.core.archs import architecture
from appliance.core.archs.hf_config import HfConfigError, check_value_kinds, identity_issue, json_kind, values_agree
from appliance.core.config import ModelSpec
from appliance.core.errors import CheckpointError


def check_checkpoint_config(checkpoint_dir: str | Path, model: ModelSpec) -> None:
    """config.json must describe the same layout as model.layout: one error naming every disagreeing key.

    Which config.json keys map to which layout keys is the architecture's (appliance.core.archs: its view of the
    file, the keys and the values it only supports); keys the file leaves out are not checked.
    """
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(checkpoint_dir)!r} (model.weights) has no config.json. Fix: copy the "
                              f"checkpoint's config.json next to its *.safetensors files")
    try:
        cfg = bounded_json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint file {str(path)!r} is not readable JSON ({exc}). Fix: restore the "
                              f"checkpoint's config.json") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"checkpoint file {str(path)!r} holds a JSON {json_kind(cfg)}, not an object. "
                              f"Fix: restore the checkpoint's config.json")
    arch = architecture(model.arch)
    identity = identity_issue(cfg, arch.hf_architectures, arch.hf_model_types)
    if identity:
        raise CheckpointError(f"checkpoint {str(checkpoint_dir)!r} is not a {arch.name} checkpoint: {path.name} says "
                              f"{identity}, model {model.name!r} is arch {arch.name}. Fix: pick the model YAML "
                              f"this checkpoint was made for (+model=...), or serve it with +model=hf")
    try:
        check_value_kinds(cfg, arch.config_keys, arch.hf_value_kinds, arch.layout)
        cfg = arch.config_view(cfg)
    except HfConfigError as exc:
        raise CheckpointError(f"checkpoint file {str(path)!r}: {exc}. Fix: restore the checkpoint's "
                              f"config.json") from None
    lay = model.layout
    bad = [f"config.json {key}={cfg[key]!r} is not supported (only {value!r})"
           for key, value in arch.config_fixed.items() if key in cfg and cfg[key] != value]
    for file_key, key in arch.config_keys.items():
        if file_key not in cfg:
            continue
        mine, theirs = getattr(lay, key), cfg[file_key]
        if isinstance(mine, tuple):
            mine = list(mine)
        if not values_agree(mine, theirs):
            bad.append(f"model.layout.{key}={mine!r} but config.json {file_key}={theirs!r}")
    if cfg.get("rope_scaling"):
        bad.append(f"config.json rope_scaling={cfg['rope_scaling']!r} is not supported")
    if bad:
        raise CheckpointError(f"checkpoint {str(checkpoint_dir)!r} does not match model {model.name!r} "
                              f"({path.name} against model.layout):\n  " + "\n  ".join(bad) +
                              "\nFix: pick the model YAML this checkpoint was made for (+model=...), or override the "
                              "disagreeing model.layout keys")
