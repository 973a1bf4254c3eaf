"""DeepSeek V4 MoE: routed experts picked per token plus one shared expert, SwiGLU with clamped inputs.

Routing: scores = score_fn(h Wg); the first num_hash_layers layers take the experts the fixed table
tid2eid[token] names, the others the top num_experts_per_tok of scores + bias (the bias only selects:
noaux_tc). The picked scores are renormalized to sum to 1 and scaled by routed_scaling_factor.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from appliance.core.parallel import split
from npu.collectives import Collective

SCORE_FUNCS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
}


def route(h: torch.Tensor, gate: torch.Tensor, scoring_func: str, top_k: int, scale: float,
          bias: torch.Tensor | None = None, table: torch.Tensor | None = None,
          token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k], experts [N, k]): by the hash table `table[token_ids]` when given, else by top-k of
    scores + bias."""
    scores = SCORE_FUNCS[scoring_func](F.linear(h, gate))
    if table is not None:
        experts = table[token_ids]
    else:
        experts = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, experts)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scale, experts


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float | None) -> torch.Tensor:
    gate, up = F.linear(x, w1), F.linear(x, w3)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.linear(F.silu(gate) * up, w2)


def routed_experts(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   expert: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                   limit: float | None) -> torch.Tensor:
    """Sum over each token's experts of weight x expert(h); only the experts some token picked are fetched
    (expert(e) -> its w1, w3, w2 in the compute dtype). Each (token, slot) output lands in its own row of a
    [N, k, D] buffer, summed at the end: no scatter-add (slow on CPUs under load, order-dependent elsewhere)."""
    n, k = experts.shape
    out = h.new_zeros((n, k, h.shape[-1]))
    for e in torch.unique(experts).tolist():
        token, slot = torch.where(experts == e)
        out[token, slot] = swiglu(h[token], *expert(e), limit) * weights[token, slot, None].to(h.dtype)
    return out.sum(dim=1)


def exchange_experts(group: Collective, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                     expert: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                     limit: float | None, num_experts: int) -> torch.Tensor:
    """routed_experts with the experts spread over the ranks of `group` (expert parallel): rank i holds the
    contiguous experts split(num_experts, size, i) (appliance.core.parallel.RankPlace.experts).

    Each (token, slot) pair travels to the rank holding its expert and its output comes back (all-to-alls of the
    counts, the hidden rows, the expert ids, and the outputs back): the rows go out sorted by destination rank, each rank runs its experts on
    the rows it received (from every rank, its own included), and the outputs return in the same order. The
    origin then weights and sums them exactly as routed_experts does, so the result does not depend on where
    an expert lives. Every rank of the group calls this once per MoE layer, in lockstep, even with no tokens:
    the others may still send it rows for its experts."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    bounds = torch.tensor([split(num_experts, group.size, i)[1] for i in range(group.size)], device=flat.device)
    dest = torch.bucketize(flat, bounds, right=True)             # the rank holding each pair's expert
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=group.size)
    recv = group.exchange_counts(send)
    send_counts, recv_counts = send.tolist(), recv.tolist()
    rows = group.all_to_all(h[order // k], send_counts, recv_counts)
    ids = group.all_to_all(flat[order], send_counts, recv_counts)
    out = rows.new_empty(rows.shape)
    for e in torch.unique(ids).tolist():
        at = torch.where(ids == e)[0]
        out[at] = swiglu(rows[at], *expert(e), limit)
    back = group.all_to_all(out, recv_counts, send_counts)
    pairs = torch.empty_like(back)
    pairs[order] = back
    return (pairs.view(n, k, h.shape[-1]) * weights[..., None].to(h.dtype)).sum(dim=1)
