"""The compiled greedy argmax (npu/kernels/argmax.cpp through npu.sampler.greedy_ids): the id numpy's and torch's
argmax give (first maximal id; a NaN above every number, the first NaN winning) on rows of every length around its
64-element chunks, in float32 and bfloat16, on one thread and many, on strided rows; and the sampler really runs it
on the CPU. The rules themselves on small crafted rows: test_sampler.py."""

import math
import shutil

import numpy
import pytest
import torch

from npu.sampler import cpu_argmax, greedy_ids
from tests.support.threads import on_threads

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler: greedy_ids takes numpy's argmax (test_sampler.py)")

DTYPES = (torch.float32, torch.bfloat16)


def numpy_argmax(logits: torch.Tensor) -> list[int]:
    """The oracle: numpy on the float32 values (bf16 -> float32 is exact and keeps the order)."""
    return numpy.argmax(logits.float().numpy(), axis=-1).tolist()


def kernel(dtype):
    op = cpu_argmax(dtype)
    assert op is not None, "the CPU kernels did not build (see the log)"
    return op


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 2, 63, 64, 65, 127, 129, 1000, 32000])
def test_argmax_is_numpys_on_coarse_rows_full_of_ties(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-5, 6, (37, vocab), generator=g).to(dtype)
    assert kernel(dtype)(logits) == numpy_argmax(logits) == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_infinities_follow_numpy_and_torch(dtype):
    vocab = 300
    logits = torch.zeros(8, vocab).to(dtype)
    logits[0, 5] = logits[0, 200] = math.nan                  # the first NaN wins
    logits[1, 250] = math.nan
    logits[1, 10] = math.inf                                  # over +inf too
    logits[2] = -math.inf                                     # a fully masked row: id 0
    logits[3] = -math.inf
    logits[3, 299] = -1e30                                    # the last column
    logits[4, 70] = logits[4, 130] = math.inf                 # the first +inf
    logits[5, 64] = -math.nan                                 # a NaN with its sign bit set is a NaN too
    logits[6] = -5.0
    logits[6, 63], logits[6, 64] = 3.0, 3.0                   # a tie across a chunk boundary
    expected = [5, 250, 0, 299, 70, 64, 63, 0]
    assert kernel(dtype)(logits) == expected
    assert logits.float().argmax(-1).tolist() == expected == numpy_argmax(logits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_threads_give_the_same_ids(dtype):
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(64, 32000 + 77, generator=g).to(dtype)
    logits = wide[:, 5:32005]                                 # rows a longer stride apart
    expected = numpy_argmax(logits)
    assert greedy_ids(logits) == expected
    assert greedy_ids(wide[:, ::3]) == numpy_argmax(wide[:, ::3])     # columns apart: copied first
    for n in (1, 3):
        assert on_threads(n, greedy_ids, logits) == expected


def test_the_sampler_runs_the_kernel_on_cpu(monkeypatch):
    calls = []
    op = kernel(torch.bfloat16)
    real = op.fn

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(op, "fn", counted)
    logits = torch.randn(4, 500).to(torch.bfloat16)
    assert greedy_ids(logits) == numpy_argmax(logits)
    assert len(calls) == 1
