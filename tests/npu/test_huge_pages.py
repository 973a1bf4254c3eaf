"""npu.huge_pages: a CPU pool's 2 MiB-aligned interior is advised for huge pages before it is written, and
nothing else (small tensors, the switch off)."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from appliance.config.compose import load_runtime_config
from npu import runner as runner_module
from npu.huge_pages import HUGE_PAGE, SWITCH, advise_huge_pages, aligned_interior
from npu.qwen3.runner import Qwen3Runner

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/proc/self/smaps").exists(),
                                reason="madvise and /proc/self/smaps are Linux's")


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping that holds address (/proc/self/smaps): 'hg' is MADV_HUGEPAGE's."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:               # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_aligned_interior_rounds_inwards():
    assert aligned_interior(HUGE_PAGE + 16, 3 * HUGE_PAGE) == (2 * HUGE_PAGE, 4 * HUGE_PAGE)
    assert aligned_interior(2 * HUGE_PAGE, 2 * HUGE_PAGE) == (2 * HUGE_PAGE, 4 * HUGE_PAGE)
    first, last = aligned_interior(HUGE_PAGE + 16, HUGE_PAGE)      # no whole 2 MiB inside
    assert first == last


def fresh_mapping(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A tensor over a new anonymous mapping: torch.empty may reuse heap memory an earlier test advised (glibc serves
    a large request from freed heap chunks first, and this process never trims its heap: npu.cpu_malloc)."""
    region = mmap.mmap(-1, nbytes)
    return region, torch.frombuffer(region, dtype=torch.uint8)


def test_a_large_tensor_is_advised_before_it_is_written(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    region, t = fresh_mapping(48 << 20)
    first, last = aligned_interior(t.data_ptr(), t.numel())
    assert "hg" not in vm_flags(first)
    assert advise_huge_pages(t) == last - first > 0
    assert "hg" in vm_flags(first) and "hg" in vm_flags(last - 1)
    t.fill_(7)                                                     # the memory is the tensor's as before
    assert int(t[first - t.data_ptr()]) == 7 and int(t[-1]) == 7
    del t
    region.close()


def test_small_tensors_and_the_switch_are_left_alone(monkeypatch):
    assert advise_huge_pages(torch.empty(HUGE_PAGE // 2, dtype=torch.uint8)) == 0
    monkeypatch.setenv(SWITCH, "0")
    region, t = fresh_mapping(48 << 20)
    first, _ = aligned_interior(t.data_ptr(), t.numel())
    assert advise_huge_pages(t) == 0
    assert "hg" not in vm_flags(first)
    del t
    region.close()


def test_a_cpu_runner_pool_is_advised(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    advised: list[tuple[torch.Tensor, int]] = []

    def recorded(t: torch.Tensor) -> int:
        advised.append((t, advise_huge_pages(t)))
        return advised[-1][1]

    monkeypatch.setattr(runner_module, "advise_huge_pages", recorded)
    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu"])
    runner = Qwen3Runner(rc.model, "cpu")
    spec = runner.cache_specs[0]
    page_bytes = spec.num_layers * spec.rows_per_block * runner.row_elements(spec) * 4
    runner.allocate_pools({spec.name: (64 << 20) // page_bytes}, 1)
    pool = runner.pools[spec.name]
    first, last = aligned_interior(pool.data_ptr(), pool.numel() * pool.element_size())
    assert [(t.data_ptr(), n) for t, n in advised] == [(pool.data_ptr(), last - first)] and last > first
    assert "hg" in vm_flags(first) and "hg" in vm_flags(last - 1)
