"""Expert parallel's two exchanges (npu/deepseek_v4/moe.py) over two ranks held by two threads of this process (a
collective of shared slots and a barrier), against routed_experts with every expert at hand:

- exchange_experts_fixed (the accelerator's: fixed shapes, no count read on the host) and exchange_experts (by
  counts, each rank's experts stacked or run one by one) give each rank routed_experts over its own tokens, whatever
  the routing (all pairs on one rank, a rank with no tokens, padding past its rows);
- the pairs of other ranks' experts sort past the last group's end, where the grouped GEMM writes nothing: they are
  zeroed, so what the GEMM leaves there (NaN here) never reaches a sum;
- on fake CUDA (tests/support/fake_cuda) the fixed exchange makes no host sync, and the exchange by counts does (it
  reads its split sizes), so the guard would catch one planted in the fixed path.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import pytest
import torch

from appliance.core.errors import EnvironmentSettingError
from appliance.core.parallel import split
from npu.deepseek_v4.moe import (
    EXPERT_EXCHANGE_ENV,
    by_expert,
    exchange_experts,
    exchange_experts_fixed,
    expert_exchange_mode,
    grouped_pairs,
    masked_grouped_gemm,
    routed_experts,
    torch_grouped_gemm,
)
from tests.support.fake_cuda import HostSyncError, fake_cuda

E, K, D, INTER, LIMIT = 8, 2, 16, 24, 5.0


class ThreadRanks:
    """`size` ranks in threads: each call deposits this rank's part, waits for every rank's, and reads them all."""

    def __init__(self, size: int):
        self.size = size
        self.slots: list[object] = [None] * size
        self.barrier = threading.Barrier(size)

    def swap(self, rank: int, part: object) -> list[object]:
        self.slots[rank] = part
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()
        return parts


class ThreadCollective:
    """npu.collectives.Collective's expert-parallel calls over ThreadRanks (copies, as a real exchange makes)."""

    def __init__(self, ranks: ThreadRanks, rank: int):
        self.ranks, self.size, self.rank = ranks, ranks.size, rank

    def exchange_counts(self, send: torch.Tensor) -> torch.Tensor:
        return torch.stack([t[self.rank] for t in self.ranks.swap(self.rank, send.clone())])

    def all_to_all(self, t: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        parts = self.ranks.swap(self.rank, list(t.split(send_counts)))
        got = [p[self.rank] for p in parts]
        assert [len(g) for g in got] == recv_counts
        return torch.cat(got).clone()

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.ranks.swap(self.rank, t.clone()))

    def exchange_blocks(self, t: torch.Tensor) -> torch.Tensor:
        parts = self.ranks.swap(self.rank, t.clone())
        return torch.cat([p.view(self.size, -1, *p.shape[1:])[self.rank] for p in parts])


def nan_past_ends(gemm: Callable) -> Callable:
    """A grouped GEMM that writes NaN into the rows past the last group's end (a real one leaves them unwritten)."""
    def run(rows: torch.Tensor, stack: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        out = gemm(rows, stack, ends)
        out[int(ends[-1]):] = float("nan")
        return out
    return run


def model(seed: int):
    g = torch.Generator().manual_seed(seed)
    w1, w3 = torch.randn(E, INTER, D, generator=g) * 0.3, torch.randn(E, INTER, D, generator=g) * 0.3
    w2 = torch.randn(E, D, INTER, generator=g) * 0.3
    return w1, w3, w2


def tokens(n: int, seed: int, experts: torch.Tensor | None = None):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, D, generator=g)
    if experts is None:
        experts = torch.rand(n, E, generator=g).argsort(dim=-1)[:, :K]
    weights = torch.rand(n, K, generator=g)
    return h, weights, experts


def run_ranks(size: int, fn: Callable[[ThreadCollective], torch.Tensor]) -> list[torch.Tensor]:
    ranks = ThreadRanks(size)
    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(lambda r: fn(ThreadCollective(ranks, r)), range(size)))


CASES = {
    "spread": ([5, 3], None),
    "one rank idle": ([4, 0], None),
    "every pair on rank 0": ([3, 6], torch.tensor([0, 1])),       # both slots name rank 0's experts
    "every pair on rank 1": ([6, 2], torch.tensor([E - 1, E - 2])),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("exchange", ["fixed", "counts, stacked", "counts, one by one"])
def test_each_rank_gets_routed_experts_over_its_tokens(case, exchange):
    counts, pinned = CASES[case]
    w1, w3, w2 = model(0)
    data = [tokens(n, 10 + r, None if pinned is None else pinned.expand(n, K)) for r, n in enumerate(counts)]
    capacity = max(counts) + 2                           # padding rows past every rank's own
    gemm = nan_past_ends(torch_grouped_gemm)

    def rank(group: ThreadCollective) -> torch.Tensor:
        lo, hi = split(E, group.size, group.rank)
        mine = (w1[lo:hi], w3[lo:hi], w2[lo:hi])
        h, weights, experts = data[group.rank]
        if exchange == "fixed":
            return exchange_experts_fixed(group, h, weights, experts, *mine, LIMIT, gemm, E, capacity)
        if exchange == "counts, stacked":
            return exchange_experts(group, h, weights, experts,
                                    lambda rows, ids: grouped_pairs(rows, ids - lo, 1, hi - lo, *mine, LIMIT, gemm), E)
        return exchange_experts(group, h, weights, experts,
                                lambda rows, ids: by_expert(rows, ids, lambda e: (w1[e], w3[e], w2[e]), LIMIT), E)

    got = run_ranks(2, rank)
    for (h, weights, experts), out in zip(data, got, strict=True):
        want = routed_experts(h, weights, experts, lambda e: (w1[e], w3[e], w2[e]), LIMIT)
        assert out.shape == want.shape
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_the_fixed_exchange_is_the_same_on_four_ranks_with_uneven_experts():
    """Seven experts on four ranks (2, 2, 2, 1): each rank's share is split's, as RankPlace.experts holds it."""
    e7 = 7
    w1, w3, w2 = (w[:e7] for w in model(1))
    counts = [3, 1, 0, 5]
    data = [(torch.randn(n, D), torch.rand(n, K), torch.rand(n, e7).argsort(dim=-1)[:, :K]) for n in counts]

    def rank(group: ThreadCollective) -> torch.Tensor:
        lo, hi = split(e7, group.size, group.rank)
        h, weights, experts = data[group.rank]
        return exchange_experts_fixed(group, h, weights, experts, w1[lo:hi], w3[lo:hi], w2[lo:hi], None,
                                      nan_past_ends(masked_grouped_gemm), e7, max(counts))

    for (h, weights, experts), out in zip(data, run_ranks(4, rank), strict=True):
        torch.testing.assert_close(out, routed_experts(h, weights, experts, lambda e: (w1[e], w3[e], w2[e]), None),
                                   rtol=1e-5, atol=1e-5)


def test_more_rows_than_the_bound_is_refused():
    w1, w3, w2 = model(2)
    h, weights, experts = tokens(4, 3)

    def rank(group: ThreadCollective) -> torch.Tensor:
        return exchange_experts_fixed(group, h, weights, experts, w1, w3, w2, LIMIT, torch_grouped_gemm, E, 3)

    with pytest.raises(ValueError, match="4 rows on this rank but the step's bound is 3"):
        run_ranks(1, rank)


class ShapeCollective:
    """Two ranks' shapes on one: what every rank sends is taken to be this rank's (values are fake anyway)."""

    size, rank = 2, 0

    def exchange_counts(self, send: torch.Tensor) -> torch.Tensor:
        return send.clone()

    def all_to_all(self, t: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        return t.clone()

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t])

    def exchange_blocks(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()


def test_on_fake_cuda_the_fixed_exchange_makes_no_host_sync_and_the_exchange_by_counts_does():
    with fake_cuda(loading=True):
        w1, w3, w2 = (w[: E // 2].to("cuda") for w in model(3))
        h, weights, experts = (t.to("cuda") for t in tokens(5, 4))
    group = ShapeCollective()
    with fake_cuda():
        out = exchange_experts_fixed(group, h, weights, experts, w1, w3, w2, LIMIT, masked_grouped_gemm, E, 8)
        assert out.shape == (5, D) and out.device.type == "cuda"
    with fake_cuda(), pytest.raises(HostSyncError):
        exchange_experts(group, h, weights, experts,
                         lambda rows, ids: grouped_pairs(rows, ids, 1, E // 2, w1, w3, w2, LIMIT, masked_grouped_gemm),
                         E)


def test_an_unknown_exchange_in_the_environment_is_a_startup_error_naming_the_choices(monkeypatch):
    """A StartupError: the CLI prints it and exits 2 with no traceback (appliance/core/errors.py)."""
    monkeypatch.setenv(EXPERT_EXCHANGE_ENV, "fxed")
    with pytest.raises(EnvironmentSettingError, match="APPLIANCE_EXPERT_EXCHANGE='fxed': expected one of auto, fixed, "
                                                      "counts"):
        expert_exchange_mode()
    monkeypatch.delenv(EXPERT_EXCHANGE_ENV)
    assert expert_exchange_mode() == "auto"
