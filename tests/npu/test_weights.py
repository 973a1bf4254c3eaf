"""Weights (random + safetensors loading with one clear error), tiny checkpoints, and the built tokenizer."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from appliance.config.compose import load_runtime_config
from appliance.core.checkpoint_config import check_checkpoint_config
from appliance.core.errors import CheckpointError
from appliance.core.tokenizer import EOS, SPECIAL_TOKENS, Tokenizer, load_tokenizer_for
from npu.qwen3.runner import Qwen3Runner
from npu.weights import load_state_dict, random_state_dict
from tests.support.checkpoints import write_tiny_checkpoint

EXPECTED = {
    "emb.weight": ((40, 8), torch.float32),
    "layers.0.attn_norm.weight": ((8,), torch.float32),
    "layers.0.proj.weight": ((16, 8), torch.bfloat16),
    "norm.weight": ((8,), torch.float32),
}


def test_random_state_dict_is_seeded_shaped_and_norms_are_one():
    a = random_state_dict(EXPECTED, seed=3, device="cpu")
    b = random_state_dict(EXPECTED, seed=3, device="cpu")
    c = random_state_dict(EXPECTED, seed=4, device="cpu")
    assert set(a) == set(EXPECTED)
    for name, (shape, dtype) in EXPECTED.items():
        assert a[name].shape == shape and a[name].dtype == dtype
        assert torch.equal(a[name], b[name])
    assert torch.equal(a["norm.weight"], torch.ones(8)) and torch.equal(a["layers.0.attn_norm.weight"], torch.ones(8))
    assert not torch.equal(a["emb.weight"], c["emb.weight"])
    big = random_state_dict({"w": ((256, 256), torch.float32)}, seed=0, device="cpu", std=0.02)["w"]
    assert abs(big.std().item() - 0.02) < 0.001 and abs(big.mean().item()) < 0.001


def test_random_tensor_does_not_depend_on_the_other_tensors():
    alone = random_state_dict({"emb.weight": EXPECTED["emb.weight"]}, seed=3, device="cpu")
    assert torch.equal(alone["emb.weight"], random_state_dict(EXPECTED, seed=3, device="cpu")["emb.weight"])


def test_load_state_dict_round_trip_over_two_files_casts_to_expected_dtype(tmp_path):
    state = random_state_dict(EXPECTED, seed=1, device="cpu")
    names = sorted(state)
    save_file({n: state[n].float() for n in names[:2]}, str(tmp_path / "a.safetensors"))   # stored as fp32
    save_file({n: state[n] for n in names[2:]}, str(tmp_path / "b.safetensors"))
    loaded = load_state_dict(tmp_path, EXPECTED, "cpu", progress=False)
    assert set(loaded) == set(EXPECTED)
    for n in names:
        assert loaded[n].dtype == EXPECTED[n][1]
        assert torch.equal(loaded[n], state[n])


def test_load_state_dict_names_every_problem_at_once(tmp_path):
    state = random_state_dict(EXPECTED, seed=1, device="cpu")
    del state["norm.weight"]                                   # missing
    state["layers.0.proj.weight"] = torch.zeros(16, 9)         # misshapen
    state["layers.0.extra.bias"] = torch.zeros(3)              # unexpected
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_state_dict(tmp_path, EXPECTED, "cpu", progress=False)
    msg = str(err.value)
    assert "1 missing, 1 unexpected, 1 misshapen" in msg
    assert "missing    norm.weight: expected shape [8]" in msg
    assert "unexpected layers.0.extra.bias: shape [3] in model.safetensors" in msg
    assert "misshapen  layers.0.proj.weight: expected shape [16, 8], found [16, 9]" in msg


def test_load_state_dict_without_files_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="holds no \\*.safetensors file"):
        load_state_dict(tmp_path, EXPECTED, "cpu")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_state_dict(tmp_path / "nope", EXPECTED, "cpu")


@pytest.fixture(scope="module")
def qwen3_tiny():
    return load_runtime_config(["+model=qwen3_tiny"]).model


def test_tiny_checkpoint_holds_runner_weights_hf_config_and_tokenizer(tmp_path, qwen3_tiny):
    path = write_tiny_checkpoint(tmp_path, qwen3_tiny, seed=5)
    cfg = json.loads((path / "config.json").read_text())
    lay = qwen3_tiny.layout
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (
        lay.hidden_size, lay.num_layers, lay.num_kv_heads, lay.vocab_size)
    assert cfg["torch_dtype"] == "float32"
    runner = Qwen3Runner(qwen3_tiny, "cpu")
    expected = runner.expected_weights()
    loaded = load_state_dict(path, expected, "cpu", progress=False)
    ref = random_state_dict(expected, seed=5, device="cpu")
    assert all(torch.equal(loaded[n], ref[n]) for n in expected)
    tok = Tokenizer.from_file(path / "tokenizer.json")
    assert tok.vocab_size == lay.vocab_size and tok.eos_token_id == cfg["eos_token_id"] == tok.token_to_id(EOS)
    check_checkpoint_config(path, qwen3_tiny)                       # agrees with the layout


def test_checkpoint_config_disagreeing_with_layout_names_the_keys(tmp_path, qwen3_tiny):
    path = write_tiny_checkpoint(tmp_path, qwen3_tiny, seed=5)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(rope_theta=10000.0, num_hidden_layers=3)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        check_checkpoint_config(path, qwen3_tiny)
    assert "model.layout.num_layers=2 but config.json num_hidden_layers=3" in str(err.value)
    assert "model.layout.rope_theta=1000000.0 but config.json rope_theta=10000.0" in str(err.value)


def test_built_tokenizer_is_deterministic_with_exact_vocab_and_round_trips():
    a, b = Tokenizer.build(512), Tokenizer.build(512)
    assert a.to_json() == b.to_json()
    assert a.vocab_size == 512
    assert [a.token_to_id(t) for t in SPECIAL_TOKENS] == [a.bos_token_id, a.eos_token_id, a.pad_token_id]
    text = "The scheduler gives the request pages. Ünïcode — 日本語 🙂!"
    ids = a.encode(text)
    assert max(ids) < 512 and a.decode(ids) == text
    assert a.encode(text, add_bos=True) == [a.bos_token_id, *ids]
    assert a.decode([*ids, a.eos_token_id]) == text                 # special tokens skipped
    assert len(a.encode("the request")) < len("the request")        # merges were learned from the text
    assert Tokenizer.build(300).vocab_size == 300                   # few merges: reserved ids fill the vocab
    with pytest.raises(ValueError, match="too small for a byte-level tokenizer"):
        Tokenizer.build(200)


@pytest.mark.parametrize("use_stream", [True, False])
def test_incremental_detokenizer_never_splits_a_character(use_stream):
    tok = Tokenizer.build(512)
    text = "héllo wörld — 日本語 🙂 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.encode("utf-8")) // 2                # multi-byte chars span several ids
    det = tok.detokenizer(prompt_ids=tok.encode("prompt: "), use_decode_stream=use_stream)
    assert det.uses_decode_stream == use_stream
    deltas = [det.push(i) for i in ids]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas                                             # some ids completed no character


def test_load_tokenizer_for_random_and_checkpoint_models(tmp_path, qwen3_tiny):
    assert load_tokenizer_for(qwen3_tiny).to_json() == Tokenizer.build(qwen3_tiny.layout.vocab_size).to_json()
    path = write_tiny_checkpoint(tmp_path, qwen3_tiny, seed=0)
    tok = load_tokenizer_for(dataclasses.replace(qwen3_tiny, weights=str(path)))
    assert tok.source == str(path / "tokenizer.json")


# -- startup faults: unreadable files, NaN / inf, memory of random weights ---------------------------------

@pytest.mark.parametrize("damage,words", [
    (lambda data: b"", ["0 bytes", "header too small"]),
    (lambda data: data[:-100], ["incomplete metadata"]),
    (lambda data: b"\x07" * len(data), ["header too large"]),
])
def test_unreadable_safetensors_is_named_before_any_data_is_read(tmp_path, damage, words):
    state = random_state_dict(EXPECTED, seed=1, device="cpu")
    save_file({n: state[n] for n in ("emb.weight", "norm.weight")}, str(tmp_path / "a.safetensors"))
    save_file({n: state[n] for n in ("layers.0.attn_norm.weight", "layers.0.proj.weight")},
              str(tmp_path / "b.safetensors"))
    bad = tmp_path / "b.safetensors"
    bad.write_bytes(damage(bad.read_bytes()))
    with pytest.raises(CheckpointError) as err:
        load_state_dict(tmp_path, EXPECTED, "cpu", progress=False)
    msg = str(err.value)
    assert f"checkpoint file '{bad}'" in msg and "Fix:" in msg
    assert all(w in msg for w in words), msg


@pytest.mark.parametrize("value,stored,expected_dtype,what", [
    (float("nan"), torch.float32, torch.float32, "1 NaN or inf value(s)"),
    (float("inf"), torch.bfloat16, torch.bfloat16, "1 NaN or inf value(s)"),
    (1e6, torch.float32, torch.float16, "as float16"),                   # finite in fp32, inf once cast to fp16
    (float("nan"), torch.float32, torch.float8_e4m3fn, "as float8_e4m3fn"),
])
def test_weights_with_nan_or_inf_are_refused_naming_the_tensor(tmp_path, value, stored, expected_dtype, what):
    expected = {"emb.weight": ((4, 8), expected_dtype), "norm.weight": ((8,), torch.float32)}
    emb = torch.zeros(4, 8, dtype=stored)
    emb[2, 3] = value
    save_file({"emb.weight": emb, "norm.weight": torch.ones(8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_state_dict(tmp_path, expected, "cpu", progress=False)
    msg = str(err.value)
    assert msg.startswith("checkpoint tensor emb.weight in ") and "model.safetensors" in msg and what in msg
    emb[2, 3] = 0.5
    save_file({"emb.weight": emb, "norm.weight": torch.ones(8)}, str(tmp_path / "model.safetensors"))
    assert load_state_dict(tmp_path, expected, "cpu", progress=False)["emb.weight"].dtype == expected_dtype


def test_random_weights_are_made_one_tensor_at_a_time_in_their_target_dtype():
    """Never a float32 copy of the model: the host holds the finished tensors plus at most one sample."""
    from npu.cpu_memory import AllocationTracker

    expected = {f"layers.{i}.proj.weight": ((256, 512), torch.bfloat16) for i in range(6)}
    expected["layers.0.experts.w1.weight"] = ((256, 512), torch.float8_e4m3fn)   # sampled in bfloat16, then cast
    with AllocationTracker() as tracker:
        state = random_state_dict(expected, seed=0, device="cpu")
    final = sum(t.numel() * t.element_size() for t in state.values())
    one_bf16_sample = 256 * 512 * 2
    assert tracker.live_bytes >= final                      # the tracker saw every tensor being made
    assert tracker.peak_live_bytes <= final + one_bf16_sample
    assert all(state[n].dtype == dt for n, (_, dt) in expected.items())
    assert 0.015 < state["layers.3.proj.weight"].float().std().item() < 0.025
