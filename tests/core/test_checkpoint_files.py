"""Checkpoint files checked before the port is bound, without torch: the directory, config.json, every
safetensors header, and the tokenizer; each fault names the file and the fix."""

import dataclasses
import json
import subprocess
import sys

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.checkpoint_files import check_checkpoint_files, read_tensor_headers
from appliance.core.errors import CheckpointError, StartupError, TokenizerError
from appliance.core.tokenizer import load_tokenizer_for
from npu.qwen3.runner import Qwen3Runner
from tests.support.checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen3_tiny():
    return load_runtime_config(["+model=qwen3_tiny"]).model


@pytest.fixture
def checkpoint(tmp_path, qwen3_tiny):
    path = write_tiny_checkpoint(tmp_path / "ckpt", qwen3_tiny, seed=3)
    return path, dataclasses.replace(qwen3_tiny, weights=str(path))


def fault(model) -> str:
    with pytest.raises(CheckpointError) as err:
        check_checkpoint_files(model)
    assert isinstance(err.value, StartupError) and "Fix:" in str(err.value)
    return str(err.value)


def test_an_intact_checkpoint_passes_and_its_headers_list_every_tensor(checkpoint):
    path, model = checkpoint
    check_checkpoint_files(model)
    headers = read_tensor_headers(path)
    expected = Qwen3Runner(model, "cpu").expected_weights()
    assert {n: h.shape for n, h in headers.items()} == {n: tuple(shape) for n, (shape, _) in expected.items()}
    assert all(h.file == path / "model.safetensors" and h.dtype == "F32" for h in headers.values())
    assert load_tokenizer_for(model).vocab_size == model.layout.vocab_size


def test_a_missing_weights_directory_is_reported_as_the_directory_not_the_tokenizer(checkpoint, tmp_path):
    _, model = checkpoint
    msg = fault(dataclasses.replace(model, weights=str(tmp_path / "nope")))
    assert f"checkpoint directory '{tmp_path / 'nope'}' (model.weights) does not exist" in msg
    assert "tokenizer" not in msg.split("Fix:")[0]


@pytest.mark.parametrize("content,words", [
    (None, ["has no config.json", "Fix: copy"]),
    ("{not json", ["config.json' is not readable JSON"]),
    ("[1, 2]", ["holds a JSON list, not an object"]),
    ("null", ["holds a JSON null, not an object"]),
])
def test_config_json_missing_or_unreadable(checkpoint, content, words):
    path, model = checkpoint
    if content is None:
        (path / "config.json").unlink()
    else:
        (path / "config.json").write_text(content)
    msg = fault(model)
    assert all(w in msg for w in words), msg


def test_config_json_disagreeing_with_the_layout_names_the_key_and_the_fix(checkpoint):
    path, model = checkpoint
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "hidden_size": cfg["hidden_size"] * 2}))
    msg = fault(model)
    assert f"model.layout.hidden_size={cfg['hidden_size']} but config.json hidden_size={cfg['hidden_size'] * 2}" in msg


@pytest.mark.parametrize("damage", ["zero", "truncated", "garbage"])
def test_unreadable_safetensors_names_the_file(checkpoint, damage):
    path, model = checkpoint
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"zero": b"", "truncated": data[: len(data) // 2], "garbage": b"\x00\x01" * 100}[damage])
    msg = fault(model)
    assert f"checkpoint file '{f}'" in msg and "is not a readable safetensors file" in msg


def test_missing_safetensors_and_tensors_stored_twice(checkpoint):
    path, model = checkpoint
    f = path / "model.safetensors"
    (path / "copy.safetensors").write_bytes(f.read_bytes())
    assert "stores tensors twice" in fault(model)
    (path / "copy.safetensors").unlink()
    f.unlink()
    assert "holds no *.safetensors file" in fault(model)


@pytest.mark.parametrize("content,words", [
    (None, ["tokenizer.json' does not exist", "model.tokenizer"]),
    ("{}", ["cannot be loaded"]),
    ("not json at all", ["cannot be loaded"]),
])
def test_missing_or_bad_tokenizer_names_the_file(checkpoint, content, words):
    path, model = checkpoint
    if content is None:
        (path / "tokenizer.json").unlink()
    else:
        (path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError) as err:
        load_tokenizer_for(model)
    msg = str(err.value)
    assert str(path / "tokenizer.json") in msg and "Fix:" in msg and all(w in msg for w in words), msg


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(checkpoint):
    _, model = checkpoint
    small = dataclasses.replace(model, layout=dataclasses.replace(model.layout, vocab_size=300))
    with pytest.raises(TokenizerError, match="has 512 ids but model.layout.vocab_size is 300"):
        load_tokenizer_for(small)


def test_the_file_checks_need_no_torch(checkpoint):
    path, _ = checkpoint
    code = ("import sys; from appliance.config.compose import load_runtime_config; "
            "from appliance.core.checkpoint_files import check_checkpoint_files; "
            f"check_checkpoint_files(load_runtime_config(['+model=qwen3_tiny', 'model.weights={path}']).model); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
