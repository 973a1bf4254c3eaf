"""The sampler's bookkeeping around the draws (npu/sampler.py), written against the mutants docs/TESTING.md
lists: releasing a request that never drew, and the rows the startup profile samples."""

import torch

from appliance.core.request import SamplingParams
from npu.sampler import Sampler, worst_case_rows


def test_releasing_a_request_that_never_drew_is_harmless():
    """Greedy requests never get a generator, and the engine releases every request it finishes."""
    sampler = Sampler(torch.device("cpu"))
    assert sampler.sample(torch.tensor([[0.0, 3.0, 1.0]]), [("greedy", SamplingParams())]) == [1]
    sampler.release("greedy")
    sampler.release("never seen")


def test_worst_case_rows_take_the_costliest_path_each_with_its_own_generator():
    rows = worst_case_rows(5)
    assert len({request_id for request_id, _ in rows}) == 5
    for _, params in rows:
        assert not params.greedy and params.top_k > 0 and 0 < params.top_p < 1
    vocab = 64
    logits = torch.linspace(-4.0, 4.0, vocab).expand(5, vocab).contiguous()
    tokens = Sampler(torch.device("cpu"), base_seed=1).sample(logits, rows)
    ranked = sorted(range(vocab), key=lambda i: -logits[0, i].item())
    assert set(tokens) <= set(ranked[:rows[0][1].top_k])
