"""The sampler's rules on crafted logits (npu/sampler.py): greedy, top-k, top-p, temperature, and seeded
per-request generators. Expected sets and frequencies are computed here from the logits, never read back
from the sampler; the chi-square tests run at fixed seeds, so they are deterministic."""

import dataclasses
import math

import pytest
import torch
from scipy.stats import chisquare

from appliance.core.request import SamplingParams
from npu.sampler import Sampler, greedy_ids

VOCAB = 64


def crafted_logits(rows: int, seed: int = 0) -> torch.Tensor:
    """Distinct values in a random order per row, so argmax and the top-k sets are unambiguous."""
    g = torch.Generator().manual_seed(seed)
    values = torch.linspace(-4.0, 4.0, VOCAB)
    return torch.stack([values[torch.randperm(VOCAB, generator=g)] for _ in range(rows)])


def draws(logits: torch.Tensor, params: SamplingParams, n: int, request_id: str = "r") -> list[int]:
    """n tokens from one request's generator (one row per call, as a decoding request sees them)."""
    sampler = Sampler(torch.device("cpu"))
    return [sampler.sample(logits[None], [(request_id, params)])[0] for _ in range(n)]


def one_draw_per_seed(logits: torch.Tensor, params: SamplingParams, seeds: range) -> set[int]:
    """The ids that appear when each seed samples once (a fresh request per seed)."""
    sampler = Sampler(torch.device("cpu"))
    rows = [(f"s{seed}", dataclasses.replace(params, seed=seed)) for seed in seeds]
    return set(sampler.sample(logits.expand(len(rows), -1).contiguous(), rows))


def test_greedy_takes_the_argmax_of_every_row():
    logits = crafted_logits(9)
    expected = [max(range(VOCAB), key=lambda i: logits[r, i].item()) for r in range(9)]
    rows = [(f"g{r}", SamplingParams(temperature=0.0)) for r in range(9)]
    assert Sampler(torch.device("cpu")).sample(logits, rows) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_greedy_ids_take_the_first_maximal_id_like_torch_argmax(dtype):
    # Coarse values make ties common (bfloat16 rounds many of them together); ties go to the first id.
    g = torch.Generator().manual_seed(4)
    logits = torch.randint(-3, 4, (40, VOCAB), generator=g).to(dtype)
    logits[0] = -math.inf
    logits[1, 7] = logits[1, 50] = 10.0
    expected = [next(i for i in range(VOCAB) if logits[r, i] == logits[r].max()) for r in range(40)]
    assert greedy_ids(logits) == expected
    assert expected[0] == 0 and expected[1] == 7
    assert greedy_ids(logits[:, ::2]) == logits[:, ::2].argmax(dim=-1).tolist()   # a strided view


def test_greedy_rows_mixed_with_sampled_rows_stay_greedy():
    logits = crafted_logits(6, seed=1)
    expected = [max(range(VOCAB), key=lambda i: logits[r, i].item()) for r in range(0, 6, 2)]
    rows = [(f"m{r}", SamplingParams(temperature=0.0 if r % 2 == 0 else 1.5, seed=r)) for r in range(6)]
    tokens = Sampler(torch.device("cpu")).sample(logits, rows)
    assert tokens[0::2] == expected


def test_bfloat16_logits_draw_what_their_float32_values_draw():
    # Runners return logits in the model's dtype; the sampler widens them, so a row draws the same token as the
    # same values in float32 (greedy rows and seeded sampled rows alike).
    logits = (crafted_logits(12, seed=2) * 1.7).to(torch.bfloat16)
    rows = [(f"b{r}", SamplingParams(temperature=0.0 if r % 3 == 0 else 0.8, top_k=0 if r % 2 else 5, seed=r))
            for r in range(12)]
    assert Sampler(torch.device("cpu")).sample(logits, rows) == Sampler(torch.device("cpu")).sample(logits.float(), rows)


def test_top_k_1_equals_greedy_for_every_seed():
    logits = crafted_logits(1, seed=2)[0]
    best = max(range(VOCAB), key=lambda i: logits[i].item())
    assert one_draw_per_seed(logits, SamplingParams(temperature=1.0, top_k=1), range(200)) == {best}


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_draws_exactly_the_k_best_ids(k):
    # Nearly flat logits: every one of the k best ids is likely, and the (k+1)-th would be too if it leaked.
    logits = crafted_logits(1, seed=k)[0] * 0.05
    best = set(sorted(range(VOCAB), key=lambda i: -logits[i].item())[:k])
    assert one_draw_per_seed(logits, SamplingParams(temperature=1.0, top_k=k), range(400)) == best


@pytest.mark.parametrize("top_p, kept", [(0.3, 1), (0.65, 2), (0.75, 3), (0.95, 4), (1.0, 5)])
def test_top_p_keeps_the_shortest_prefix_reaching_p(top_p, kept):
    # Probabilities 0.4, 0.3, 0.2, 0.08, 0.02 on shuffled ids: the prefixes reach 0.4, 0.7, 0.9, 0.98, 1.0.
    probs = torch.tensor([0.4, 0.3, 0.2, 0.08, 0.02])
    ids = [17, 3, 40, 8, 29]
    logits = torch.full((VOCAB,), -1e9)
    logits[ids] = probs.log()
    seen = one_draw_per_seed(logits, SamplingParams(temperature=1.0, top_p=top_p), range(600))
    assert seen == set(ids[:kept])


def test_top_p_renormalizes_over_the_kept_prefix():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = torch.full((VOCAB,), -1e9)
    logits[:4] = probs.log()
    n = 3000
    tokens = draws(logits, SamplingParams(temperature=1.0, top_p=0.85, seed=11), n)
    counts = [tokens.count(i) for i in range(3)]
    assert sum(counts) == n
    kept = probs[:3].double()
    expected = (kept / kept.sum() * n).tolist()
    assert chisquare(counts, expected).pvalue > 1e-3


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_match_softmax_of_logits_over_temperature(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -1.5, 0.25, 0.75])
    n = 4000
    tokens = draws(logits, SamplingParams(temperature=temperature, seed=1234), n)
    counts = [tokens.count(i) for i in range(len(logits))]
    assert sum(counts) == n
    expected = (torch.softmax(logits.double() / temperature, dim=0) * n).tolist()
    assert chisquare(counts, expected).pvalue > 1e-3
    # The same counts are far from a wrong temperature: the test can tell temperatures apart.
    wrong = (torch.softmax(logits.double() / (temperature * 2), dim=0) * n).tolist()
    assert chisquare(counts, wrong).pvalue < 1e-6


def test_a_seeded_row_is_unchanged_when_its_batch_neighbours_change():
    logits = crafted_logits(5, seed=3) * 0.3
    target = ("target", SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=77))

    def run(neighbours: list[tuple[str, SamplingParams]], position: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"), base_seed=position)
        rows = neighbours[:position] + [target] + neighbours[position:]
        out = []
        for step in range(30):
            batch = logits.roll(step, dims=1)[:len(rows)].clone()
            batch[position] = logits[0].roll(step)
            out.append(sampler.sample(batch, rows)[position])
        return out

    alone = run([], 0)
    crowded = run([("a", SamplingParams(temperature=0.7, seed=1)), ("b", SamplingParams()),
                   ("c", SamplingParams(temperature=1.3)), ("d", SamplingParams(temperature=1.0, top_k=3))], 2)
    reordered = run([("e", SamplingParams(temperature=2.0, seed=77))], 1)
    assert alone == crowded == reordered
    assert len(set(alone)) > 3, "the target row must really sample"


def test_requests_with_the_same_seed_draw_the_same_tokens_and_other_seeds_differ():
    logits = torch.zeros(4, VOCAB)
    rows = [("x", SamplingParams(temperature=1.0, seed=5)), ("y", SamplingParams(temperature=1.0, seed=5)),
            ("z", SamplingParams(temperature=1.0, seed=6)), ("w", SamplingParams(temperature=1.0, seed=6))]
    sampler = Sampler(torch.device("cpu"))
    steps = [sampler.sample(logits, rows) for _ in range(20)]
    x, y, z, w = ([s[i] for s in steps] for i in range(4))
    assert x == y and z == w and x != z


def test_unseeded_requests_get_distinct_generators_reproducible_from_the_engine_seed():
    logits = torch.zeros(3, VOCAB)
    rows = [(f"u{i}", SamplingParams(temperature=1.0)) for i in range(3)]

    def run(base_seed: int) -> list[tuple[int, ...]]:
        sampler = Sampler(torch.device("cpu"), base_seed=base_seed)
        return [tuple(sampler.sample(logits, rows)) for _ in range(20)]

    first = run(0)
    assert first == run(0)
    assert first != run(1)
    streams = list(zip(*first, strict=True))
    assert len(set(streams)) == 3, "each request must draw from its own generator"


def test_release_forgets_the_generator():
    logits = torch.zeros(1, VOCAB)
    row = [("again", SamplingParams(temperature=1.0, seed=9))]
    sampler = Sampler(torch.device("cpu"))
    first = [sampler.sample(logits, row)[0] for _ in range(10)]
    sampler.release("again")
    assert [sampler.sample(logits, row)[0] for _ in range(10)] == first


def test_temperature_sampling_never_draws_an_impossible_token():
    logits = torch.full((2, VOCAB), -math.inf)
    logits[0, 5] = logits[0, 9] = 0.0
    logits[1, 60] = 1.0
    sampler = Sampler(torch.device("cpu"))
    rows = [("i", SamplingParams(temperature=0.8, seed=1)), ("j", SamplingParams(temperature=3.0, seed=2))]
    seen = [sampler.sample(logits, rows) for _ in range(60)]
    assert {a for a, _ in seen} == {5, 9} and {b for _, b in seen} == {60}
