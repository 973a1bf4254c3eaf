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

from appliance.core.checkpoint_files import TensorHeader, read_tensor_headers
from appliance.core.errors import CheckpointError
from appliance.core.parallel import TensorSlice

log = logging.getLogger("npu.weights")

Expected = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
RANDN_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)   # dtypes torch.randn samples in
PROGRESS_DELAY_S = 1.0

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


def _fp4_dtype_problems(expected: Expected, dtypes: Mapping[str, str]) -> list[str]:
    """FP4 tensors stored as anything but FP4 or its bytes (headers only): no cast makes two e2m1 per byte."""
    return [f"  wrong dtype {name}: stored {dtypes[name]}, expected F4 (or its bytes as U8)"
            for name, (_, dtype) in expected.items()
            if dtype == torch.float4_e2m1fn_x2 and name in dtypes and dtypes[name] not in ("F4", "U8", "I8")]


def _mismatch_report(where: str, expected: Expected, found: Mapping[str, TensorHeader]) -> str | None:
    """Every missing, unexpected and misshapen tensor of a checkpoint against a runner's expected weights."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshapen = sorted(n for n in set(expected) & set(found) if tuple(expected[n][0]) != found[n].shape)
    if not (missing or unexpected or misshapen):
        return None
    lines = [f"checkpoint {where} does not match the model: {len(missing)} missing, {len(unexpected)} unexpected, "
             f"{len(misshapen)} misshapen tensor(s)"]
    lines += [f"  missing    {n}: expected shape {list(expected[n][0])}" for n in missing]
    lines += [f"  unexpected {n}: shape {list(found[n].shape)} in {found[n].file.name}" for n in unexpected]
    lines += [f"  misshapen  {n}: expected shape {list(expected[n][0])}, found {list(found[n].shape)} in "
              f"{found[n].file.name}" for n in misshapen]
    lines.append("Fix: point model.weights at a checkpoint of this model, or pick the model YAML it was made for")
    return "\n".join(lines)


def check_checkpoint_tensors(checkpoint_dir: str | Path, expected: Expected) -> dict[str, TensorHeader]:
    """The checkpoint's tensor headers, checked against a runner's expected weights from the headers alone (no
    data read): one CheckpointError listing every missing, unexpected and misshapen tensor."""
    headers = read_tensor_headers(checkpoint_dir)
    problem = _mismatch_report(str(checkpoint_dir), expected, headers)
    if problem:
        raise CheckpointError(problem)
    return headers


def non_finite_values(t: torch.Tensor) -> int:
    """How many NaN or inf values a tensor holds (0 for integer tensors and FP4, which encodes neither)."""
    if not t.is_floating_point() or t.dtype == torch.float4_e2m1fn_x2:
        return 0
    if t.numel() == 0:
        return 0
    if t.element_size() == 1:      # float8: isfinite has no kernel; bfloat16 holds every float8 value exactly
        t = t.to(torch.bfloat16)
    # One reduction with no tensor-sized temporary (isfinite's bool copy is fresh memory, page-faulted on every
    # load: it cost more than reading the checkpoint): NaN propagates into both extremes, so finite extremes
    # mean every value is finite. The count runs only for a tensor that is refused anyway.
    if all(torch.isfinite(v) for v in torch.aminmax(t)):
        return 0
    return int(t.numel() - torch.isfinite(t).sum().item())


def held_shapes(expected: Expected, held: Mapping[str, TensorSlice | None]) -> Expected:
    """The tensors a rank holds at the shapes it holds them (its slice of a divided one)."""
    return {name: (tuple(expected[name][0]) if part is None else part.shape_of(tuple(expected[name][0])),
                   expected[name][1]) for name, part in held.items()}


def shard(t: torch.Tensor, part: TensorSlice | None) -> torch.Tensor:
    """The part of `t` a rank holds (a copy: the whole tensor is not kept alive by a view), or `t` itself."""
    return t if part is None else t.narrow(part.dim, part.start, part.stop - part.start).clone()


def load_state_dict(checkpoint_dir: str | Path, expected: Expected, device: torch.device | str,
                    progress: bool = True, held: Mapping[str, TensorSlice | None] | None = None
                    ) -> dict[str, torch.Tensor]:
    """Every expected tensor from the directory's safetensors files, cast to its expected dtype, on `device`.

    Names and shapes of every file are checked first (headers only), so a bad checkpoint fails before
    any data is read, with one error listing every problem. Then tensors are read one at a time and cast to
    their target dtype on the device, so at most one tensor exists in its stored dtype at a time; a tensor
    holding NaN or inf (after the cast: an fp32 value too large for fp16 becomes inf) is refused by name.

    `held` (a rank's share: name -> None for the whole tensor or the slice it holds) reads only those tensors,
    and of a sliced one only its slice; the others belong to other ranks, which check their own.
    """
    from safetensors import safe_open

    headers = check_checkpoint_tensors(checkpoint_dir, expected)
    wrong = _fp4_dtype_problems(expected, {name: h.dtype for name, h in headers.items()})
    if wrong:
        raise CheckpointError(f"checkpoint {checkpoint_dir}: {len(wrong)} FP4 tensor(s) in the wrong dtype\n"
                              + "\n".join(wrong) + "\nFix: store FP4 experts as F4 (or their bytes as U8), "
                              "two values per byte, low nibble first")
    device = torch.device(device)
    held = dict.fromkeys(expected) if held is None else held
    out: dict[str, torch.Tensor] = {}
    files = sorted({h.file for h in headers.values()})
    bar = progress_bar(len(held), "loading weights", progress)
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name not in held:
                    continue
                part = held[name]
                raw = f.get_tensor(name) if part is None else \
                    f.get_slice(name)[(slice(None),) * part.dim + (slice(part.start, part.stop),)]
                # copy=True: never keep a view of the memory-mapped file (it is closed after this block).
                t = as_expected_dtype(raw, expected[name][1]).to(device=device, copy=True)
                bad = non_finite_values(t)
                if bad:
                    raise CheckpointError(
                        f"checkpoint tensor {name} in {str(path)!r} holds {bad:,} NaN or inf value(s) of "
                        f"{t.numel():,} (as {str(t.dtype).removeprefix('torch.')}). Fix: use an intact checkpoint; "
                        f"a conversion that overflowed (e.g. fp32 to fp16) must be redone")
                out[name] = t
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


def _random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, expected: Expected, seed: int,
                   std: float, device: torch.device) -> torch.Tensor:
    """One tensor made where it will live, by a generator of that device seeded from (seed, name): on a GPU the
    Qwen3-8B layout's 16 GB take seconds, where the host's generator and a copy took minutes. Values depend on
    the device kind's generator (the CPU's and CUDA's differ), never on the other tensors or the rank."""
    if dtype == torch.float8_e8m0fnu:       # block scales: 1, or about std for FP4 values (which reach 6)
        values = expected.get(name.removesuffix(".scale") + ".weight", ((), None))[1]
        exponent = round(math.log2(std)) if values == torch.float4_e2m1fn_x2 else 0
        return torch.full(shape, 127 + exponent, dtype=torch.uint8, device=device).view(dtype)
    if is_norm_weight(name):
        return torch.ones(shape, dtype=dtype, device=device)
    if dtype != torch.float4_e2m1fn_x2 and (not dtype.is_floating_point or is_norm_bias(name)):
        return torch.zeros(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(random_seed(seed, name))
    if dtype == torch.float4_e2m1fn_x2:     # random e2m1 codes, two per byte
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8, device=device).view(dtype)
    sample_dtype = dtype if dtype in RANDN_DTYPES else torch.bfloat16
    return torch.randn(shape, generator=gen, dtype=sample_dtype, device=device).mul_(std).to(dtype)


def random_seed(seed: int, name: str) -> int:
    """The generator seed of tensor `name` under the model seed `seed`."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def random_state_dict(expected: Expected, seed: int, device: torch.device | str,
                      std: float = 0.02, progress: bool = True,
                      held: Mapping[str, TensorSlice | None] | None = None) -> dict[str, torch.Tensor]:
    """Seeded normal(0, std) weights; norm gains 1, norm biases and integer tensors 0; quantized formats get
    random values with scales of about std. On the meta device: shapes and dtypes only, no memory.

    Each tensor's generator is seeded from (seed, name), so a tensor's values do not depend on which
    other tensors the model has or the order they are listed in (nor on which rank makes it: `held`, a
    rank's share as in load_state_dict, makes only those tensors and keeps only its slice). Tensors are made
    one at a time on the device by its own generator, in their target dtype (float8 ones through bfloat16,
    which randn supports), and a rank's slice is cut at once, so no more than one whole tensor beyond the ones
    already placed ever exists: never a float32 copy of a model, never a host copy of a device's weights.
    """
    device = torch.device(device)
    held = dict.fromkeys(expected) if held is None else held
    if device.type == "meta":
        return {name: torch.empty(shape, dtype=dtype, device=device)
                for name, (shape, dtype) in held_shapes(expected, held).items()}
    out: dict[str, torch.Tensor] = {}
    bar = progress_bar(len(held), "making random weights", progress)
    for name in sorted(held):
        shape, dtype = expected[name]
        bar.update(1)
        out[name] = shard(_random_tensor(name, tuple(shape), dtype, expected, seed, std, device), held[name])
    bar.close()
    return out
