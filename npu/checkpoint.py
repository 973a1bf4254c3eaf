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

from appliance.core.config import ModelSpec
from appliance.core.tokenizer import Tokenizer
from npu.registry import runner_class
from npu.weights import random_state_dict

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


def write_tiny_checkpoint(directory: str | Path, model: ModelSpec, seed: int, std: float = 0.02) -> Path:
    """config.json + model.safetensors (the runner's random_state_dict) + tokenizer.json into `directory`."""
    from safetensors.torch import save_file

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
