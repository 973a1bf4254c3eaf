"""DeepSeek V4 weights as released: FP8 / FP4 formats, quantized checkpoints against their dense twin, the full
layout on the meta device (names, shapes, counts, the plan's estimate from the same description), and
config.json in both spellings checked against the layout."""

import dataclasses
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from appliance.config.compose import load_runtime_config
from appliance.core.archs.deepseek_v4.weights import checkpoint_tensors, parameter_counts
from appliance.core.checkpoint_config import check_checkpoint_config
from appliance.core.errors import CheckpointError
from appliance.core.estimate import estimate_peak_non_kv, offline_devices
from appliance.core.parallel import RankPlace, place_of
from npu.deepseek_v4.runner import DeepseekV4Runner
from npu.quant import QuantizedWeight, dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8
from npu.weights import load_state_dict, random_state_dict
from tests.support.checkpoints import dense_twin, dequantize_state, save_checkpoint, write_tiny_checkpoint

E4M3 = torch.tensor([0.0, 0.25, -0.5, 1.0, 1.5, -3.0, 448.0, -0.015625])
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def representable(shape, block_rows, block_cols, values, seed):
    """A matrix of `values` x (one power of two per block): exactly what the format can hold."""
    gen = torch.Generator().manual_seed(seed)
    out, inp = shape
    picks = values[torch.randint(0, len(values), shape, generator=gen)]
    exps = torch.randint(-8, 4, (-(-out // block_rows), -(-inp // block_cols)), generator=gen).float()
    scale = torch.exp2(exps).repeat_interleave(block_rows, 0)[:out].repeat_interleave(block_cols, 1)[:, :inp]
    return picks * scale


def test_fp8_block_round_trip_is_exact_on_representable_values():
    w = representable((200, 300), 128, 128, E4M3, seed=0)        # partial blocks at both edges
    values, scale = quantize_fp8(w, 128)
    assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu and scale.shape == (2, 3)
    assert torch.equal(dequantize_fp8(values, scale, 128, torch.float32), w)
    assert torch.equal(dequantize_fp8(values, scale, 128, torch.bfloat16), w.to(torch.bfloat16))


def test_fp4_round_trip_is_exact_and_packs_low_nibble_first():
    w = representable((6, 64), 1, 32, E2M1, seed=1)
    values, scale = quantize_fp4(w)
    assert values.dtype == torch.float4_e2m1fn_x2 and values.shape == (6, 32) and scale.shape == (6, 2)
    assert torch.equal(dequantize_fp4(values, scale, torch.float32), w)
    byte = torch.tensor([[0x21] + [0] * 15], dtype=torch.uint8)     # codes 1 (0.5) low, 2 (1.0) high
    one = torch.full((1, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    row = dequantize_fp4(byte.view(torch.float4_e2m1fn_x2), one, torch.float32)
    assert row[0, :2].tolist() == [0.5, 1.0] and not row[0, 2:].any()
    neg = torch.tensor([[0xF9] + [0] * 15], dtype=torch.uint8)       # codes 9 (-0.5) low, 15 (-6) high
    assert dequantize_fp4(neg.view(torch.float4_e2m1fn_x2), one, torch.float32)[0, :2].tolist() == [-0.5, -6.0]


def test_scale_byte_0xff_is_an_error_naming_the_tensor():
    values, scale = quantize_fp8(torch.randn(4, 4), 128)
    bad = scale.view(torch.uint8).clone()
    bad[0, 0] = 0xFF
    with pytest.raises(CheckpointError, match=r"layers\.3\.attn\.wq_a\.weight: ue8m0 scale byte 0xFF"):
        QuantizedWeight("layers.3.attn.wq_a.weight", values, bad.view(torch.float8_e8m0fnu), 128).check()


def test_hash_table_naming_a_missing_expert_is_an_error():
    m = load_runtime_config([]).model
    runner = DeepseekV4Runner(m, "cpu")
    state = runner.random_weights(0, device="cpu")
    state["layers.0.ffn.gate.tid2eid"][5, 1] = m.layout.num_experts
    with pytest.raises(CheckpointError, match=r"layers\.0\.ffn\.gate\.tid2eid: expert ids 0\.\.8 outside \[0, 8\)"):
        runner.set_weights(state)


def quantized_tiny():
    m = load_runtime_config(["model.layout.quant_block_size=32", "model.layout.expert_dtype=fp4", "+model=dsv4_tiny"])
    return m.model


E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)      # code & 7; bit 3 is the sign


def dequantize_from_the_format(values: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """Written from the formats' definitions, not with npu.quant: a ue8m0 byte e is 2 ** (e - 127); FP8 e4m3
    values (torch's own conversion) times their [block, block] tile's scale; FP4 e2m1 two codes per byte,
    the low nibble first, times the scale of each run of 32 columns. Float64 throughout, rounded once."""
    factor = torch.exp2(scale.view(torch.uint8).to(torch.float64) - 127)
    if values.dtype == torch.float8_e4m3fn:
        rows, cols = values.shape
        factor = factor.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
        return values.to(torch.float64) * factor
    packed = values.view(torch.uint8).to(torch.int64)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    magnitude = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[codes & 7]
    return torch.where(codes & 8 > 0, -magnitude, magnitude) * factor.repeat_interleave(32, 1)


def dense_from_the_format(state: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """Every tensor with a `.scale` sibling dequantized by dequantize_from_the_format (to float32), scales dropped."""
    scales = {k.removesuffix(".scale") + ".weight" for k in state if k.endswith(".scale")}
    return {k: dequantize_from_the_format(v, state[k.removesuffix(".weight") + ".scale"], block).float()
            if k in scales else v for k, v in state.items() if not k.endswith(".scale")}


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """A quantized tiny checkpoint (FP8 linears with 32 x 32 blocks, FP4 experts) and its dense twin, the twin
    dequantized from the formats' definitions (not by npu.quant, which the quantized runner uses)."""
    model = quantized_tiny()
    assert model.layout.dtype == "float32"
    root = tmp_path_factory.mktemp("dsv4_quantized")
    quantized = write_tiny_checkpoint(root / "fp8_fp4", model, seed=4, std=0.1)
    state = load_file(str(quantized / "model.safetensors"))
    dense = save_checkpoint(root / "dense", dense_twin(model),
                            dense_from_the_format(state, model.layout.quant_block_size))
    return model, quantized, dense


def test_dequantize_state_equals_the_formats_definitions(twins):
    model, quantized, _ = twins
    state = load_file(str(quantized / "model.safetensors"))
    ours, theirs = dequantize_state(state, model), dense_from_the_format(state, model.layout.quant_block_size)
    assert ours.keys() == theirs.keys()
    assert sum(state[k].dtype == torch.float8_e4m3fn for k in state) > 0
    assert sum(k.endswith(".scale") and "experts" in k for k in state) > 0
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


def greedy(runner, prompts, steps=4):
    m = runner.model
    runner.allocate_pools({s.name: len(prompts) * s.max_blocks_per_seq for s in m.cache_groups}, 1)
    from npu.step import SeqStep, StepBatch
    tables = [{s.name: list(range(i * s.max_blocks_per_seq, (i + 1) * s.max_blocks_per_seq))
               for s in m.cache_groups} for i in range(len(prompts))]
    seqs, out, logits = [list(p) for p in prompts], [[] for _ in prompts], []
    done = [0] * len(prompts)
    for _ in range(steps):
        batch = []
        for i, s in enumerate(seqs):
            n = min(len(s) - done[i], m.layout.tokens_in_flight)
            batch.append(SeqStep(f"r{i}", s[done[i]:done[i] + n], done[i], tables[i], sample=done[i] + n == len(s)))
        rows = iter(runner.execute(StepBatch(batch)))
        for i, step in enumerate(batch):
            done[i] += len(step.token_ids)
            if step.sample:
                row = next(rows)
                logits.append(row)
                seqs[i].append(int(row.argmax()))
                out[i].append(seqs[i][-1])
    return out, torch.stack(logits)


def test_quantized_checkpoint_gives_the_tokens_of_its_dense_twin(twins):
    model, quantized, dense = twins
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["layers.1.attn.wq_b.weight"] == "F8_E4M3" and dtypes["layers.1.attn.wq_b.scale"] == "F8_E8M0"
    assert dtypes["layers.1.ffn.experts.3.w2.weight"] == "F4"
    assert dtypes["layers.1.ffn.experts.3.w2.scale"] == "F8_E8M0"
    assert dtypes["layers.1.attn.compressor.wkv.weight"] == "F32" and "layers.1.attn.compressor.wkv.scale" not in dtypes
    runners = []
    for m, path in ((model, quantized), (dense_twin(model), dense)):
        runner = DeepseekV4Runner(dataclasses.replace(m, weights=str(path)), "cpu")
        runner.load_weights()
        runners.append(runner)
    held = runners[0].params
    assert isinstance(held["layers.1.attn.wq_b.weight"], QuantizedWeight)          # held as stored ...
    assert isinstance(held["layers.1.ffn.experts.3.w2.weight"], QuantizedWeight)
    assert isinstance(held["mtp.0.e_proj.weight"], QuantizedWeight)                # MTP held the same way
    assert not isinstance(runners[1].params["layers.1.attn.wq_b.weight"], QuantizedWeight)
    prompts = [[7, 8, 9] * 7, list(range(40, 90))]
    (tokens_q, logits_q), (tokens_d, logits_d) = (greedy(r, prompts) for r in runners)
    assert tokens_q == tokens_d
    assert (logits_q - logits_d).abs().max() < 1e-5                                # ... and dequantized exactly


def test_weights_read_as_stored_by_the_grouped_kernel_give_the_dense_twins_tokens(twins, monkeypatch):
    """The accelerator path: every MoE layer's FP4 experts stacked as stored and run by the Triton grouped GEMM (in
    Triton's interpreter here), the FP8 linears by the same kernel with one group and wo_a with one group per row
    block (its output groups), each dequantizing tile by tile: the dense twin's tokens and logits, and no weight
    dequantized whole."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs in Triton's interpreter")
    from npu.deepseek_v4.expert_stacks import stack_experts
    from npu.grouped_gemm_triton import triton_grouped_gemm
    model, quantized, dense = twins
    runners = []
    for m, path in ((model, quantized), (dense_twin(model), dense)):
        runner = DeepseekV4Runner(dataclasses.replace(m, weights=str(path)), "cpu")
        runner.load_weights()
        runners.append(runner)
    stacked = runners[0]
    stacked.expert_stacks, stacked.expert_gemm = stack_experts(stacked.params), triton_grouped_gemm
    stacked.read_linears_as_stored()
    assert all(isinstance(w, QuantizedWeight) and w.values.dtype == torch.float4_e2m1fn_x2
               for stack in stacked.expert_stacks.values() for w in stack)
    dequantized = []
    real = QuantizedWeight.dequantize
    monkeypatch.setattr(QuantizedWeight, "dequantize", lambda w, dtype: dequantized.append(w.name) or real(w, dtype))
    prompts = [[7, 8, 9] * 7, list(range(40, 90))]
    (tokens_q, logits_q), (tokens_d, logits_d) = (greedy(r, prompts) for r in runners)
    assert stacked.row_blocks and all(b is not None for b in stacked.row_blocks.values())
    assert not dequantized
    assert tokens_q == tokens_d
    assert (logits_q - logits_d).abs().max() < 1e-5


def test_fp4_experts_stored_as_bytes_load_the_same(twins, tmp_path):
    model, quantized, _ = twins
    state = load_file(str(quantized / "model.safetensors"))
    as_bytes = {k: v.view(torch.uint8) if v.dtype == torch.float4_e2m1fn_x2 else v for k, v in state.items()}
    path = save_checkpoint(tmp_path, model, as_bytes)
    expected = DeepseekV4Runner(model, "cpu").expected_weights()
    loaded = load_state_dict(path, expected, "cpu", progress=False)
    name = "layers.2.ffn.experts.0.w1.weight"
    assert loaded[name].dtype == torch.float4_e2m1fn_x2
    assert torch.equal(loaded[name].view(torch.uint8), state[name].view(torch.uint8))


def test_fp4_tensor_stored_in_another_dtype_is_named(twins, tmp_path):
    model, quantized, _ = twins
    state = load_file(str(quantized / "model.safetensors"))
    name = "layers.0.ffn.experts.1.w3.weight"
    state[name] = state[name].view(torch.uint8).to(torch.bfloat16)        # same shape, not FP4 bytes
    path = save_checkpoint(tmp_path, model, state)
    with pytest.raises(CheckpointError, match=rf"wrong dtype {name}: stored BF16, expected F4 \(or its bytes as U8\)"):
        load_state_dict(path, DeepseekV4Runner(model, "cpu").expected_weights(), "cpu", progress=False)


def test_full_dsv4_on_the_meta_device_has_the_released_shapes():
    m = load_runtime_config(["+model=dsv4"]).model
    runner = DeepseekV4Runner(m, "meta")
    expected = runner.expected_weights()
    runner.set_weights(random_state_dict(expected, seed=0, device="meta"))
    shape = lambda name: tuple(expected[name][0])  # noqa: E731
    assert shape("layers.2.attn.compressor.wkv.weight") == (1024, 4096)       # CSA: overlapping, 2 x 512
    assert shape("layers.3.attn.compressor.wkv.weight") == (512, 4096)        # HCA
    assert shape("layers.2.attn.indexer.wq_b.weight") == (8192, 1024)
    assert shape("layers.2.attn.indexer.compressor.wkv.weight") == (256, 4096)
    assert shape("layers.5.attn.wo_a.weight") == (8192, 4096) and shape("layers.5.attn.wo_b.weight") == (4096, 8192)
    assert shape("layers.5.attn.wq_b.weight") == (32768, 1024) and shape("layers.5.attn.wq_b.scale") == (256, 8)
    assert shape("layers.0.hc_attn_fn") == (24, 16384) and shape("hc_head_fn") == (4, 16384)
    assert shape("layers.7.ffn.experts.255.w1.weight") == (2048, 2048)        # FP4: two per byte
    assert shape("layers.7.ffn.experts.255.w1.scale") == (2048, 128)
    assert expected["layers.7.ffn.experts.255.w2.weight"][1] == torch.float4_e2m1fn_x2
    assert expected["layers.7.attn.wkv.weight"][1] == torch.float8_e4m3fn
    assert expected["layers.7.attn.compressor.wgate.weight"][1] == torch.bfloat16
    tables = sorted(int(n.split(".")[1]) for n in expected if n.endswith("ffn.gate.tid2eid"))
    biases = sorted(int(n.split(".")[1]) for n in expected if n.startswith("layers.") and n.endswith("ffn.gate.bias"))
    assert tables == [0, 1, 2] and biases == list(range(3, 43))
    assert "mtp.0.ffn.gate.bias" in expected and "mtp.0.e_proj.scale" in expected
    assert not any(k.startswith("mtp.0.attn.compressor") for k in expected)   # the MTP layer: window only
    assert all(t.device.type == "meta" for t in runner.params.values() if isinstance(t, torch.Tensor))
    # one description: the runner's tensors are exactly the ones the counts and the plan's estimate read
    counts = parameter_counts(m.layout)
    assert sum(torch.Size(s).numel() * d.itemsize for s, d in expected.values()) == counts.total_bytes
    assert 283e9 < counts.total < 286e9 and 13e9 < counts.active < 14e9
    assert 155e9 < counts.total_bytes < 165e9                                  # about 160 GB as published
    assert estimate_peak_non_kv(m, RankPlace.single(), 0).weight_bytes_per_device == counts.total_bytes


@pytest.mark.parametrize("rank", [0, 9, 15])
def test_each_expert_parallel_rank_of_full_dsv4_holds_what_mode_plan_estimates_for_it(rank):
    """Ascend A3 (16 dies), data parallel 16 x expert parallel 16: each rank's estimate in the plan equals the bytes
    of the tensors its runner loads, counted on the meta device: the replicated ones and its 16 routed experts."""
    rc = load_runtime_config(["+model=dsv4", "mode=plan", "device=ascend_a3", "max_model_len=8192"])
    assert (rc.parallel.data_parallel_size, rc.parallel.expert_parallel_size) == (16, 16)
    place = place_of(rc.parallel, rank)
    runner = DeepseekV4Runner(rc.model, "meta", place)
    state = runner.random_weights(0)
    held = sum(t.numel() * t.element_size() for t in state.values())
    planned = offline_devices(rc)[rank].peak_non_kv_bytes - rc.plan.activation_allowance_bytes
    assert held == planned == estimate_peak_non_kv(rc.model, place, 0).weight_bytes_per_device
    counts = parameter_counts(rc.model.layout)
    assert held == counts.replicated_bytes + counts.expert_bytes // 16
    experts = {int(n.split(".")[4]) for n in state if ".ffn.experts." in n}
    assert experts == set(range(16 * rank, 16 * rank + 16))
    runner.set_weights(state)            # what it holds is exactly what it loads: off the CPU its experts stacked
    assert not any(".experts." in n for n in runner.params)
    assert set(runner.expert_stacks) == {n.split("experts.")[0] for n in state if ".ffn.experts." in n}
    assert {w.shape[0] for stack in runner.expert_stacks.values() for w in stack} == {16}
    stacked = [t for stack in runner.expert_stacks.values() for w in stack for t in (w.values, w.scale)]
    assert sum(t.numel() * t.element_size() for t in stacked) == sum(
        t.numel() * t.element_size() for n, t in state.items() if ".ffn.experts." in n)


RELEASED_CONFIG = {   # config.json of DeepSeek-V4-Flash as published
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128,
    "index_n_heads": 64, "index_topk": 512, "initializer_range": 0.02, "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4", "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43,
    "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8,
    "o_lora_rank": 1024, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def write_config(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_released_config_json_agrees_with_dsv4(tmp_path):
    model = load_runtime_config(["+model=dsv4"]).model
    check_checkpoint_config(write_config(tmp_path, RELEASED_CONFIG), model)
    longer = dict(RELEASED_CONFIG, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0, 0, 0])   # a later variant
    check_checkpoint_config(write_config(tmp_path, longer), model)


@pytest.mark.parametrize("change,words", [
    ({"n_routed_experts": 128}, "model.layout.num_experts=256 but config.json n_routed_experts=128"),
    ({"compress_ratios": [0, 0] + [128, 4] * 20 + [4, 0]}, "model.layout.main_layer_ratios=[0, 0, 4, 128"),
    ({"rope_scaling": None}, "model.layout.yarn_factor=16.0 but config.json rope_scaling.factor=None"),
    ({"quantization_config": None}, "model.layout.quant_block_size=128 but config.json "
                                    "quantization_config.weight_block_size=None"),
    ({"expert_dtype": "fp8"}, "model.layout.expert_dtype='fp4' but config.json expert_dtype='fp8'"),
    ({"num_hash_layers": 2}, "model.layout.num_hash_layers=3 but config.json num_hash_layers=2"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"topk_method": "greedy"}, "config.json topk_method='greedy' is not supported (only 'noaux_tc')"),
])
def test_config_json_disagreeing_with_dsv4_names_both_values(tmp_path, change, words):
    model = load_runtime_config(["+model=dsv4"]).model
    with pytest.raises(CheckpointError) as err:
        check_checkpoint_config(write_config(tmp_path, dict(RELEASED_CONFIG, **change)), model)
    assert words in str(err.value)


def test_transformers_spelling_of_config_json_agrees_with_the_tiny_layout(tmp_path):
    """What DeepseekV4Config.save_pretrained writes (layer_types, mlp_layer_types, rope_parameters,
    partial_rotary_factor) is read as well as the released spelling."""
    transformers = pytest.importorskip("transformers")
    model = load_runtime_config([]).model
    ours = write_tiny_checkpoint(tmp_path / "ours", model, seed=0)
    check_checkpoint_config(ours, model)
    cfg = transformers.DeepseekV4Config.from_pretrained(ours)
    cfg.save_pretrained(tmp_path / "theirs")
    saved = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert "rope_parameters" in saved and "layer_types" in saved and "num_hash_layers" not in saved
    check_checkpoint_config(tmp_path / "theirs", model)
    saved["mlp_layer_types"] = ["hash_moe"] * 2 + ["moe"] * 3
    with pytest.raises(CheckpointError, match="num_hash_layers=1 but config.json num_hash_layers=2"):
        check_checkpoint_config(write_config(tmp_path / "theirs", saved), model)


def test_cli_validate_with_a_disagreeing_checkpoint_exits_2_naming_both(cli, tmp_path):
    model = load_runtime_config([]).model
    path = write_tiny_checkpoint(tmp_path / "ckpt", model, seed=0)
    good = cli("+model=dsv4_tiny", "mode=validate", f"model.weights={path}")
    assert good.returncode == 0, good.stderr
    assert "config.json agrees" in good.stdout and "active per token" in good.stdout
    cfg = json.loads((path / "config.json").read_text())
    cfg["o_lora_rank"] = 8
    (path / "config.json").write_text(json.dumps(cfg))
    bad = cli("+model=dsv4_tiny", "mode=validate", f"model.weights={path}")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "model.layout.o_lora_rank=16 but config.json o_lora_rank=8" in bad.stderr


def test_checkpoint_tensors_name_every_scale_once():
    lay = quantized_tiny().layout
    names = [t.name for t in checkpoint_tensors(lay)]
    assert len(names) == len(set(names))
    assert "layers.1.attn.wq_a.scale" in names and "layers.1.ffn.experts.0.w1.scale" in names
    assert "layers.1.attn.q_norm.scale" not in names and "embed.scale" not in names


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("chunk", [1 << 27, 64 * 256], ids=["whole", "expert_by_expert"])
def test_stacked_quantized_experts_dequantize_as_each_expert_does(fmt, chunk, monkeypatch):
    """The accelerator path holds each layer's routed experts stacked as stored ([E, out, in] values and scales) and
    dequantizes the stack for a step (a few experts at a time: DEQUANT_CHUNK_VALUES): every expert's matrix must
    come out as its own dequantize gives it."""
    import npu.quant
    from npu.deepseek_v4.expert_stacks import stack_experts
    monkeypatch.setattr(npu.quant, "DEQUANT_CHUNK_VALUES", chunk)
    gen = torch.Generator().manual_seed(3)
    held = {}
    for e in range(3):
        for w, shape in (("w1", (64, 256)), ("w3", (64, 256)), ("w2", (256, 64))):
            dense = torch.randn(shape, generator=gen) * 0.1
            values, scale = quantize_fp4(dense) if fmt == "fp4" else quantize_fp8(dense, 128)
            name = f"layers.0.ffn.experts.{e}.{w}.weight"
            held[name] = QuantizedWeight(name, values, scale, 128).check()
    expected = {name: w.dequantize(torch.bfloat16) for name, w in held.items()}
    stacks = stack_experts(held)
    assert list(stacks) == ["layers.0.ffn."] and not held
    for which, stacked in zip(("w1", "w3", "w2"), stacks["layers.0.ffn."]):
        got = stacked.dequantize(torch.bfloat16)
        for e in range(3):
            assert torch.equal(got[e], expected[f"layers.0.ffn.experts.{e}.{which}.weight"])
