"""Grammar bitmasks in the sampler (npu/sampler.py): a constrained row keeps exactly the allowed logits, every
other row is left as it was, and greedy and sampled draws then only pick allowed tokens."""

import numpy
import torch

from appliance.core.request import SamplingParams
from npu.sampler import Sampler, allowed_tokens, apply_token_bitmask


def bitmask_of(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    """The llguidance layout built independently: bit j of int32 word w allows id 32 * w + j."""
    words = numpy.zeros((len(allowed), -(-vocab // 32)), dtype=numpy.uint32)
    for row, ids in enumerate(allowed):
        for t in ids:
            words[row, t // 32] |= numpy.uint32(1) << numpy.uint32(t % 32)
    return torch.from_numpy(words.view(numpy.int32))


def test_allowed_tokens_reads_every_bit_including_the_sign_bit():
    allowed = [{0, 31, 32, 63, 70}, set(range(71))]
    got = allowed_tokens(bitmask_of(allowed, 71), 71)
    assert [set(torch.nonzero(row).flatten().tolist()) for row in got] == allowed


def test_only_the_listed_rows_are_masked():
    vocab = 100
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    allowed = {3, 40, 99}
    apply_token_bitmask(logits, [1], bitmask_of([allowed], vocab))
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = set(torch.nonzero(torch.isfinite(logits[1])).flatten().tolist())
    assert finite == allowed
    assert torch.equal(logits[1, sorted(allowed)], before[1, sorted(allowed)])


def test_greedy_and_sampled_rows_draw_only_allowed_tokens():
    vocab = 64
    logits = torch.linspace(4.0, -4.0, vocab).expand(4, vocab).contiguous()   # token 0 is the most likely
    allowed = [{10, 50}, {63}]
    apply_token_bitmask(logits, [0, 2], bitmask_of(allowed, vocab))
    rows = [("g", SamplingParams()), ("u", SamplingParams()),
            ("s", SamplingParams(temperature=1.0, seed=3)), ("t", SamplingParams(temperature=1.0, seed=4))]
    tokens = Sampler(torch.device("cpu")).sample(logits, rows)
    assert tokens[0] == 10 and tokens[1] == 0 and tokens[2] == 63
