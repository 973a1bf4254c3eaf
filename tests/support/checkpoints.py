"""Tiny checkpoints written locally (config.json + model.safetensors + tokenizer.json); nothing is downloaded.

The config.json is the architecture's Hugging Face config (Qwen3, DeepseekV4) and tensors carry the released
names, so transformers' Qwen3ForCausalLM / DeepseekV4ForCausalLM.from_pretrained load the same directory: that
is how the oracle tests compare the runners with transformers. DeepSeek V4 checkpoints can be quantized as
released (FP8 linears, FP4 experts) and written with their dense twin.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from appliance.core.archs.deepseek_v4.layout import compress_ratios
from appliance.core.archs.deepseek_v4.weights import model_weights, scale_name
from appliance.core.config import ModelSpec
from appliance.core.tokenizer import Tokenizer
from npu.quant import QuantizedWeight, quantize_fp4, quantize_fp8
from npu.registry import runner_class

log = logging.getLogger("tests.support.checkpoints")


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


def deepseek_v4_hf_config(model: ModelSpec, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """The config.json of a deepseek_v4 checkpoint: the released keys (compress_ratios, num_hash_layers,
    qk_rope_head_dim, rope_scaling, quantization_config, expert_dtype), plus layer_types and compress_rates,
    which transformers' DeepseekV4Config reads for ratios other than the released 4 and 128; transformers'
    DeepseekV4ForCausalLM loads the same directory."""
    lay = model.layout
    csa, hca = compress_ratios(lay)
    kind = {0: "sliding_attention", csa: "compressed_sparse_attention", hca: "heavily_compressed_attention"}
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": lay.vocab_size,
        "hidden_size": lay.hidden_size,
        "num_hidden_layers": lay.num_layers,
        "num_nextn_predict_layers": lay.num_mtp_layers,
        "num_attention_heads": lay.num_heads,
        "num_key_value_heads": lay.num_kv_heads,
        "head_dim": lay.head_dim,
        "q_lora_rank": lay.q_lora_rank,
        "qk_rope_head_dim": lay.qk_rope_head_dim,
        "o_groups": lay.o_groups,
        "o_lora_rank": lay.o_lora_rank,
        "sliding_window": lay.sliding_window,
        "compress_ratios": list(lay.compress_ratios),
        "layer_types": [kind[r] for r in lay.main_layer_ratios],
        "compress_rates": {kind[csa]: csa, kind[hca]: hca},
        "rope_theta": lay.rope_theta,
        "compress_rope_theta": lay.compress_rope_theta,
        "index_n_heads": lay.index_num_heads,
        "index_head_dim": lay.index_head_dim,
        "index_topk": lay.index_topk,
        "n_routed_experts": lay.num_experts,
        "num_experts_per_tok": lay.num_experts_per_tok,
        "n_shared_experts": lay.num_shared_experts,
        "moe_intermediate_size": lay.moe_intermediate_size,
        "num_hash_layers": lay.num_hash_layers,
        "scoring_func": lay.scoring_func,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "routed_scaling_factor": lay.routed_scaling_factor,
        "swiglu_limit": lay.swiglu_limit,
        "hc_mult": lay.hc_mult,
        "hc_sinkhorn_iters": lay.hc_sinkhorn_iters,
        "hc_eps": lay.hc_eps,
        "hidden_act": "silu",
        "rms_norm_eps": lay.rms_norm_eps,
        "tie_word_embeddings": lay.tie_word_embeddings,
        "max_position_embeddings": lay.max_model_len_cap,
        "attention_bias": False,
        "torch_dtype": lay.dtype,
        "use_cache": True,
    }
    if lay.yarn_factor:
        cfg["rope_scaling"] = {"type": "yarn", "factor": lay.yarn_factor,
                               "original_max_position_embeddings": lay.yarn_original_max_position_embeddings,
                               "beta_fast": lay.yarn_beta_fast, "beta_slow": lay.yarn_beta_slow}
    if lay.quant_block_size:
        b = lay.quant_block_size
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "scale_fmt": "ue8m0", "weight_block_size": [b, b]}
    if lay.expert_dtype:
        cfg["expert_dtype"] = lay.expert_dtype
    if tokenizer is not None:
        cfg.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    return cfg


HF_CONFIGS = {"qwen3": qwen3_hf_config, "deepseek_v4": deepseek_v4_hf_config}


def dense_twin(model: ModelSpec) -> ModelSpec:
    """The same model with every weight stored in layout.dtype (no FP8 / FP4)."""
    lay = dataclasses.replace(model.layout, quant_block_size=None, expert_dtype=None)
    return dataclasses.replace(model, layout=lay)


def quantize_state(dense: dict[str, torch.Tensor], model: ModelSpec) -> dict[str, torch.Tensor]:
    """Dense weights (of dense_twin(model)) in the stored formats of `model`'s layout: FP8 / FP4 values and
    their ue8m0 scales under the released names."""
    lay = model.layout
    out = dict(dense)
    for w in model_weights(lay):
        if w.format == "fp8":
            out[w.name], out[scale_name(w.name)] = quantize_fp8(dense[w.name], lay.quant_block_size)
        elif w.format == "fp4":
            out[w.name], out[scale_name(w.name)] = quantize_fp4(dense[w.name])
    return out


def dequantize_state(state: dict[str, torch.Tensor], model: ModelSpec) -> dict[str, torch.Tensor]:
    """The dense twin of quantized weights: each FP8 / FP4 matrix dequantized to layout.dtype, scales dropped."""
    lay = model.layout
    dtype = getattr(torch, lay.dtype)
    out = dict(state)
    for w in model_weights(lay):
        if w.format in ("fp8", "fp4"):
            out[w.name] = QuantizedWeight(w.name, state[w.name], out.pop(scale_name(w.name)),
                                          lay.quant_block_size or 0).dequantize(dtype)
    return out


def save_checkpoint(directory: str | Path, model: ModelSpec, state: dict[str, torch.Tensor]) -> Path:
    """config.json (the arch's Hugging Face config) + model.safetensors (`state`) + tokenizer.json."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.build(model.layout.vocab_size)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(HF_CONFIGS[model.arch](model, tokenizer), indent=2) + "\n")
    tokenizer.save(out / "tokenizer.json")
    log.info("wrote %s checkpoint (%d tensors) to %s", model.arch, len(state), out)
    return out


def write_tiny_checkpoint(directory: str | Path, model: ModelSpec, seed: int, std: float = 0.02) -> Path:
    """A checkpoint of the runner's seeded random weights (quantized layouts: the dense twin's random weights,
    quantized) with its config.json and tokenizer.json."""
    twin = dense_twin(model) if model.arch == "deepseek_v4" else model
    state = runner_class(model.arch)(twin, torch.device("cpu")).random_weights(seed, std, device="cpu")
    if twin is not model:
        state = quantize_state(state, model)
    return save_checkpoint(directory, model, state)
