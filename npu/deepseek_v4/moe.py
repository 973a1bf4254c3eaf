"""DeepSeek V4 MoE: routed experts picked per token plus one shared expert, SwiGLU with clamped inputs.

Routing: scores = score_fn(h Wg); the first num_hash_layers layers take the experts the fixed table
tid2eid[token] names, the others the top num_experts_per_tok of scores + bias (the bias only selects:
noaux_tc). The picked scores are renormalized to sum to 1 and scaled by routed_scaling_factor.

Two ways to run the routed experts, the same sums:
- on the CPU (routed_experts, by_expert): the pairs sorted by expert, each picked expert run once on its rows
  and fetched (dequantized) only when picked; the host reads the counts, which costs nothing there;
- on an accelerator (grouped_experts): no host sync. The pairs are sorted by expert on the device, every
  expert's end offset comes from one searchsorted, and grouped GEMMs (one launch for all experts, empty groups
  cost nothing) run w1, w3 and w2 over the sorted rows. Which grouped GEMM is the runner's choice (GroupedGemm):
  npu.grouped_gemm_triton reads the stacks as stored (FP4 / FP8 dequantized in the kernel, tile by tile) where
  Triton runs; elsewhere the stack is dequantized for the step and torch._grouped_mm runs it (torch_grouped_gemm),
  or, where the device has no grouped GEMM for the dtype, each expert runs over every row and keeps its own
  (masked_grouped_gemm: the same static shapes, E times the arithmetic).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from appliance.core.parallel import split
from npu.collectives import Collective
from npu.deepseek_v4.expert_stacks import Held
from npu.grouped_gemm_triton import grouped_gemm_applies, triton_grouped_gemm
from npu.quant import QuantizedWeight

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
        biased = scores if bias is None else scores + bias
        experts = torch.topk(biased, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, experts)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scale, experts


def swiglu(x: torch.Tensor, w1: Any, w3: Any, w2: Any, limit: float | None,
           linear: Callable[[torch.Tensor, Any], torch.Tensor] = F.linear) -> torch.Tensor:
    """w2(silu(w1 x) * w3 x) with clamped inputs; the weights are whatever `linear` takes (tensors for F.linear, names
    for a runner's projection)."""
    gate, up = linear(x, w1), linear(x, w3)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return linear(F.silu(gate) * up, w2)


def by_expert(h: torch.Tensor, ids: torch.Tensor, expert: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
              limit: float | None, row_of: torch.Tensor | None = None) -> torch.Tensor:
    """[P, D]: pair i through expert ids[i] (expert(e) -> its w1, w3, w2), on row row_of[i] of h (row i when
    row_of is None). The pairs are sorted by expert once (stably, so each expert gets its rows in pair order,
    as a mask would pick them) and gathered once; each expert with rows runs once on its contiguous slice, an
    expert no pair names is never fetched, and one scatter puts the outputs back in pair order."""
    order = torch.argsort(ids, stable=True)
    rows = h[order if row_of is None else row_of[order]]
    experts, counts = torch.unique_consecutive(ids[order], return_counts=True)
    out = rows.new_empty(rows.shape)
    if rows.shape[0]:
        out[order] = torch.cat([swiglu(chunk, *expert(e), limit)
                                for e, chunk in zip(experts.tolist(), rows.split(counts.tolist()), strict=True)])
    return out


def routed_experts(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   expert: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                   limit: float | None) -> torch.Tensor:
    """Sum over each token's experts of weight x expert(h); only the experts some token picked are fetched
    (expert(e) -> its w1, w3, w2 in the compute dtype). Each (token, slot) output lands in its own row of a
    [N, k, D] buffer, summed at the end: no scatter-add (slow on CPUs under load, order-dependent elsewhere)."""
    n, k = experts.shape
    token_of_pair = torch.arange(n * k, device=h.device) // k
    out = by_expert(h, experts.flatten(), expert, limit, token_of_pair).view(n, k, h.shape[-1])
    return (out * weights[..., None].to(h.dtype)).sum(dim=1)


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
    back = group.all_to_all(by_expert(rows, ids, expert, limit), recv_counts, send_counts)
    pairs = torch.empty_like(back)
    pairs[order] = back
    return (pairs.view(n, k, h.shape[-1]) * weights[..., None].to(h.dtype)).sum(dim=1)


def expert_offsets(sorted_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 [num_experts]: the end of each expert's rows among pairs sorted by expert id (grouped GEMM offsets)."""
    bounds = torch.arange(1, num_experts + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, bounds, right=False).to(torch.int32)


GroupedGemm = Callable[[torch.Tensor, Held, torch.Tensor], torch.Tensor]
"""(rows [P, K] sorted by expert, stack [E, N, K] as the runner holds it, ends int32 [E]) -> rows @ stack[e]^T per
expert's rows, [P, N] in the rows' dtype."""


def torch_grouped_gemm(rows: torch.Tensor, stack: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm over a stack in the rows' dtype."""
    return torch._grouped_mm(rows, stack.transpose(-2, -1), offs=ends)


def masked_grouped_gemm(rows: torch.Tensor, stack: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Each expert over every row, each row keeping its own expert's output: for devices with no grouped GEMM."""
    expert_of_row = torch.searchsorted(ends, torch.arange(rows.shape[0], device=rows.device, dtype=ends.dtype),
                                       right=True)[:, None]
    out = rows.new_zeros(rows.shape[0], stack.shape[-2])
    for e in range(stack.shape[0]):
        out = torch.where(expert_of_row == e, F.linear(rows, stack[e]), out)
    return out


def grouped_experts(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: Held, w3: Held, w2: Held,
                    limit: float | None, gemm: GroupedGemm) -> torch.Tensor:
    """routed_experts with no host sync: w1, w3 [E, I, D] and w2 [E, D, I] stacked over the experts, held as `gemm`
    reads them (expert_gemm's: as stored)."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)          # pairs by expert, each expert's rows in pair order
    rows = h.index_select(0, order // k)
    ends = expert_offsets(flat.index_select(0, order), w1.shape[0])
    gate, up = gemm(rows, w1, ends), gemm(rows, w3, ends)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    out = gemm(F.silu(gate) * up, w2, ends)
    pairs = torch.empty_like(out).index_copy_(0, order, out)
    return (pairs.view(n, k, h.shape[-1]) * weights[..., None].to(h.dtype)).sum(dim=1)


def expert_gemm(device: torch.device, dtype: torch.dtype) -> GroupedGemm:
    """The grouped GEMM for expert stacks on this device, chosen once at load: quantized stacks through the Triton
    kernel that reads them as stored where it runs, else dequantized for the step; plain stacks through
    torch._grouped_mm where it works (a maintained kernel), else the Triton kernel, else masked_grouped_gemm."""
    triton_runs, torch_runs = grouped_gemm_applies(device, dtype), grouped_mm_works(device, dtype)

    def run(rows: torch.Tensor, stack: Held, ends: torch.Tensor) -> torch.Tensor:
        if isinstance(stack, QuantizedWeight):
            if triton_runs:
                return triton_grouped_gemm(rows, stack, ends)
            stack = stack.dequantize(dtype)
        if torch_runs:
            return torch_grouped_gemm(rows, stack, ends)
        return (triton_grouped_gemm if triton_runs else masked_grouped_gemm)(rows, stack, ends)
    return run


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs on this device and dtype (CUDA's needs sm90 for bf16 and may refuse float32):
    one tiny call at load time, never inside a step."""
    try:
        rows = torch.zeros(8, 16, dtype=dtype, device=device)
        stacked = torch.zeros(2, 16, 16, dtype=dtype, device=device)
        torch._grouped_mm(rows, stacked.transpose(-2, -1), offs=torch.tensor([4, 8], dtype=torch.int32).to(device))
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
