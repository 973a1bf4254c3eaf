"""device.cpu_threads=null: threads from what the host lets this process use now (npu/cpu_threads.py), never from the
1-minute load average. Every input comes from fake /proc, /sys and cgroup trees written here, so nothing depends on
the load of the machine running the tests: affinity (and SMT siblings), the cgroup v2 / v1 CPU quota of the process's
cgroup and its parents, the tasks runnable now, OMP_NUM_THREADS, the ranks sharing the host. A quiet host gets every
core; a busy one fewer (BENCHMARKS.md "Shared host": OpenMP barriers stall when a thread is descheduled)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import npu.cpu_threads
import npu.host
from npu.backends import CpuBackend
from npu.cpu_threads import (
    CpuQuota,
    HostCpus,
    cgroup_cpu_quota,
    choose_cpu_threads,
    parse_cpu_list,
    read_host_cpus,
    runnable_besides_reader,
    runnable_now,
)

V1_MOUNTS = ("32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
             "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n")
V2_MOUNTS = "31 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def fake_host(tmp: Path, cpus: int = 2, loadavg: str = "0.00 0.00 0.00 1/100 42", siblings: list[str] | None = None,
              cgroup: str = "0::/\n", mounts: str = V2_MOUNTS, files: dict[str, str] | None = None) -> Path:
    """A root directory holding what read_host_cpus reads: /proc/loadavg, /proc/self/cgroup and mountinfo, the CPU
    topology (each CPU its own core unless `siblings` says which CPUs share one) and any cgroup files."""
    def write(path: str, text: str) -> None:
        (tmp / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp / path).write_text(text)
    write("proc/loadavg", loadavg + "\n")
    write("proc/self/cgroup", cgroup)
    write("proc/self/mountinfo", mounts)
    write("sys/devices/system/cpu/online", f"0-{cpus - 1}\n")
    for cpu in range(cpus):
        write(f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list",
              (siblings[cpu] if siblings else str(cpu)) + "\n")
    for path, text in (files or {}).items():
        write(path, text)
    return tmp


def threads_on(root: Path, affinity: set[int], ranks: int = 1, env: dict[str, str] | None = None) -> int:
    host = read_host_cpus(root, affinity, readings=1, env=env or {})
    return choose_cpu_threads(host, ranks).threads


def test_an_idle_2_core_host_whose_load_average_still_holds_a_finished_job_gets_both_cores(tmp_path):
    """The case that used to give 1: the 1-minute average at 1.9 from a job that had just ended (the old rule took it
    for 2 busy cores), while nothing but the reader is runnable now."""
    root = fake_host(tmp_path, cpus=2, loadavg="1.90 2.78 2.84 1/160 13917")
    host = read_host_cpus(root, {0, 1}, readings=1, env={})
    assert host == HostCpus(cpus=2, cores=2, online=2, quota=None, runnable_others=0.0, omp_num_threads=None)
    choice = choose_cpu_threads(host)
    assert (choice.threads, choice.left_beside) == (2, 0)
    assert "every core idle" in choice.reason and "0 other tasks runnable now" in choice.reason


@pytest.mark.parametrize("cpus", [1, 2, 4, 16, 64])
def test_a_quiet_host_gets_every_core_it_has(tmp_path, cpus):
    root = fake_host(tmp_path, cpus=cpus, loadavg="9.50 9.00 8.00 1/900 1")
    assert threads_on(root, set(range(cpus))) == cpus


@pytest.mark.parametrize("running, threads", [
    (1, 2),          # only the reader: both cores
    (2, 1),          # one other task runnable now (a burner): the other core
    (3, 1),          # two: none idle, the least is 1
    (17, 1),         # sixteen: still 1, never 0
])
def test_a_busy_2_core_host_gets_fewer_threads_from_the_tasks_runnable_now(tmp_path, running, threads):
    root = fake_host(tmp_path, cpus=2, loadavg=f"0.00 0.00 0.00 {running}/300 1234")   # the average says idle
    assert threads_on(root, {0, 1}) == threads


def test_runnable_count_leaves_out_the_reader_and_tolerates_its_own_absence():
    assert runnable_besides_reader("0.10 0.05 0.01 5/300 1234\n") == 4
    assert runnable_besides_reader("0.10 0.05 0.01 0/300 1234\n") == 0


def test_a_task_passing_through_one_reading_is_not_taken_for_a_load(tmp_path, monkeypatch):
    """Five readings of /proc/loadavg, the median counts: 8 other tasks in one reading, none in the rest."""
    root = fake_host(tmp_path, cpus=2)
    counts = iter(["9/300", "1/300", "1/300", "1/300"])           # readings 2..5 (the first is fake_host's 1/100)
    counts_seen = []

    def next_reading(seconds: float) -> None:                      # runnable_now sleeps between readings
        running = next(counts)
        counts_seen.append(running)
        (root / "proc/loadavg").write_text(f"0.00 0.00 0.00 {running} 1\n")
    monkeypatch.setattr(npu.cpu_threads.time, "sleep", next_reading)
    assert runnable_now(root, readings=5) == 0.0
    assert len(counts_seen) == 4


def test_tasks_elsewhere_on_the_host_count_in_proportion_to_this_process_s_cpus(tmp_path):
    """4 of 16 CPUs in the affinity and 8 other tasks runnable on the host: about 2 of them on these 4 cores."""
    root = fake_host(tmp_path, cpus=16, loadavg="0.00 0.00 0.00 9/500 1")
    assert threads_on(root, {0, 1, 2, 3}) == 2
    assert threads_on(root, set(range(16))) == 8


def test_smt_siblings_count_as_one_core(tmp_path):
    """4 CPUs, 2 physical cores (CPUs 0 and 2 on one, 1 and 3 on the other): 2 threads, as torch's own default."""
    root = fake_host(tmp_path, cpus=4, siblings=["0,2", "1,3", "0,2", "1,3"])
    host = read_host_cpus(root, {0, 1, 2, 3}, readings=1, env={})
    assert (host.cpus, host.cores) == (4, 2)
    choice = choose_cpu_threads(host)
    assert choice.threads == 2 and "2 cores in this process's affinity, 4 CPUs" in choice.reason


@pytest.mark.parametrize("cpu_max, threads", [
    ("max 100000", 8),           # no limit: every core
    ("200000 100000", 2),        # 2 cores of bandwidth
    ("150000 100000", 1),        # 1.5 rounds down: a second thread would be throttled part of every period
    ("50000 100000", 1),         # under one core: still 1
])
def test_the_cgroup_v2_quota_caps_the_threads(tmp_path, cpu_max, threads):
    root = fake_host(tmp_path, cpus=8, cgroup="0::/app.slice/server.scope\n",
                     files={"sys/fs/cgroup/app.slice/server.scope/cpu.max": cpu_max + "\n"})
    assert threads_on(root, set(range(8))) == threads


def test_a_parent_cgroup_s_quota_applies_to_its_children(tmp_path):
    """The process's own cgroup is unlimited; its parent allows 3 cores, the root is not read for a limit."""
    root = fake_host(tmp_path, cpus=8, cgroup="0::/pods/pod1/container\n", files={
        "sys/fs/cgroup/pods/pod1/container/cpu.max": "max 100000\n",
        "sys/fs/cgroup/pods/pod1/cpu.max": "300000 100000\n",
        "sys/fs/cgroup/pods/cpu.max": "600000 100000\n"})
    quota = cgroup_cpu_quota(root)
    assert quota == CpuQuota(3.0, "/sys/fs/cgroup/pods/pod1/cpu.max 300000 / 100000")
    choice = choose_cpu_threads(read_host_cpus(root, set(range(8)), readings=1, env={}))
    assert choice.threads == 3 and "cgroup CPU quota 3 cores (/sys/fs/cgroup/pods/pod1/cpu.max" in choice.reason


def test_a_container_sees_its_own_cgroup_at_the_mount_root(tmp_path):
    """In a cgroup namespace /proc/self/cgroup says '0::/' and the container's limit sits at the mount point."""
    root = fake_host(tmp_path, cpus=8, cgroup="0::/\n", files={"sys/fs/cgroup/cpu.max": "400000 100000\n"})
    assert cgroup_cpu_quota(root) == CpuQuota(4.0, "/sys/fs/cgroup/cpu.max 400000 / 100000")


@pytest.mark.parametrize("quota_us, threads", [("-1", 8), ("300000", 3)])
def test_the_cgroup_v1_quota_caps_the_threads(tmp_path, quota_us, threads):
    root = fake_host(tmp_path, cpus=8, cgroup="4:memory:/x\n2:cpu,cpuacct:/docker/abc\n0::/\n", mounts=V1_MOUNTS,
                     files={"sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": quota_us + "\n",
                            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert threads_on(root, set(range(8))) == threads


def test_without_cgroup_files_there_is_no_quota(tmp_path):
    root = fake_host(tmp_path, cpus=4, cgroup="0::/gone\n")
    assert cgroup_cpu_quota(root) is None
    assert cgroup_cpu_quota(tmp_path / "no-proc-here") is None


@pytest.mark.parametrize("cores, running, ranks, threads", [
    (8, 1, 2, 4),        # two ranks on a quiet host: half each
    (8, 2, 2, 4),        # the other rank, starting too, is runnable: still its share
    (8, 7, 2, 2),        # fewer when the rest are busy
    (2, 2, 2, 1),        # two ranks on 2 cores: one each
])
def test_ranks_on_one_host_divide_its_cores(tmp_path, cores, running, ranks, threads):
    root = fake_host(tmp_path, cpus=cores, loadavg=f"0.00 0.00 0.00 {running}/300 1")
    assert threads_on(root, set(range(cores)), ranks) == threads


def test_omp_num_threads_caps_the_threads(tmp_path):
    root = fake_host(tmp_path, cpus=8)
    assert threads_on(root, set(range(8)), env={"OMP_NUM_THREADS": "3"}) == 3
    assert threads_on(root, set(range(8)), env={"OMP_NUM_THREADS": "nonsense"}) == 8


def test_cpu_lists_in_the_kernels_format():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


def test_the_reason_names_every_input(tmp_path):
    root = fake_host(tmp_path, cpus=4, loadavg="3.00 3.00 3.00 2/300 1",
                     files={"sys/fs/cgroup/cpu.max": "300000 100000\n"})
    choice = choose_cpu_threads(read_host_cpus(root, {0, 1, 2, 3}, readings=1, env={}))
    assert choice.threads == 3 and choice.usable == 3 and choice.left_beside == 0
    for part in ("4 cores in this process's affinity", "the host has 4 CPUs", "cgroup CPU quota 3 cores",
                 "OMP_NUM_THREADS unset", "so 3 usable", "1 other task runnable now (/proc/loadavg)",
                 "about 1.0 on these cores", "every core idle"):
        assert part in choice.reason


def test_a_cpu_backend_logs_its_choice_and_what_it_leaves_to_the_front_ends(tmp_path, monkeypatch, caplog):
    before = torch.get_num_threads()
    busy = HostCpus(cpus=2, cores=2, online=2, quota=None, runnable_others=16.0)
    quiet = HostCpus(cpus=4, cores=4, online=4, quota=CpuQuota(3.0, "/sys/fs/cgroup/cpu.max 300000 / 100000"),
                     runnable_others=0.0)
    try:
        torch.set_num_threads(2)
        with caplog.at_level(logging.INFO, logger="npu.host"):
            monkeypatch.setattr(npu.host, "read_host_cpus", lambda: busy)
            CpuBackend()
            assert torch.get_num_threads() == 1
            assert "device.cpu_threads=null: 1 intra-op thread (2 cores in this process's affinity" in caplog.text
            assert "16 other tasks runnable now" in caplog.text
            assert "1 of 2 usable cores left to the front ends" in caplog.text
            caplog.clear()
            monkeypatch.setattr(npu.host, "read_host_cpus", lambda: quiet)
            CpuBackend()
            assert torch.get_num_threads() == 3
            assert "all 3 usable cores taken, so the engine's threads share them with the front ends" in caplog.text
        CpuBackend(threads=2)                                      # an explicit setting is kept as given
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
