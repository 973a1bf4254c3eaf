"""The quantized weight formats of released DeepSeek-V4 checkpoints, to and from the compute dtype.

- FP8: e4m3 values [out, in] with one ue8m0 scale per [b, b] block, scales [ceil(out / b), ceil(in / b)];
- FP4: e2m1 values, two per byte (low nibble = even column), [out, in / 2], with one ue8m0 scale per 32
  values of a row, scales [out, in / 32].
A ue8m0 scale byte e means 2 ** (e - 127); 0xFF is NaN in that format and never a valid scale, so it is an
error naming the tensor, not a silent NaN in the model. Quantizing (used to write checkpoints) picks power-of-
two scales, so values built as (representable value) x (power of two) survive a round trip exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from appliance.core.archs.deepseek_v4.weights import FP4_BLOCK
from appliance.core.errors import CheckpointError

FP8_MAX = 448.0        # largest finite e4m3 value
FP4_MAX = 6.0          # largest e2m1 value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
UE8M0_NAN = 0xFF


@dataclass(frozen=True)
class QuantizedWeight:
    """A matrix held as stored: values and ue8m0 scales, dequantized to the compute dtype when used. Values and
    scales may carry leading dimensions (a stack of experts [E, out, in]): each matrix dequantizes alike."""

    name: str
    values: torch.Tensor       # float8_e4m3fn [..., out, in] or float4_e2m1fn_x2 [..., out, in / 2]
    scale: torch.Tensor        # float8_e8m0fnu
    block: int                 # FP8: square block size; FP4: FP4_BLOCK values per scale along a row

    def check(self) -> "QuantizedWeight":
        """Raise CheckpointError now (at load) for a 0xFF scale, instead of NaNs when the layer runs (shape-only
        weights on the meta device have no values to check). The step's dequantize trusts the scales after this."""
        if self.scale.device.type != "meta":
            ue8m0_to_float(self.scale, self.name)
        return self

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The matrix (or stack) in `dtype`, computed on the values' device with no host sync (the scales were
        checked at load). A stack is dequantized a few matrices at a time into its output, so the float32
        temporaries stay near DEQUANT_CHUNK_VALUES values whatever the stack's size (256 experts of 2048 x 4096
        would otherwise take tens of GB of temporaries)."""
        if self.values.dim() == 2:
            return self._dequantize(self.values, self.scale, dtype)
        out = torch.empty(self.shape, dtype=dtype, device=self.values.device)
        step = max(1, DEQUANT_CHUNK_VALUES // max(1, self.shape[-2] * self.shape[-1]))
        for lo in range(0, out.shape[0], step):
            out[lo:lo + step] = self._dequantize(self.values[lo:lo + step], self.scale[lo:lo + step], dtype)
        return out

    def row_blocks(self, groups: int) -> "QuantizedWeight | None":
        """A matrix [groups * r, in] as the stack of its `groups` row blocks [groups, r, in] (each block's values
        and scales, no copy of the values), what a grouped GEMM reads as stored; None where an FP8 scale block
        would straddle two row blocks (neither r nor the scale block divides the other). FP4 scales are per row."""
        if self.values.dim() != 2 or self.values.shape[0] % groups:
            raise ValueError(f"{self.name}: {tuple(self.values.shape)} is not {groups} blocks of rows")
        rows = self.values.shape[0] // groups
        values = self.values.view(groups, rows, self.values.shape[1])
        if self.values.dtype == torch.float4_e2m1fn_x2:
            return QuantizedWeight(self.name, values, self.scale.view(groups, rows, -1), self.block)
        if rows % self.block and self.block % rows:
            return None
        # block j of row block g covers rows g * rows + j * block ...: one scale row each, as both sizes divide
        first = torch.arange(groups, device=self.scale.device)[:, None] * rows
        index = (first + torch.arange(0, rows, self.block, device=self.scale.device)[None]) // self.block
        picked = self.scale.view(torch.uint8)[index.flatten()].view(self.scale.dtype)   # bytes: indexable anywhere
        return QuantizedWeight(self.name, values, picked.view(groups, index.shape[1], -1), self.block)

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantized shape: FP4 packs two values per stored byte."""
        packed = 2 if self.values.dtype == torch.float4_e2m1fn_x2 else 1
        return (*self.values.shape[:-1], self.values.shape[-1] * packed)

    def _dequantize(self, values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if values.dtype == torch.float4_e2m1fn_x2:
            return dequantize_fp4(values, scale, dtype, check=False)
        return dequantize_fp8(values, scale, self.block, dtype, check=False)


# Values a stacked weight is dequantized at a time (each takes about 20 bytes of temporaries on the way).
DEQUANT_CHUNK_VALUES = 1 << 27


def ue8m0_to_float(scale: torch.Tensor, name: str) -> torch.Tensor:
    """Scales as float32 powers of two; a 0xFF byte (NaN in ue8m0) is a CheckpointError naming the tensor (a check
    that reads the values on the host: at load, never inside a step)."""
    bits = scale.view(torch.uint8)
    bad = bits == UE8M0_NAN
    if bad.any():
        where = tuple(bad.nonzero()[0].tolist())
        raise CheckpointError(f"{name}: ue8m0 scale byte 0xFF (NaN) at index {list(where)} "
                              f"({int(bad.sum())} such scale(s)); the checkpoint is corrupt or not ue8m0")
    return ue8m0_values(scale)


def ue8m0_values(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32 powers of two, unchecked (a 0xFF byte gives 2 ** 128 = inf): for scales checked at load."""
    return torch.exp2(scale.view(torch.uint8).to(torch.float32) - 127.0)


def float_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales (2 ** -127 .. 2 ** 127) as ue8m0 bytes."""
    exponent = torch.log2(scale).round().clamp(-127, 127)
    return (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (1 where x is 0), as ue8m0 scales are."""
    return torch.where(x > 0, torch.exp2(torch.ceil(torch.log2(x.clamp(min=2.0 ** -126)))), torch.ones_like(x))


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype,
                   name: str = "weight", check: bool = True) -> torch.Tensor:
    """e4m3 values [..., out, in] with one scale per [block, block] tile -> dtype (check: refuse 0xFF scales)."""
    out, inp = values.shape[-2:]
    s = ue8m0_to_float(scale, name) if check else ue8m0_values(scale)
    s = s.repeat_interleave(block, -2)[..., :out, :].repeat_interleave(block, -1)[..., :inp]
    return (values.to(torch.float32) * s).to(dtype)


def quantize_fp8(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, ue8m0 block scales): each [block, block] tile scaled by the power of two that fits its
    largest magnitude into e4m3."""
    out, inp = weight.shape
    w = weight.to(torch.float32)
    rows, cols = -(-out // block), -(-inp // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:out, :inp] = w
    amax = padded.view(rows, block, cols, block).abs().amax(dim=(1, 3))
    scale = _pow2_at_least(amax / FP8_MAX)
    full = scale.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    return (w / full).to(torch.float8_e4m3fn), float_to_ue8m0(scale)


def _e2m1_table(device: torch.device) -> torch.Tensor:
    """The 16 e2m1 values, made on `device` from one arange (no host data: nothing to upload inside a step)."""
    code = torch.arange(16, device=device)
    mantissa, exponent = code & 1, (code >> 1) & 3
    magnitude = torch.where(exponent == 0, mantissa * 0.5, (1 + mantissa * 0.5) * torch.exp2(exponent - 1.0))
    return torch.where(code >= 8, -magnitude, magnitude).to(torch.float32)


def dequantize_fp4(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, name: str = "weight",
                   check: bool = True) -> torch.Tensor:
    """e2m1 values two per byte [..., out, in / 2] with one scale per FP4_BLOCK values of a row -> dtype."""
    packed = values.view(torch.uint8)
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)      # low nibble first
    w = _e2m1_table(packed.device)[nibbles.long()]
    s = (ue8m0_to_float(scale, name) if check else ue8m0_values(scale)).repeat_interleave(FP4_BLOCK, -1)
    return (w * s).to(dtype)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e2m1 values two per byte, ue8m0 scales per 32 values of a row), each value rounded to the nearest
    e2m1 value after dividing by the power of two that fits the group's largest magnitude into e2m1."""
    out, inp = weight.shape
    w = weight.to(torch.float32).view(out, inp // FP4_BLOCK, FP4_BLOCK)
    scale = _pow2_at_least(w.abs().amax(dim=-1) / FP4_MAX)                              # [out, inp / 32]
    scaled = (w / scale[..., None]).view(out, inp)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=weight.device)
    codes = (scaled.abs()[..., None] - table[:8]).abs().argmin(dim=-1)                 # nearest magnitude 0..7
    codes = torch.where((scaled < 0) & (codes > 0), codes + 8, codes).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.float4_e2m1fn_x2), float_to_ue8m0(scale)
