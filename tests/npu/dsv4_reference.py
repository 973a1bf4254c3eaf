"""Plain, unpaged DeepSeek V4 reference: the oracle for npu/deepseek_v4.py.

It recomputes a whole sequence from its token ids with dense masks: no pages, no rings, no compressor
state, no steps. It implements the math described in npu/deepseek_v4.py's docstring independently
(nothing is imported from the runner), so a paging, ring, state or visibility bug in the runner shows
up as a mismatch here.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate the last width // 8 channels (even, at least 2) of x, NeoX halves; x [L, (heads,) width]."""
    width = x.shape[-1]
    dim = max(2, width // 8) // 2 * 2
    half = dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32) * 2 / dim)
    angle = pos.float()[:, None] * inv_freq                       # [L, half]
    if x.dim() == 3:
        angle = angle[:, None, :]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    rest, a, b = x[..., :width - dim], x[..., width - dim:width - half], x[..., width - half:]
    return torch.cat([rest, a * cos - b * sin, b * cos + a * sin], dim=-1)


class DeepseekV4Reference:
    """Logits of every position of a token sequence, and greedy generation by full recomputation."""

    def __init__(self, layout, weights: Mapping[str, torch.Tensor]):
        self.lay = layout
        self.w = {k: v.detach().to("cpu") for k, v in weights.items()}
        self.ratios = tuple(layout.compress_ratios[: layout.num_layers])
        nonzero = sorted({r for r in self.ratios if r})
        self.csa, self.hca = nonzero[0], nonzero[-1]

    def _compress(self, prefix: str, h: torch.Tensor, ratio: int) -> torch.Tensor:
        """[L // ratio, width]: one row per complete run of `ratio` tokens, at RoPE position i * ratio."""
        w, L = self.w, h.shape[0]
        kv = F.linear(h, w[prefix + "wkv.weight"]).float()
        gate = F.linear(h, w[prefix + "wgate.weight"]).float() + w[prefix + "ape"][torch.arange(L) % ratio]
        n = L // ratio
        kv, gate = (t[: n * ratio].view(n, ratio, t.shape[-1]) for t in (kv, gate))
        rows = (kv * gate.softmax(dim=1)).sum(dim=1).to(h.dtype)
        rows = _rms_norm(rows, w[prefix + "norm.weight"], self.lay.rms_norm_eps)
        return _rope(rows, torch.arange(n) * ratio, self.lay.rope_theta)

    def _topk_mask(self, layer: int, h: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """[L, C]: the index_topk visible compressed rows with the highest indexer score (ties: lower row)."""
        lay, w = self.lay, self.w
        p = f"layers.{layer}.attn.indexer."
        Hi, di, L = lay.index_num_heads, lay.index_head_dim, h.shape[0]
        keys = self._compress(p + "compressor.", h, self.csa)                       # [C, di]
        q = _rope(F.linear(h, w[p + "wq.weight"]).view(L, Hi, di), torch.arange(L), lay.rope_theta)
        head_w = F.linear(h, w[p + "weights.weight"]) * (Hi * di) ** -0.5           # [L, Hi]
        score = (torch.einsum("thd,cd->thc", q, keys).relu() * head_w[:, :, None]).sum(dim=1).float()
        score = score.masked_fill(~visible, NEG_INF)
        selected = torch.zeros_like(visible)
        for t, row in enumerate(score.tolist()):   # plainly, one query at a time
            order = sorted(range(len(row)), key=lambda i: (-row[i], i))[: lay.index_topk]
            for i in order:
                selected[t, i] = row[i] > NEG_INF
        return selected

    def _layer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        lay, w = self.lay, self.w
        p, ratio, L = f"layers.{layer}.", self.ratios[layer], x.shape[0]
        H, d, eps, pos = lay.num_heads, lay.head_dim, lay.rms_norm_eps, torch.arange(L)
        h = _rms_norm(x, w[p + "attn_norm.weight"], eps)
        q = _rope(F.linear(h, w[p + "attn.wq.weight"]).view(L, H, d), pos, lay.rope_theta)
        kv = _rope(_rms_norm(F.linear(h, w[p + "attn.wkv.weight"]), w[p + "attn.kv_norm.weight"], eps),
                   pos, lay.rope_theta)
        back = pos[:, None] - pos[None, :]
        keys, mask = kv, (back >= 0) & (back < lay.sliding_window)                 # [L, L] window
        if ratio:
            rows = self._compress(p + "attn.compressor.", h, ratio)                 # [C, d]
            ends = (torch.arange(rows.shape[0]) + 1) * ratio - 1
            visible = ends[None, :] <= pos[:, None]                                   # [L, C]
            if ratio == self.csa:
                visible = visible & self._topk_mask(layer, h, visible)
            keys, mask = torch.cat([kv, rows]), torch.cat([mask, visible], dim=1)
        scores = torch.einsum("thd,kd->htk", q, keys).float() / math.sqrt(d)
        scores = scores.masked_fill(~mask[None], NEG_INF)
        sink = w[p + "attn.sink"].float().view(H, 1, 1).expand(H, L, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out = torch.einsum("htk,kd->thd", probs.to(keys.dtype), keys).reshape(L, H * d)
        x = x + F.linear(out, w[p + "attn.wo.weight"])
        h = _rms_norm(x, w[p + "ffn_norm.weight"], eps)
        mlp = F.linear(F.silu(F.linear(h, w[p + "mlp.gate.weight"])) * F.linear(h, w[p + "mlp.up.weight"]),
                       w[p + "mlp.down.weight"])
        return x + mlp

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """[L, vocab] float32 logits of every position."""
        w = self.w
        x = w["embed.weight"][torch.tensor(token_ids)]
        for layer in range(len(self.ratios)):
            x = self._layer(layer, x)
        head = w["embed.weight"] if self.lay.tie_word_embeddings else w["lm_head.weight"]
        return F.linear(_rms_norm(x, w["norm.weight"], self.lay.rms_norm_eps), head).float()

    def greedy(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy tokens, and the last-position logits each one was chosen from."""
        tokens, out, seen = list(prompt), [], []
        for _ in range(max_new_tokens):
            last = self.logits(tokens)[-1]
            seen.append(last)
            out.append(int(last.argmax()))
            tokens.append(out[-1])
        return out, seen
