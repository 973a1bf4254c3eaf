"""Verifying drafted tokens against the target model's logits of every drafted position.

A verifying row computes its token x0 and the drafts d1 .. dK in one step, giving K + 1 logits rows: row i is
the target's distribution of the token after position i, so draft d(i+1) is checked against row i and the
row after the last accepted draft gives one more token (the correction, or a bonus when all are accepted).

- greedy (temperature 0): accept while the draft equals the row's argmax; then the argmax of the next row.
  The output is exactly what one-token decoding emits.
- sampling: standard speculative rejection sampling (Leviathan et al. 2023; vLLM's rejection sampler): accept
  d with probability min(1, p(d) / q(d)), else draw from norm(max(0, p - q)) and stop; all accepted: draw
  the bonus from the last row. p is the target's distribution after temperature, top-k and top-p (what
  the one-token sampler draws from); q the drafter's (None: a deterministic drafter, q one-hot at d, as the
  MTP drafter's argmax is). Each emitted token is then distributed exactly as p.
"""

from __future__ import annotations

import torch

from appliance.core.request import SamplingParams


def verify_greedy(target_ids: list[int], drafts: list[int]) -> list[int]:
    """target_ids: the argmax of each of the K + 1 rows; the accepted drafts, then one more token."""
    out: list[int] = []
    for draft, target in zip(drafts, target_ids):
        if draft != target:
            break
        out.append(draft)
    out.append(target_ids[len(out)])
    return out


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, vocab] float32 probabilities the one-token sampler (npu.sampler.Sampler) draws from: logits / temperature,
    the top_k most likely, then the smallest prefix reaching top_p (the most likely token always stays)."""
    scaled = logits.float() / params.temperature
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    if params.top_k > 0:
        sorted_logits[:, params.top_k:] = float("-inf")
    probs = sorted_logits.softmax(dim=-1)
    probs = probs.masked_fill((probs.cumsum(dim=-1) - probs) >= params.top_p, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def rejection_sample(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, gen: torch.Generator) -> list[int]:
    """p [K + 1, vocab] target probabilities, drafts K ids, q [K, vocab] drafter probabilities (None: one-hot at each
    draft). Returns the accepted drafts and one more token drawn from the residual (or the last row)."""
    out: list[int] = []
    for i, draft in enumerate(drafts):
        q_draft = 1.0 if q is None else float(q[i, draft])
        u = float(torch.rand((), generator=gen, device=p.device))
        if u * q_draft < float(p[i, draft]):
            out.append(draft)
            continue
        residual = p[i].clone()
        if q is None:
            residual[draft] = 0.0
        else:
            residual = (residual - q[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:         # p == q: a rejection has probability 0; never reached in exact math
            residual = p[i]
        out.append(int(torch.multinomial(residual, 1, generator=gen)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=gen)))
    return out
