"""The elementwise parts of a Qwen3 layer, as torch ops or as fused CPU kernels behind one interface.

A decoder layer's norms, q/k norm + RoPE and SiLU-and-mul are each several torch ops on CPU, every one a
pass over the activations with its own dispatch: in a 64-row bf16 decode step of the benchmark model the
nine [64, 512] RMS norms alone took 1.1 of 12.8 ms. `CpuFusedNorms` runs each as one pass of a C++ kernel
(npu/kernels/norms.cpp, built by npu.cpu_kernels), rounding where torch rounds, so bf16 outputs match the
torch ops to the bit except where a float32 sum is added in another order. `TorchNorms` is the same four
operations in torch, what every other device (and a CPU without a compiler) runs.

    rms_norm(x, w)                  -> rms_norm(x) * w                       (a new tensor)
    add_rms_norm_(x, delta, w)      -> x += delta in place; returns rms_norm(x) * w
    qk_norm_rope_(qkv, heads, w, rope): the first heads x head_dim columns of each row, in place: each head
                                       RMS-normed, times its row of w [heads, head_dim], then rotated with
                                       rope [rows, 2, head_dim] (cos, then the signed sin -sin | sin)
    silu_and_mul(gate_up)           -> silu(gate) * up for gate_up = [rows, gate | up]
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from npu.cpu_kernels import entry, kernels_for, ptr


class TorchNorms:
    def __init__(self, eps: float):
        self.eps = eps

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def add_rms_norm_(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(x.add_(delta), weight)

    def qk_norm_rope_(self, qkv: torch.Tensor, heads: int, weight: torch.Tensor, rope: torch.Tensor) -> None:
        n, hd = qkv.shape[0], weight.shape[-1]
        qk = qkv[:, :heads * hd].view(n, heads, hd)
        t = F.rms_norm(qk, (hd,), eps=self.eps).mul_(weight)
        cos, sin = rope.unsqueeze(2).unbind(1)             # [n, 1, head_dim] each
        # rotate_half(x) * sin == swap_halves(x) * (-sin | sin): one flip instead of slices, neg and cat
        swapped = t.view(n, heads, 2, hd // 2).flip(2).view(n, heads, hd)
        torch.add(t.mul_(cos), swapped.mul_(sin), out=qk)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, -1)
        return F.silu(gate).mul_(up)


class CpuFusedNorms(TorchNorms):
    """The kernels, on contiguous float32 or bfloat16 CPU tensors (anything else goes to the torch ops)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, eps: float):
        super().__init__(eps)
        self.dtype = dtype
        self.c_eps = ctypes.c_float(eps)
        self.norm, self.add_norm, self.rope, self.silu = (entry(lib, name, dtype) for name in (
            "rms_norm", "add_rms_norm", "qk_norm_rope", "silu_and_mul"))

    def _fits(self, *tensors: torch.Tensor) -> bool:
        return all(t.dtype == self.dtype and t.is_contiguous() and t.device.type == "cpu" for t in tensors)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not (x.dim() == 2 and weight.shape == (x.shape[1],) and self._fits(x, weight)):
            return super().rms_norm(x, weight)
        out = torch.empty_like(x)
        self.norm(ptr(x), ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.shape[1]), ptr(weight), self.c_eps, ptr(out),
                  ctypes.c_int(torch.get_num_threads()))
        return out

    def add_rms_norm_(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not (x.dim() == 2 and delta.shape == x.shape and weight.shape == (x.shape[1],)
                and self._fits(x, delta, weight)):
            return super().add_rms_norm_(x, delta, weight)
        out = torch.empty_like(x)
        self.add_norm(ptr(x), ptr(delta), ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.shape[1]), ptr(weight),
                      self.c_eps, ptr(out), ctypes.c_int(torch.get_num_threads()))
        return out

    def qk_norm_rope_(self, qkv: torch.Tensor, heads: int, weight: torch.Tensor, rope: torch.Tensor) -> None:
        hd = weight.shape[-1]
        if not (qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] >= heads * hd and hd % 2 == 0
                and weight.shape == (heads, hd) and rope.shape == (qkv.shape[0], 2, hd)
                and qkv.dtype == self.dtype and self._fits(weight, rope)):
            return super().qk_norm_rope_(qkv, heads, weight, rope)
        self.rope(ptr(qkv), ctypes.c_int64(qkv.shape[0]), ctypes.c_int64(qkv.stride(0)), ctypes.c_int64(heads),
                  ctypes.c_int64(hd), ptr(weight), ptr(rope), self.c_eps, ctypes.c_int(torch.get_num_threads()))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not (gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and self._fits(gate_up)):
            return super().silu_and_mul(gate_up)
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=gate_up.dtype)
        self.silu(ptr(gate_up), ctypes.c_int64(rows), ctypes.c_int64(inter), ptr(out),
                  ctypes.c_int(torch.get_num_threads()))
        return out


def layer_norms(device: torch.device, dtype: torch.dtype, eps: float) -> TorchNorms:
    """The fused kernels where they apply (a CPU runner in float32 or bfloat16 with the kernels built), else
    the torch ops (npu.cpu_kernels logs why)."""
    lib = kernels_for(device, dtype, "RMS norm, RoPE and SiLU")
    return TorchNorms(eps) if lib is None else CpuFusedNorms(lib, dtype, eps)
