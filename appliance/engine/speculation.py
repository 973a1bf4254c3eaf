"""Speculative decoding in the engine: verifying each decode row's drafts, and counting what was accepted.

A verifying row computed its last token and K drafts in one step (the drafts are the argmax of the drafter's rows,
which a runner appends after the step's: logprobs.split_draft_rows). verify() keeps the longest accepted prefix of
the drafts and one token more (npu/speculative.py: exact match for a greedy request, rejection sampling otherwise),
so a row emits 1 to K + 1 tokens per step.
"""

from __future__ import annotations

from typing import Sequence

import torch

from appliance.core.request import TokenLogprob
from appliance.engine.logprobs import VerifyRows
from appliance.engine.scheduler import ScheduledSeq
from appliance.engine.stats import StatsRecorder
from npu.sampler import Sampler, greedy_ids, token_logprobs
from npu.speculative import rejection_sample, target_probs, verify_greedy

# A row's tokens and, per token, its logprob (None where the request did not ask).
Emitted = tuple[list[int], list[TokenLogprob | None]]


def verify(sampler: Sampler, logits: torch.Tensor, drafted: torch.Tensor, verified: list[VerifyRows]
           ) -> dict[int, Emitted]:
    """Each verifying row's emitted tokens (the accepted drafts and one more) and their logprobs when asked, by id
    of its sequence. logits: the step's rows; drafted: the drafter's rows."""
    out: dict[int, Emitted] = {}
    for v in verified:
        target = logits[v.first:v.first + v.num_draft + 1]
        drafts = greedy_ids(drafted[v.first_draft:v.first_draft + v.num_draft])
        params = v.seq.params
        if params.greedy:
            tokens = verify_greedy(greedy_ids(target), drafts)
        else:
            gen = sampler.generator(v.seq.request_id, params)
            tokens = rejection_sample(target_probs(target, params), drafts, None, gen)
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        if params.logprobs is not None:
            logprobs = list(token_logprobs(target[:len(tokens)], tokens, [params.logprobs] * len(tokens)))
        out[id(v.seq)] = (tokens, logprobs)
    return out


def record_speculation(stats: StatsRecorder, scheduled: Sequence[ScheduledSeq],
                       emitted: Sequence[tuple[ScheduledSeq, list[int]]]) -> None:
    """Drafts proposed and accepted (a prefix of them) by each verifying row this step, for Stats and /metrics."""
    proposed = [s.num_draft for s in scheduled if s.num_draft]
    if proposed:
        accepted = [len(new) - 1 for s, new in emitted if s.num_draft]
        stats.record_speculation(proposed, accepted)
