"""A checkpoint directory's files, checked without torch and without reading any tensor data.

A checkpoint is a directory with config.json, one or more *.safetensors files and (unless model.tokenizer
points elsewhere) tokenizer.json. `check_checkpoint_files` runs before a server binds its port: the directory
exists, config.json agrees with model.layout, and every safetensors header parses (a zero-byte, truncated or
corrupt file is named). `read_tensor_headers` is also what the weight loader checks names and shapes with.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from appliance.core.checkpoint_config import check_checkpoint_config
from appliance.core.config import ModelSpec
from appliance.core.errors import CheckpointError


@dataclass(frozen=True)
class TensorHeader:
    """One tensor as a safetensors header declares it."""

    shape: tuple[int, ...]
    dtype: str                 # safetensors' name: F32, BF16, F8_E4M3, ...
    file: Path


def stored_shape(shape: list[int], dtype: str) -> tuple[int, ...]:
    """A tensor's shape as torch holds it: safetensors counts F4 in 4-bit values, torch packs two per byte
    (float4_e2m1fn_x2), so the last dimension halves."""
    if dtype == "F4":
        return (*shape[:-1], shape[-1] // 2)
    return tuple(shape)


def checkpoint_dir(weights: str | Path) -> Path:
    """The directory model.weights names; a missing one is reported as such (not as a missing file inside it)."""
    root = Path(weights)
    if not root.is_dir():
        what = "is a file, not a directory" if root.exists() else "does not exist"
        raise CheckpointError(f"checkpoint directory {str(root)!r} (model.weights) {what}. Fix: set model.weights "
                              f"to a directory holding config.json, *.safetensors and tokenizer.json, "
                              f"or model.weights=random")
    return root


def safetensors_files(weights: str | Path) -> list[Path]:
    root = checkpoint_dir(weights)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint directory {str(root)!r} (model.weights) holds no *.safetensors file. "
                              f"Fix: point model.weights at the directory the weights were saved to")
    return files


def read_tensor_headers(weights: str | Path) -> dict[str, TensorHeader]:
    """Every tensor the directory's safetensors files declare, from their headers only (no torch, no data read).

    A file whose header does not parse, or whose data does not cover what the header declares (zero-byte,
    truncated, corrupt), is a CheckpointError naming the file; so is a tensor stored in two files.
    """
    from safetensors import SafetensorError, safe_open

    found: dict[str, TensorHeader] = {}
    duplicates: list[str] = []
    for path in safetensors_files(weights):
        size = path.stat().st_size
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    if name in found:
                        duplicates.append(f"{name} (in {found[name].file.name} and {path.name})")
                    found[name] = TensorHeader(stored_shape(piece.get_shape(), piece.get_dtype()), piece.get_dtype(),
                                               path)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(
                f"checkpoint file {str(path)!r} ({size:,} bytes) is not a readable safetensors file: {exc}. "
                f"Fix: copy or convert the checkpoint again (a zero-byte or truncated file is an interrupted "
                f"download or copy)") from None
    if duplicates:
        raise CheckpointError(f"checkpoint {str(weights)!r} stores tensors twice: {', '.join(duplicates)}. "
                              f"Fix: remove the stale file")
    return found


def check_checkpoint_files(model: ModelSpec) -> None:
    """model.weights as a checkpoint: the directory, its config.json against model.layout, every safetensors
    header. Nothing to check for weights=random."""
    if model.weights == "random":
        return
    checkpoint_dir(model.weights)
    check_checkpoint_config(model.weights, model)
    read_tensor_headers(model.weights)
