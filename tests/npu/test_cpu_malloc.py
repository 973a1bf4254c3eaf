"""keep_freed_memory: a freed multi-MB tensor's pages are reused by the next one, not faulted in anew."""

import resource

import pytest
import torch

from npu.cpu_malloc import keep_freed_memory

MIB = 1 << 20
PAGE = resource.getpagesize()


def faults_of_fresh_tensors(nbytes: int, count: int = 4) -> int:
    """Minor page faults taken while `count` tensors are allocated and filled, live together as a step's
    activations are, then all freed."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step = [torch.empty(nbytes // 4).fill_(1.0) for _ in range(count)]
    del step
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_freed_tensor_memory_is_reused_by_the_next_tensor():
    if not keep_freed_memory():
        pytest.skip("no glibc mallopt on this host")
    fresh_pages = 4 * (16 * MIB) // PAGE            # what glibc's defaults fault in: every tensor anew
    rounds = [faults_of_fresh_tensors(16 * MIB) for _ in range(8)]     # the heap takes a few rounds to grow
    assert max(rounds[-3:]) < fresh_pages // 10, rounds                 # then every step reuses its pages
