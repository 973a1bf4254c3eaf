"""device.cpu_threads=null on a shared host: one intra-op thread per core that other work leaves idle (and this
rank's share of the cores), never fewer than 1, the choice logged with its reason. BENCHMARKS.md "Shared host"
has the measurements behind the rule (2 threads were 10-30x slower than 1 once the cores were busy)."""

from __future__ import annotations

import logging

import pytest
import torch

import npu.backends
from npu.backends import CpuBackend, auto_cpu_threads, host_busy_cores


@pytest.mark.parametrize("cores, busy, ranks, threads", [
    (2, 0.2, 1, 2),          # idle: every core
    (2, 0.9, 1, 1),          # one core busy: the other
    (2, 2.0, 1, 1),          # two burners
    (2, 15.0, 1, 1),         # load 15: one thread, never 0
    (8, 3.0, 1, 5),          # the cores nobody uses
    (8, 0.0, 2, 4),          # two ranks on the host: half each
    (8, 6.0, 2, 2),          # and fewer when the rest are busy
])
def test_threads_are_the_idle_cores_of_this_ranks_share(cores, busy, ranks, threads):
    choice = auto_cpu_threads(cores, busy, ranks)
    assert choice.threads == threads
    assert f"{cores} cores" in choice.reason and f"{busy:.1f} busy" in choice.reason


@pytest.mark.parametrize("loadavg, busy", [
    ("0.10 0.05 0.01 5/300 1234\n", 4.0),    # 5 runnable now, this process one of them: a load that just began
    ("3.50 2.00 1.00 1/300 1234\n", 3.5),    # the average when it is the larger
])
def test_busy_cores_are_the_load_average_or_the_runnable_processes_now(tmp_path, loadavg, busy):
    path = tmp_path / "loadavg"
    path.write_text(loadavg)
    assert host_busy_cores(str(path)) == busy


def test_a_cpu_backend_on_a_busy_host_runs_one_thread_and_says_why(tmp_path, monkeypatch, caplog):
    busy = tmp_path / "loadavg"
    busy.write_text("15.00 15.00 15.00 17/400 999\n")
    monkeypatch.setattr(npu.backends, "LOADAVG", str(busy))
    before = torch.get_num_threads()
    monkeypatch.setattr(npu.backends, "cpu_cores", lambda: 2)     # as on a 2-core host, whatever this one has
    try:
        torch.set_num_threads(2)
        with caplog.at_level(logging.INFO, logger="npu.backends"):
            CpuBackend()
        assert torch.get_num_threads() == 1
        assert "device.cpu_threads=null: 1 intra-op thread (2 cores, about 16.0 busy" in caplog.text
        CpuBackend(threads=2)                                      # an explicit setting is kept as given
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
