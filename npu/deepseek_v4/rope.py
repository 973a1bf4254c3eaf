"""DeepSeek V4 RoPE: interleaved pairs of the trailing qk_rope_head_dim channels of a head.

Window-only layers rotate with rope_theta; compressed layers (and their compressors and indexer) with
compress_rope_theta and YaRN (frequency interpolation between beta_fast and beta_slow; no attention
scaling, as released). The attention output's rope channels are rotated back (inverse) at the query position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from appliance.core.archs.deepseek_v4.layout import DeepseekV4Layout
from npu.deepseek_v4.rope_triton import rotate, rotation_kernel_applies


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def yarn_inv_freq(theta: float, dim: int, factor: float, original_max_positions: int, beta_fast: float,
                  beta_slow: float) -> torch.Tensor:
    """YaRN: the slow frequencies (past the correction range) are divided by `factor`, the fast ones kept,
    with a linear ramp between (bounds truncated to whole dimensions)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    keep = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


@dataclass(frozen=True)
class Rotation:
    """RoPE at fixed positions (cos and sin computed once, reused by every layer of a step)."""

    cos: torch.Tensor           # [N, dim], each angle repeated for its pair
    sin: torch.Tensor           # [N, dim], the pair's first channel negated: rotates (a, b) as (b, a) x sin
    inverse_sin: torch.Tensor   # -sin, for rotating back
    fused: bool = False         # one launch per rotation (npu/deepseek_v4/rope_triton.py: a CUDA device with Triton)

    def apply(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the trailing `dim` channels of x [N, ..., width] (pairs 2i, 2i + 1); inverse rotates back.
        Pair (a, b) -> (a cos - b sin, b cos + a sin): the swapped pair (b, a) times the signed sin gives the
        second products, (-b) sin computed as b (-sin), which is the same number."""
        sin = self.inverse_sin if inverse else self.sin
        if self.fused:
            return rotate(x, self.cos, sin)
        dim = self.cos.shape[-1]
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (dim,)
        keep, rope = x[..., : x.shape[-1] - dim], x[..., x.shape[-1] - dim:]
        swapped = rope.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        rotated = (rope.float() * self.cos.view(shape) + swapped.float() * sin.view(shape)).to(x.dtype)
        return torch.cat([keep, rotated], dim=-1)


@dataclass(frozen=True)
class Rope:
    inv_freq: torch.Tensor      # [dim / 2] float32, on the compute device
    dtype: torch.dtype          # cos / sin are rounded to the compute dtype, as the released math does

    def at(self, pos: torch.Tensor) -> Rotation:
        angle = pos.to(torch.float32)[:, None] * self.inv_freq                  # [N, dim / 2]
        sin = angle.sin().to(self.dtype)
        signed = torch.stack((-sin, sin), dim=-1).flatten(-2)
        return Rotation(angle.cos().to(self.dtype).repeat_interleave(2, dim=-1), signed, -signed,
                        rotation_kernel_applies(pos.device))


def layer_ropes(layout: DeepseekV4Layout, device: torch.device, dtype: torch.dtype) -> dict[bool, Rope]:
    """{False: window-only layers' RoPE, True: compressed layers' RoPE (YaRN when the layout sets it)}."""
    dim = layout.qk_rope_head_dim
    factor, original = layout.yarn_factor, layout.yarn_original_max_position_embeddings   # both or neither (rules)
    compress = (yarn_inv_freq(layout.compress_rope_theta, dim, factor, original, layout.yarn_beta_fast,
                              layout.yarn_beta_slow)
                if factor and original is not None else default_inv_freq(layout.compress_rope_theta, dim))
    return {False: Rope(default_inv_freq(layout.rope_theta, dim).to(device), dtype),
            True: Rope(compress.to(device), dtype)}
