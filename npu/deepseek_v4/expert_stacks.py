"""DeepSeek V4's routed experts held as one stack per MoE layer on an accelerator: w1, w3 and w2 of every expert as
[E, out, in], so moe.grouped_experts runs them as one grouped GEMM with no host sync."""

from __future__ import annotations

import re

import torch

from npu.quant import QuantizedWeight

Held = torch.Tensor | QuantizedWeight        # a weight as the runner holds it: as loaded, or quantized with scales


EXPERT_WEIGHT = re.compile(r"(.*ffn\.)experts\.(\d+)\.(w1|w3|w2)\.weight$")


def stack_experts(held: dict[str, Held]) -> dict[str, tuple[Held, Held, Held]]:
    """Move every routed expert of `held` into per-layer stacks: prefix -> (w1, w3, w2), each [E, out, in] (as stored:
    quantized ones keep their values and scales, stacked alike). The per-expert entries leave `held`, so nothing is
    held twice."""
    found: dict[str, dict[str, dict[int, Held]]] = {}
    for name in [n for n in held if EXPERT_WEIGHT.match(n)]:
        prefix, expert, which = EXPERT_WEIGHT.match(name).groups()  # type: ignore[union-attr]
        found.setdefault(prefix, {}).setdefault(which, {})[int(expert)] = held.pop(name)
    return {prefix: tuple(_stack(f"{prefix}experts.*.{w}.weight", [parts[w][e] for e in sorted(parts[w])])
                          for w in ("w1", "w3", "w2"))  # type: ignore[misc]
            for prefix, parts in found.items()}


def _stack(name: str, weights: list[Held]) -> Held:
    def stacked(ts: list[torch.Tensor]) -> torch.Tensor:     # through bytes: cat has no kernel for fp4 / e8m0
        return torch.stack([t.view(torch.uint8) for t in ts]).view(ts[0].dtype)
    if isinstance(weights[0], QuantizedWeight):
        quantized = [w for w in weights if isinstance(w, QuantizedWeight)]
        return QuantizedWeight(name, stacked([w.values for w in quantized]), stacked([w.scale for w in quantized]),
                               quantized[0].block)
    return torch.stack([w for w in weights if isinstance(w, torch.Tensor)])
