"""How many intra-op threads the CPU backend runs (device.cpu_threads=null): what the host lets this process use now.

Read once, at start, from the kernel's view of this moment, never from an average that lags behind it (a job that
just finished holds the 1-minute load average up for minutes, and once left an idle 2-core host with 1 thread):

    CPUs         os.sched_getaffinity (what this process may run on); each physical core counted once
                 (/sys/devices/system/cpu/cpuN/topology/thread_siblings_list: SMT siblings share one core's units)
    quota        the cgroup CPU bandwidth of this process's cgroup and every parent: v2 cpu.max, v1
                 cpu.cfs_quota_us / cpu.cfs_period_us (found through /proc/self/cgroup and /proc/self/mountinfo),
                 rounded down: a thread past the quota is throttled, and the others wait for it at the next barrier
    busy now     tasks runnable on the host right now besides the thread reading (/proc/loadavg's running count,
                 median of a few readings), the share of them that falls on this process's CPUs
    OMP_NUM_THREADS, when set: an explicit cap

Threads = the cores nobody else is running on, within the quota and this rank's share of the host's cores (ranks on
one host divide them), at least 1. Why not every core on a busy host: OpenMP's threads meet at a barrier after every
op, so one thread descheduled by another process stalls the rest (BENCHMARKS.md "Shared host": 2 threads were 10-30x
slower than 1 once other work kept the cores busy). A quiet host gets every core it has.

Everything here is a pure function of file contents under `root` (tests feed fake /proc and cgroup trees), except
the affinity, which callers may pass in.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/")
LOADAVG = "proc/loadavg"
CPU_DIR = "sys/devices/system/cpu"
READINGS = 5                 # /proc/loadavg readings whose median is "runnable now" (a passing task is not a load)
READING_INTERVAL_S = 0.01


@dataclass(frozen=True)
class CpuQuota:
    """A cgroup's CPU bandwidth limit: `cores` = quota / period, and the file it was read from."""

    cores: float
    source: str


@dataclass(frozen=True)
class HostCpus:
    """What the thread rule reads, each input as found."""

    cpus: int                  # logical CPUs in this process's affinity
    cores: int                 # physical cores among them (SMT siblings counted once)
    online: int                # logical CPUs online on the host
    quota: CpuQuota | None     # the tightest cgroup CPU quota over this process's cgroups (None: no limit)
    runnable_others: float     # tasks runnable on the host now besides the reading thread
    omp_num_threads: int | None = None


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    usable: int                # cores this process may use (affinity, SMT, quota, OMP_NUM_THREADS)
    reason: str

    @property
    def left_beside(self) -> int:
        """Usable cores the engine's threads leave to everything else in the process (the front ends)."""
        return max(0, self.usable - self.threads)


def choose_cpu_threads(host: HostCpus, ranks_on_host: int = 1) -> ThreadChoice:
    """device.cpu_threads=null: one intra-op thread per usable core that other work is not running on, within this
    rank's share, at least 1 (see the module docstring for why, and what each input is)."""
    usable = host.cores
    limits = []
    if host.quota is not None and host.quota.cores < usable:
        usable = max(1, int(host.quota.cores))
        limits.append(f"cgroup quota {host.quota.cores:g} cores")
    if host.omp_num_threads is not None and host.omp_num_threads < usable:
        usable = host.omp_num_threads
        limits.append(f"OMP_NUM_THREADS={host.omp_num_threads}")
    ranks = max(1, ranks_on_host)
    share = max(1, usable // ranks)
    # Tasks runnable elsewhere on the host fall on this process's CPUs in proportion (the scheduler spreads them).
    busy = host.runnable_others * min(1.0, host.cpus / max(1, host.online))
    free = host.cores - round(busy)
    threads = max(1, min(share, free))
    if free >= share:
        why = f"{share} idle for this rank" if ranks > 1 else "every core idle"
    else:
        why = f"only {free} idle" if free >= 1 else "none idle, so the least: 1"
    smt = f", {host.cpus} CPUs" if host.cpus != host.cores else ""
    quota = f"cgroup CPU quota {host.quota.cores:g} cores ({host.quota.source})" if host.quota else "no cgroup CPU quota"
    omp = f"OMP_NUM_THREADS={host.omp_num_threads}" if host.omp_num_threads is not None else "OMP_NUM_THREADS unset"
    limit = f", so {usable} usable" if limits else ""
    rank_part = f", {ranks} ranks sharing them" if ranks > 1 else ""
    others = f"{host.runnable_others:g} other task{'' if host.runnable_others == 1 else 's'}"
    reason = (f"{host.cores} cores in this process's affinity{smt} (the host has {host.online} CPUs), {quota}, {omp}"
              f"{limit}{rank_part}; {others} runnable now (/proc/loadavg), about {busy:.1f} on these cores: {why}")
    return ThreadChoice(threads, usable, reason)


# -- reading the host ------------------------------------------------------------------------------

def read_host_cpus(root: Path = ROOT, affinity: set[int] | None = None, readings: int = READINGS,
                   env: Mapping[str, str] | None = None) -> HostCpus:
    """Every input of choose_cpu_threads, read now under `root` (affinity: os.sched_getaffinity unless given)."""
    cpus = sorted(affinity if affinity is not None else os.sched_getaffinity(0))
    return HostCpus(cpus=len(cpus), cores=physical_cores(root, cpus), online=online_cpus(root) or len(cpus),
                    quota=cgroup_cpu_quota(root), runnable_others=runnable_now(root, readings),
                    omp_num_threads=omp_num_threads(os.environ if env is None else env))


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' (the kernel's CPU list format) -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    return out


def online_cpus(root: Path) -> int | None:
    try:
        return len(parse_cpu_list((root / CPU_DIR / "online").read_text()))
    except (OSError, ValueError):
        return None


def physical_cores(root: Path, cpus: list[int]) -> int:
    """Distinct physical cores among `cpus`: CPUs listing the same SMT siblings share one core."""
    cores = set()
    for cpu in cpus:
        try:
            cores.add((root / CPU_DIR / f"cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(cpu))          # no topology: each CPU its own core
    return max(1, len(cores))


def runnable_besides_reader(loadavg: str) -> int:
    """/proc/loadavg's running count ('0.52 0.58 0.59 3/160 1234': 3 runnable now) minus the reading thread."""
    return max(0, int(loadavg.split()[3].split("/")[0]) - 1)


def runnable_now(root: Path, readings: int = READINGS) -> float:
    """Tasks runnable on the host now besides this thread: the median of a few readings, READING_INTERVAL_S apart,
    so a task passing through one reading is not taken for a load."""
    values = []
    for i in range(max(1, readings)):
        if i:
            time.sleep(READING_INTERVAL_S)
        try:
            values.append(runnable_besides_reader((root / LOADAVG).read_text()))
        except (OSError, IndexError, ValueError):
            return 0.0                   # no /proc: nothing known to be busy
    return float(statistics.median(values))


def omp_num_threads(env: Mapping[str, str]) -> int | None:
    """OMP_NUM_THREADS as a cap (its first value; OpenMP's nested lists are 'a,b'), None when unset or invalid."""
    try:
        value = int(env.get("OMP_NUM_THREADS", "").split(",")[0])
    except ValueError:
        return None
    return value if value > 0 else None


def cgroup_cpu_quota(root: Path = ROOT) -> CpuQuota | None:
    """The tightest CPU bandwidth limit over this process's cgroup and its parents (v2 and v1 alike), or None."""
    try:
        memberships = (root / "proc/self/cgroup").read_text().splitlines()
        mounts = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    found = []
    for hierarchy in cgroup_cpu_dirs(root, memberships, mounts):
        found += hierarchy.limits(root)
    return min(found, key=lambda q: q.cores, default=None)


V2_FILES = ("cpu.max",)
V1_FILES = ("cpu.cfs_quota_us", "cpu.cfs_period_us")


@dataclass(frozen=True)
class CgroupDir:
    """This process's cgroup directory in one mounted hierarchy, the hierarchy's mount point, and its quota files."""

    directory: Path
    mount_point: Path
    files: tuple[str, ...]

    def limits(self, root: Path) -> list[CpuQuota]:
        """Every quota set on the directory or a parent of it up to the mount point (the tightest applies)."""
        out, directory = [], self.directory
        while True:
            quota = read_quota(directory, self.files, root)
            if quota is not None:
                out.append(quota)
            if directory == self.mount_point or self.mount_point not in directory.parents:
                return out
            directory = directory.parent


def cgroup_cpu_dirs(root: Path, memberships: list[str], mounts: list[str]) -> list[CgroupDir]:
    """The v2 hierarchy and a v1 hierarchy with the cpu controller, where mounted. /proc/self/cgroup lines are
    'id:controllers:path' (v2: '0::path'); a mountinfo line's fields 4 and 5 are the mount's root within its
    hierarchy and its mount point, and after ' - ' come the filesystem type, source and options (v1: controllers)."""
    paths: dict[str, str] = {}
    for line in memberships:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":
            paths["v2"] = path
        elif "cpu" in controllers.split(","):
            paths["v1"] = path
    out = []
    for line in mounts:
        head, sep, tail = line.partition(" - ")
        fields, kind = head.split(), tail.split()
        if not sep or len(fields) < 5 or not kind:
            continue
        version = "v2" if kind[0] == "cgroup2" else \
            "v1" if kind[0] == "cgroup" and len(kind) > 2 and "cpu" in kind[2].split(",") else None
        if version is None or version not in paths:
            continue
        mount_root, mount_point = fields[3], Path(os.path.normpath(root / fields[4].lstrip("/")))
        path = paths.pop(version)        # the first mount of a hierarchy is the one read
        # a namespaced mount (a container's) shows the process's cgroup from its own root
        inside = os.path.relpath(path, mount_root) if (path + "/").startswith(mount_root.rstrip("/") + "/") else "."
        out.append(CgroupDir(Path(os.path.normpath(mount_point / inside)), mount_point,
                             V2_FILES if version == "v2" else V1_FILES))
    return out


def read_quota(directory: Path, files: tuple[str, ...], root: Path = ROOT) -> CpuQuota | None:
    """One cgroup's limit: v2 cpu.max 'QUOTA PERIOD' ('max PERIOD': none), v1 cfs_quota_us (-1: none) over
    cfs_period_us."""
    try:
        if files == V2_FILES:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            values = None if quota == "max" else (int(quota), int(period))
        else:
            quota_us = int((directory / "cpu.cfs_quota_us").read_text())
            values = None if quota_us < 0 else (quota_us, int((directory / "cpu.cfs_period_us").read_text()))
    except (OSError, ValueError):
        return None
    if values is None or values[1] <= 0:
        return None
    shown = "/" + os.path.relpath(directory, root)
    return CpuQuota(values[0] / values[1], f"{os.path.normpath(shown)}/{files[0]} {values[0]} / {values[1]}")
