"""Weights: load a safetensors checkpoint against a runner's expected tensors, or make seeded random ones.

A checkpoint directory holds config.json, one or more *.safetensors files and tokenizer.json. Runners
declare `expected_weights()` (name -> (shape, dtype)); both functions here return exactly those names,
so a checkpoint with a missing, extra or misshapen tensor fails once, naming every problem.
"""

from __future__ import annotations

import logging
import math
import zlib
from pathlib import Path
from typing import Mapping

import torch
from tqdm.auto import tqdm

from appliance.core.errors import CheckpointError

log = logging.getLogger("npu.weights")

Expected = Mapping[str, tuple[tuple[int, ...], torch.dtype]]

# One-byte formats of quantized checkpoints. A converter may store their bytes as uint8 / int8: those are
# reinterpreted, never converted numerically (which would turn the byte 0x38 into the value 56.0).
RAW_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2)
RAW_BYTE_DTYPES = (torch.uint8, torch.int8)


def as_expected_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`: the bytes of a quantized format stored as uint8 / int8 by reinterpreting, others by casting."""
    if t.dtype == dtype:
        return t
    if dtype in RAW_DTYPES and t.dtype in RAW_BYTE_DTYPES:
        return t.view(dtype)
    return t.to(dtype)


def _stored_shape(sl) -> tuple[int, ...]:
    """A tensor's shape as torch holds it: safetensors counts F4 in 4-bit elements, torch packs two per byte."""
    shape = tuple(sl.get_shape())
    if sl.get_dtype() == "F4":
        shape = (*shape[:-1], shape[-1] // 2)
    return shape


def _fp4_dtype_problems(expected: Expected, dtypes: Mapping[str, str]) -> list[str]:
    """FP4 tensors stored as anything but FP4 or its bytes (headers only): no cast makes two e2m1 per byte."""
    return [f"  wrong dtype {name}: stored {dtypes[name]}, expected F4 (or its bytes as U8)"
            for name, (_, dtype) in expected.items()
            if dtype == torch.float4_e2m1fn_x2 and name in dtypes and dtypes[name] not in ("F4", "U8", "I8")]


def safetensors_files(checkpoint_dir: str | Path) -> list[Path]:
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist (model.weights)")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint directory {str(root)!r} holds no *.safetensors file")
    return files


def _mismatch_report(where: str, expected: Expected, found: Mapping[str, tuple[tuple[int, ...], Path]]) -> str | None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshapen = sorted(n for n in set(expected) & set(found) if tuple(expected[n][0]) != found[n][0])
    if not (missing or unexpected or misshapen):
        return None
    lines = [f"checkpoint {where} does not match the model: {len(missing)} missing, {len(unexpected)} unexpected, "
             f"{len(misshapen)} misshapen tensor(s)"]
    lines += [f"  missing    {n}: expected shape {list(expected[n][0])}" for n in missing]
    lines += [f"  unexpected {n}: shape {list(found[n][0])} in {found[n][1].name}" for n in unexpected]
    lines += [f"  misshapen  {n}: expected shape {list(expected[n][0])}, found {list(found[n][0])} in "
              f"{found[n][1].name}" for n in misshapen]
    return "\n".join(lines)


def load_state_dict(checkpoint_dir: str | Path, expected: Expected, device: torch.device | str,
                    progress: bool = True) -> dict[str, torch.Tensor]:
    """Every expected tensor from the directory's safetensors files, cast to its expected dtype, on `device`.

    Names and shapes of every file are checked first (headers only), so a bad checkpoint fails before
    any data is read, with one error listing every problem.
    """
    from safetensors import safe_open

    files = safetensors_files(checkpoint_dir)
    found: dict[str, tuple[tuple[int, ...], Path]] = {}
    dtypes: dict[str, str] = {}
    duplicates: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in found:
                    duplicates.append(f"{name} (in {found[name][1].name} and {path.name})")
                sl = f.get_slice(name)
                found[name], dtypes[name] = (_stored_shape(sl), path), sl.get_dtype()
    if duplicates:
        raise CheckpointError(f"checkpoint {checkpoint_dir} stores tensors twice: {', '.join(duplicates)}")
    problem = _mismatch_report(str(checkpoint_dir), expected, found)
    if problem:
        raise CheckpointError(problem)
    wrong = _fp4_dtype_problems(expected, dtypes)
    if wrong:
        raise CheckpointError(f"checkpoint {checkpoint_dir}: {len(wrong)} FP4 tensor(s) in the wrong dtype\n"
                              + "\n".join(wrong))

    device = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    bar = tqdm(total=len(expected), desc="loading weights", unit="tensor", disable=not progress, leave=False)
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = as_expected_dtype(f.get_tensor(name), expected[name][1])
                # copy=True: never keep a view of the memory-mapped file (it is closed after this block).
                out[name] = t.to(device=device, copy=True)
                bar.update(1)
    bar.close()
    log.info("loaded %d tensors (%.1f MiB) from %d file(s) in %s", len(out),
             sum(t.numel() * t.element_size() for t in out.values()) / 2**20, len(files), checkpoint_dir)
    return out


def is_norm_weight(name: str) -> bool:
    """RMSNorm / LayerNorm gains (a 'norm' module's weight): random weights set them to 1."""
    parts = name.split(".")
    return parts[-1] != "bias" and any("norm" in p for p in parts[-2:])


def is_norm_bias(name: str) -> bool:
    parts = name.split(".")
    return parts[-1] == "bias" and len(parts) > 1 and "norm" in parts[-2]


def _random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, expected: Expected, seed: int,
                   std: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    if dtype == torch.float8_e8m0fnu:       # block scales: 1, or about std for FP4 values (which reach 6)
        values = expected.get(name.removesuffix(".scale") + ".weight", ((), None))[1]
        exponent = round(math.log2(std)) if values == torch.float4_e2m1fn_x2 else 0
        return torch.full(shape, 127 + exponent, dtype=torch.uint8).view(dtype)
    if dtype == torch.float4_e2m1fn_x2:     # random e2m1 codes, two per byte
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype)
    if is_norm_weight(name):
        return torch.ones(shape, dtype=torch.float32).to(dtype)
    if dtype.is_floating_point and not is_norm_bias(name):
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(dtype)
    return torch.zeros(shape, dtype=dtype)


def random_state_dict(expected: Expected, seed: int, device: torch.device | str,
                      std: float = 0.02) -> dict[str, torch.Tensor]:
    """Seeded normal(0, std) weights; norm gains 1, norm biases and integer tensors 0; quantized formats get
    random values with scales of about std. On the meta device: shapes and dtypes only, no memory.

    Each tensor's generator is seeded from (seed, name), so a tensor's values do not depend on which
    other tensors the model has or the order they are listed in.
    """
    device = torch.device(device)
    if device.type == "meta":
        return {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in expected.items()}
    return {name: _random_tensor(name, tuple(shape), dtype, expected, seed, std).to(device)
            for name, (shape, dtype) in sorted(expected.items())}
