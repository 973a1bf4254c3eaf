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

With expert parallel (each rank holds a contiguous share of the experts) the pairs travel to their experts' ranks
and back: exchange_experts by counts (the ranks swap how many pairs go where and the host reads it, for the
all-to-all's split sizes: the CPU's way, and an accelerator's for large steps), exchange_experts_fixed in fixed
shapes bounded by the step's rows (no host sync: an accelerator's decode steps). Both give each token what
routed_experts gives it on one device.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.nn.functional as F

from appliance.core.errors import EnvironmentSettingError
from appliance.core.parallel import split
from npu.collectives import Collective
from npu.deepseek_v4.activation_triton import activation_kernel_applies, clamped_swiglu_op
from npu.deepseek_v4.expert_stacks import Held
from npu.grouped_gemm_triton import grouped_gemm_applies, grouped_tiles, triton_grouped_gemm
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
    return linear(clamped_swiglu(linear(x, w1), linear(x, w3), limit), w2)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) (no clamp for limit None); one launch on a GPU
    (npu.deepseek_v4.activation_triton)."""
    if activation_kernel_applies(gate.device):
        return clamped_swiglu_op(gate, up, limit)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


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


def combine_slots(pairs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's routed output: its k pair outputs (pairs, k rows per token in slot order, any shape that views as
    [N, k, D]) weighted and summed in slot order. Every way of running the experts ends here, so where an expert ran
    never changes the sum."""
    n, k = weights.shape
    return (pairs.view(n, k, pairs.shape[-1]) * weights[..., None].to(pairs.dtype)).sum(dim=1)


def routed_experts(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   expert: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                   limit: float | None) -> torch.Tensor:
    """Sum over each token's experts of weight x expert(h); only the experts some token picked are fetched
    (expert(e) -> its w1, w3, w2 in the compute dtype). Each (token, slot) output lands in its own row of a
    [N, k, D] buffer, summed at the end: no scatter-add (slow on CPUs under load, order-dependent elsewhere)."""
    n, k = experts.shape
    token_of_pair = torch.arange(n * k, device=h.device) // k
    return combine_slots(by_expert(h, experts.flatten(), expert, limit, token_of_pair), weights)


def exchange_experts(group: Collective, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                     run_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     num_experts: int) -> torch.Tensor:
    """routed_experts with the experts spread over the ranks of `group` (expert parallel), exchanging exactly the
    pairs each rank needs: rank i holds the contiguous experts split(num_experts, size, i)
    (appliance.core.parallel.RankPlace.experts), and run_local(rows [P, D], ids [P] global expert ids of this rank)
    runs them ([P, D]).

    Each (token, slot) pair travels to the rank holding its expert and its output comes back (all-to-alls of the
    counts, the hidden rows, the expert ids, and the outputs back): the rows go out sorted by destination rank, each rank runs its experts on
    the rows it received (from every rank, its own included), and the outputs return in the same order. The
    origin then weights and sums them exactly as routed_experts does, so the result does not depend on where
    an expert lives. Every rank of the group calls this once per MoE layer, in lockstep, even with no tokens:
    the others may still send it rows for its experts. The counts are read on the host (the all-to-all's split
    sizes): one sync per layer, nothing on a CPU; exchange_experts_fixed is the accelerator's way for small steps."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    bounds = torch.tensor([split(num_experts, group.size, i)[1] for i in range(group.size)], device=flat.device)
    dest = torch.bucketize(flat, bounds, right=True)             # the rank holding each pair's expert
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=group.size)
    recv = group.exchange_counts(send)
    send_counts, recv_counts = send.tolist(), recv.tolist()
    rows = group.all_to_all(h[order // k], send_counts, recv_counts)
    ids = group.all_to_all(flat[order], send_counts, recv_counts)
    back = group.all_to_all(run_local(rows, ids), recv_counts, send_counts)
    pairs = torch.empty_like(back)
    pairs[order] = back
    return combine_slots(pairs, weights)


# How expert-parallel ranks exchange pairs (read once per runner): auto (the fixed-shape exchange where the runner
# holds its experts stacked, on an accelerator, for steps within FIXED_EXCHANGE_PAIRS; by counts otherwise), fixed
# (also on a CPU, stacking its experts there: what the tests run the accelerator's path by) or counts (always).
EXPERT_EXCHANGE_ENV = "APPLIANCE_EXPERT_EXCHANGE"
EXPERT_EXCHANGES = ("auto", "fixed", "counts")


def expert_exchange_mode() -> str:
    mode = os.environ.get(EXPERT_EXCHANGE_ENV, "auto")
    if mode not in EXPERT_EXCHANGES:
        raise EnvironmentSettingError(f"{EXPERT_EXCHANGE_ENV}={mode!r}: expected one of {', '.join(EXPERT_EXCHANGES)} "
                                      f"(unset it for auto)")
    return mode


# The fixed-shape exchange returns ranks x row bound x experts per token pair outputs to every rank; above this many
# it would move more than the exchange by counts saves (a decode step of 64 rows, 6 experts per token on 8 ranks is
# 3,072 pairs, 25 MB of bf16 rows at DeepSeek V4's hidden 4,096; a 4,096-token prefill chunk would be 196,608).
FIXED_EXCHANGE_PAIRS = 8192


def exchange_experts_fixed(group: Collective, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                           w1: Held, w3: Held, w2: Held, limit: float | None, gemm: GroupedGemm, num_experts: int,
                           capacity: int) -> torch.Tensor:
    """exchange_experts with no host sync and shapes fixed by `capacity` (the most rows any rank of the group has in
    this pass, known to every rank from the step: StepBatch.expert_rows), so that nothing waits on the device and a
    captured graph could replay it. w1, w3, w2: this rank's experts stacked ([E_local, ...], global ids lo..hi).

    1. Every rank pads its rows to `capacity` (padding rows name no expert) and all ranks gather every rank's rows
       and expert ids (all_gather: equal shapes).
    2. Each rank runs the pairs whose expert it holds as one grouped GEMM over them sorted by expert (the others
       sorted after its last expert, past every group's end, and zeroed).
    3. The pair outputs go back to their rows' ranks in equal blocks (all_to_all), and each rank sums what it got
       for each pair over the ranks: one rank computed it, the others sent zeros, so the sum is that output exactly.
       Weighted and summed over a token's slots as routed_experts does: the result does not depend on where an
       expert lives, nor on which exchange ran.
    The gather brings every rank size x capacity hidden rows, the return size x capacity x k pair outputs
    (FIXED_EXCHANGE_PAIRS bounds when the runner takes it)."""
    n, k = experts.shape
    if n > capacity:
        raise ValueError(f"expert exchange: {n} rows on this rank but the step's bound is {capacity} "
                         f"(StepBatch.expert_rows)")
    lo, hi = split(num_experts, group.size, group.rank)
    sent_h = h.new_zeros(capacity, h.shape[-1])
    sent_h[:n] = h
    sent_e = experts.new_full((capacity, k), num_experts)       # a padding row's pairs: no rank's expert
    sent_e[:n] = experts
    every_h = group.all_gather_rows(sent_h)                     # [size x capacity, D], rank order
    every_e = group.all_gather_rows(sent_e).reshape(-1)         # pair p: row p // k, slot p % k
    local = torch.where((every_e >= lo) & (every_e < hi), every_e - lo, hi - lo)
    pairs = grouped_pairs(every_h, local, k, hi - lo, w1, w3, w2, limit, gemm, foreign=True)
    back = group.exchange_blocks(pairs)                         # block r: rank r's pairs of this rank's rows
    return combine_slots(back.view(group.size, capacity, k, h.shape[-1]).sum(dim=0)[:n], weights)


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


def grouped_swiglu(rows: torch.Tensor, ends: torch.Tensor, w1: Held, w3: Held, w2: Held, limit: float | None,
                   gemm: GroupedGemm) -> torch.Tensor:
    """swiglu of rows sorted by expert, each expert's rows (up to ends[e]) through its w1, w3, w2 of the stacks."""
    return gemm(clamped_swiglu(gemm(rows, w1, ends), gemm(rows, w3, ends), limit), w2, ends)


def grouped_pairs(h: torch.Tensor, ids: torch.Tensor, per_row: int, num_groups: int, w1: Held, w3: Held, w2: Held,
                  limit: float | None, gemm: GroupedGemm, foreign: bool = False) -> torch.Tensor:
    """[P, D]: pair i (row i // per_row of h) through expert ids[i] of the stacks ([num_groups, ...]), with no host
    sync: the pairs sorted by expert (stably: each expert's rows in pair order), one grouped GEMM per weight, the
    outputs put back in pair order. foreign: some ids are num_groups (an expert held elsewhere): sorted last, past
    every group's end, their rows are zeros."""
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids.index_select(0, order)
    rows = h.index_select(0, order // per_row)
    out = grouped_swiglu(rows, expert_offsets(sorted_ids, num_groups), w1, w3, w2, limit, gemm)
    if foreign:                           # rows past the last group's end: the grouped GEMM left them unwritten
        out = torch.where((sorted_ids < num_groups)[:, None], out, out.new_zeros(()))
    return torch.empty_like(out).index_copy_(0, order, out)


def grouped_experts(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: Held, w3: Held, w2: Held,
                    limit: float | None, gemm: GroupedGemm) -> torch.Tensor:
    """routed_experts with no host sync: w1, w3 [E, I, D] and w2 [E, D, I] stacked over the experts, held as `gemm`
    reads them (expert_gemm's: as stored)."""
    pairs = grouped_pairs(h, experts.reshape(-1), experts.shape[1], w1.shape[0], w1, w3, w2, limit, gemm)
    return combine_slots(pairs, weights)


def expert_gemm(device: torch.device, dtype: torch.dtype) -> GroupedGemm:
    """The grouped GEMM for expert stacks on this device, chosen once at load: quantized stacks through the Triton
    kernel that reads them as stored where it runs, else dequantized for the step; plain stacks through
    torch._grouped_mm where it works (a maintained kernel), else the Triton kernel, else masked_grouped_gemm."""
    triton_runs, torch_runs = grouped_gemm_applies(device, dtype), grouped_mm_works(device, dtype)
    made: list = [None, 0, None]     # the last ends tensor and row count the Triton kernel's tile table was made for

    def tiles_for(rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """One tile table for the swiglu's three GEMMs (w1, w3, then w2 over the same rows and ends): a dozen small
        ops each time otherwise. Keyed by the ends tensor itself (held, so its id is not reused while cached; every
        step makes new ends by expert_offsets and none is changed in place) and the row count."""
        if made[0] is not ends or made[1] != rows.shape[0]:
            made[:] = [ends, rows.shape[0], grouped_tiles(ends, rows.shape[0])]
        return made[2]

    def run(rows: torch.Tensor, stack: Held, ends: torch.Tensor) -> torch.Tensor:
        if isinstance(stack, QuantizedWeight):
            if triton_runs:
                return triton_grouped_gemm(rows, stack, ends, tiles_for(rows, ends))
            stack = stack.dequantize(dtype)
        if torch_runs:
            return torch_grouped_gemm(rows, stack, ends)
        if triton_runs:
            return triton_grouped_gemm(rows, stack, ends, tiles_for(rows, ends))
        return masked_grouped_gemm(rows, stack, ends)
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
