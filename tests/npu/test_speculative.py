"""Speculative verification (npu/speculative.py): greedy acceptance, and rejection sampling whose every emitted
token is distributed as the target's (chi-square over many seeds on an 8-token vocabulary; fixed seeds, so the
tests are deterministic). Expected distributions are computed here from the logits, never read from the code."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from appliance.core.request import SamplingParams
from npu.speculative import rejection_sample, target_probs, verify_greedy

V = 8
RUNS = 6000


def dist(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


P0 = dist([30, 20, 15, 10, 10, 8, 5, 2])
P1 = dist([1, 2, 3, 4, 30, 30, 20, 10])
P2 = dist([10, 10, 10, 10, 20, 20, 10, 10])


def chi2_pvalue(samples: list[int], p: torch.Tensor) -> float:
    counts = Counter(samples)
    observed = [counts.get(i, 0) for i in range(V)]
    total = sum(float(x) for x in p)
    expected = [float(x) / total * len(samples) for x in p]
    keep = [i for i in range(V) if expected[i] > 0]
    assert all(observed[i] == 0 for i in range(V) if expected[i] == 0), "a token of probability 0 was drawn"
    return float(chisquare([observed[i] for i in keep], [expected[i] for i in keep]).pvalue)


def test_greedy_accepts_while_drafts_match_then_takes_the_next_argmax():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]     # all accepted: a bonus token
    assert verify_greedy([5, 6, 7, 8], [5, 9, 7]) == [5, 6]           # the first miss stops: its correction
    assert verify_greedy([5, 6], [4]) == [5]


@pytest.mark.parametrize("draft", [0, 3, 7])
def test_first_token_follows_the_target_with_a_deterministic_drafter(draft):
    """q one-hot at the draft (the MTP drafter's argmax): accept with p(d), else draw from p without d."""
    p = torch.stack([P0, P1])
    firsts = [rejection_sample(p, [draft], None, torch.Generator().manual_seed(seed))[0] for seed in range(RUNS)]
    assert chi2_pvalue(firsts, P0) > 1e-3
    # The test can tell: always keeping the draft is far from p.
    assert chi2_pvalue([draft] * 100 + firsts[100:], P0) < 1e-3 or draft == 0


def test_every_token_follows_the_target_with_a_sampled_drafter():
    """q a full distribution and drafts drawn from it: the first emitted token is distributed as p0, and the token
    after an accepted draft (a resample or the bonus) as p1, whatever was drafted."""
    q = torch.stack([dist([5, 5, 30, 30, 10, 10, 5, 5]), dist([40, 10, 10, 10, 10, 10, 5, 5])])
    p = torch.stack([P0, P1, P2])
    firsts, seconds = [], []
    for seed in range(RUNS):
        gen = torch.Generator().manual_seed(seed)
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        out = rejection_sample(p, drafts, q, gen)
        firsts.append(out[0])
        if len(out) >= 2:
            seconds.append(out[1])
    assert chi2_pvalue(firsts, P0) > 1e-3
    assert len(seconds) > RUNS // 4 and chi2_pvalue(seconds, P1) > 1e-3


def test_the_bonus_token_follows_the_last_row():
    p = torch.stack([P0, P2])
    bonus = []
    for seed in range(RUNS):
        out = rejection_sample(p, [0], None, torch.Generator().manual_seed(seed))
        if len(out) == 2:
            bonus.append(out[1])
    assert abs(len(bonus) / RUNS - float(P0[0])) < 0.03          # accepted with probability p0(draft)
    assert chi2_pvalue(bonus, P2) > 1e-3


def test_target_probs_are_what_the_one_token_sampler_draws_from():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0]])
    params = SamplingParams(temperature=0.5, top_k=5, top_p=0.9)
    # By hand: softmax(logits / 0.5) over the top 5, then the smallest prefix (most likely first) reaching 0.9.
    e = [math.exp(x / 0.5) for x in logits[0, :5].tolist()]
    probs = [x / sum(e) for x in e]
    keep, mass = [], 0.0
    for i, x in enumerate(probs):
        if mass >= 0.9:
            break
        keep.append(i)
        mass += x
    expected = [probs[i] / mass if i in keep else 0.0 for i in range(V)]
    assert target_probs(logits, params)[0].tolist() == pytest.approx(expected, abs=1e-6)
