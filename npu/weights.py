"""Weights: load a safetensors checkpoint against a runner's expected tensors, or make seeded random ones.

A checkpoint directory holds config.json, one or more *.safetensors files and tokenizer.json. Runners
declare `expected_weights()` (name -> (shape, dtype)); both functions here return exactly those names,
so a checkpoint with a missing, extra or misshapen tensor fails once, naming every problem.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path
from typing import Mapping

import torch
from tqdm.auto import tqdm

from appliance.core.errors import CheckpointError

log = logging.getLogger("npu.weights")

Expected = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
PROGRESS_DELAY_S = 1.0


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
    duplicates: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in found:
                    duplicates.append(f"{name} (in {found[name][1].name} and {path.name})")
                found[name] = (tuple(f.get_slice(name).get_shape()), path)
    if duplicates:
        raise CheckpointError(f"checkpoint {checkpoint_dir} stores tensors twice: {', '.join(duplicates)}")
    problem = _mismatch_report(str(checkpoint_dir), expected, found)
    if problem:
        raise CheckpointError(problem)

    device = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    bar = progress_bar(len(expected), "loading weights", progress)
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                dtype = expected[name][1]
                # copy=True: never keep a view of the memory-mapped file (it is closed after this block).
                out[name] = t.to(device=device, dtype=dtype, copy=True)
                bar.update(1)
    bar.close()
    log.info("loaded %d tensors (%.1f MiB) from %d file(s) in %s", len(out),
             sum(t.numel() * t.element_size() for t in out.values()) / 2**20, len(files), checkpoint_dir)
    return out


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm:
    """A per-tensor bar on stderr for the long part of startup; shown only once loading has taken a second,
    so small models start without one."""
    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, leave=False, delay=PROGRESS_DELAY_S)


def is_norm_weight(name: str) -> bool:
    """RMSNorm / LayerNorm gains (a 'norm' module's weight): random weights set them to 1."""
    parts = name.split(".")
    return parts[-1] != "bias" and any("norm" in p for p in parts[-2:])


def is_norm_bias(name: str) -> bool:
    parts = name.split(".")
    return parts[-1] == "bias" and len(parts) > 1 and "norm" in parts[-2]


def random_state_dict(expected: Expected, seed: int, device: torch.device | str,
                      std: float = 0.02, progress: bool = True) -> dict[str, torch.Tensor]:
    """Seeded normal(0, std) weights; norm gains 1, norm biases and integer tensors 0.

    Each tensor's generator is seeded from (seed, name), so a tensor's values do not depend on which
    other tensors the model has or the order they are listed in.
    """
    device = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    bar = progress_bar(len(expected), "making random weights", progress)
    for name in sorted(expected):
        bar.update(1)
        shape, dtype = expected[name]
        if is_norm_weight(name):
            t = torch.ones(shape, dtype=torch.float32)
        elif dtype.is_floating_point and not is_norm_bias(name):
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            t = torch.randn(shape, generator=gen, dtype=torch.float32) * std
        else:
            t = torch.zeros(shape, dtype=torch.float32)
        out[name] = t.to(device=device, dtype=dtype)
    bar.close()
    return out
