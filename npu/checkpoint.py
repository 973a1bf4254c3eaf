"""Tiny checkpoints written locally (config.json + model.safetensors + tokenizer.json); nothing is downloaded.

For qwen3 the config.json is a Hugging Face Qwen3 config, so transformers' Qwen3ForCausalLM.from_pretrained
loads the same directory: that is how the oracle test compares the runner with transformers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from appliance.config.runtime import ModelSpec
from appliance.tokenizer import Tokenizer
from npu.weights import CheckpointError, random_state_dict

log = logging.getLogger("npu.checkpoint")


def qwen3_hf_config(model: ModelSpec, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """The Hugging Face Qwen3 config.json equivalent of a qwen3 layout."""
    lay = model.layout
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": lay.vocab_size,
        "hidden_size": lay.hidden_size,
        "intermediate_size": lay.intermediate_size,
        "num_hidden_layers": lay.num_layers,
        "num_attention_heads": lay.num_heads,
        "num_key_value_heads": lay.num_kv_heads,
        "head_dim": lay.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": lay.max_model_len_cap,
        "rms_norm_eps": lay.rms_norm_eps,
        "rope_theta": lay.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": lay.tie_word_embeddings,
        "use_sliding_window": False,
        "sliding_window": None,
        "torch_dtype": lay.dtype,
        "use_cache": True,
    }
    if tokenizer is not None:
        cfg.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    return cfg


# config.json keys a qwen3 checkpoint must agree on with model.layout (HF name -> layout name).
_QWEN3_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "tie_word_embeddings": "tie_word_embeddings",
}


def check_checkpoint_config(checkpoint_dir: str | Path, model: ModelSpec) -> None:
    """A qwen3 checkpoint's config.json must describe the same layout as model.layout (one error, all keys)."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"checkpoint {checkpoint_dir} has no config.json")
    cfg = json.loads(path.read_text())
    lay = model.layout
    bad = []
    for hf_key, key in _QWEN3_KEYS.items():
        if hf_key not in cfg:
            continue
        mine, theirs = getattr(lay, key), cfg[hf_key]
        same = abs(mine - theirs) <= 1e-12 * max(1.0, abs(mine)) if isinstance(mine, float) else mine == theirs
        if not same:
            bad.append(f"model.layout.{key}={mine!r} but config.json {hf_key}={theirs!r}")
    if cfg.get("rope_scaling"):
        bad.append(f"config.json rope_scaling={cfg['rope_scaling']!r} is not supported")
    if bad:
        raise CheckpointError(f"checkpoint {checkpoint_dir} does not match model {model.name!r}:\n  " + "\n  ".join(bad))


def write_tiny_checkpoint(directory: str | Path, model: ModelSpec, seed: int, std: float = 0.02) -> Path:
    """config.json + model.safetensors (the runner's random_state_dict) + tokenizer.json into `directory`."""
    from safetensors.torch import save_file

    from npu.launcher import runner_class

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.build(model.layout.vocab_size)
    runner = runner_class(model.arch)(model, torch.device("cpu"))
    state = random_state_dict(runner.expected_weights(), seed, "cpu", std=std)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    if model.arch == "qwen3":
        config = qwen3_hf_config(model, tokenizer)
    else:
        config = {"architectures": [model.arch], "model_type": model.arch, "name": model.name,
                  **{k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(model.layout).items()},
                  "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(out / "tokenizer.json")
    log.info("wrote tiny %s checkpoint (%d tensors, seed %d) to %s", model.arch, len(state), seed, out)
    return out
