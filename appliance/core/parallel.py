"""Where each rank sits: tensor-, data- and expert-parallel sizes resolved from the config, and one rank's place.

One process per device (a rank). Ranks are numbered data-major: rank = data_rank x tensor + tensor_rank, so
the ranks of one tensor-parallel group are neighbours (on one host, where the fast links are). Expert parallel
cuts the same ranks into groups of `expert` neighbours: rank r holds the routed experts of slice
r mod expert, and every expert group holds all experts once.

    world  = tensor x data                      (= device.count)
    expert | world and expert | num_experts     (1 for an arch without routed experts)

`resolve_parallel` fills the sizes the config leaves null (data: device.count / tensor; expert: as wide as the
experts allow, gcd(world, num_experts)) and checks them against the architecture (which parallelism it
declares in appliance.core.archs and the divisibility its math needs), so mode=validate, mode=plan and the
runtime all read the same resolved sizes. Torch-free: the planner and the estimate read it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from appliance.core.config import ParallelSettings
from appliance.core.errors import ConfigIssue


@dataclass(frozen=True)
class TensorSlice:
    """The part of a checkpoint tensor one rank holds: indices [start, stop) along `dim`."""

    dim: int
    start: int
    stop: int

    def shape_of(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[:self.dim] + (self.stop - self.start,) + shape[self.dim + 1:]


def split(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when `size` is cut into `parts` contiguous parts whose sizes differ by at
    most one, larger ones first (torch.tensor_split's rule)."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class RankPlace:
    """One rank's coordinates. `single()` is the one-process deployment (every size 1)."""

    rank: int
    tensor: int = 1
    data: int = 1
    expert: int = 1

    @classmethod
    def single(cls) -> RankPlace:
        return cls(0)

    @property
    def world(self) -> int:
        return self.tensor * self.data

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor

    @property
    def data_rank(self) -> int:
        return self.rank // self.tensor

    @property
    def expert_rank(self) -> int:
        return self.rank % self.expert

    def tensor_slice(self, dim: int, size: int) -> TensorSlice:
        """This rank's slice of a tensor divided over its tensor-parallel group along `dim` (of length size)."""
        return TensorSlice(dim, *split(size, self.tensor, self.tensor_rank))

    def experts(self, num_experts: int) -> range:
        """The routed experts this rank holds (a contiguous 1/expert of them)."""
        return range(*split(num_experts, self.expert, self.expert_rank))

    def describe(self) -> str:
        parts = [f"rank {self.rank} of {self.world}"]
        if self.tensor > 1:
            parts.append(f"tensor {self.tensor_rank}/{self.tensor}")
        if self.data > 1:
            parts.append(f"data {self.data_rank}/{self.data}")
        if self.expert > 1:
            parts.append(f"expert {self.expert_rank}/{self.expert}")
        return ", ".join(parts)


def rank_places(parallel: ParallelSettings) -> list[RankPlace]:
    """Every rank of a resolved deployment, in rank order."""
    return [place_of(parallel, r) for r in range(world_size(parallel))]


def place_of(parallel: ParallelSettings, rank: int) -> RankPlace:
    return RankPlace(rank, parallel.tensor_parallel_size, parallel.data_parallel_size or 1,
                     parallel.expert_parallel_size or 1)


def world_size(parallel: ParallelSettings) -> int:
    return parallel.tensor_parallel_size * (parallel.data_parallel_size or 1)


def resolve_parallel(parallel: ParallelSettings, device_count: int | None, supported: frozenset[str],
                     num_experts: int, arch: str) -> tuple[ParallelSettings, list[ConfigIssue]]:
    """The sizes with nulls filled, and every rule they break (key paths under `parallel.`).

    `supported` is the architecture's declared parallelism ("tensor", "data", "expert"); num_experts its
    routed experts per layer (0: none)."""
    issues: list[ConfigIssue] = []
    devices = device_count or 1
    tp, dp, ep = parallel.tensor_parallel_size, parallel.data_parallel_size, parallel.expert_parallel_size
    for key, value in (("tensor_parallel_size", tp), ("data_parallel_size", dp), ("expert_parallel_size", ep)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            issues.append(ConfigIssue(f"parallel.{key}", value, "must be a positive integer"))
    if not (isinstance(parallel.startup_timeout_s, (int, float)) and parallel.startup_timeout_s > 0):
        issues.append(ConfigIssue("parallel.startup_timeout_s", parallel.startup_timeout_s, "must be > 0 seconds"))
    if issues:
        return parallel, issues
    if dp is None:
        if devices % tp:
            issues.append(ConfigIssue("parallel.tensor_parallel_size", tp,
                                      f"must divide device.count ({devices}): one rank per device"))
            return parallel, issues
        dp = devices // tp
    elif tp * dp != devices:
        issues.append(ConfigIssue("parallel.data_parallel_size", dp,
                                  f"tensor_parallel_size x data_parallel_size = {tp} x {dp} = {tp * dp} must equal "
                                  f"device.count ({devices}): one rank per device. Fix: device.count={tp * dp}"))
        return parallel, issues
    world = tp * dp
    if ep is None:
        ep = math.gcd(world, num_experts) if "expert" in supported and num_experts else 1
    wanted = {"tensor": tp, "data": dp, "expert": ep}
    declared = ", ".join(sorted(supported)) or "none"
    for kind, size in wanted.items():
        if size > 1 and kind not in supported:
            issues.append(ConfigIssue(f"parallel.{kind}_parallel_size", size,
                                      f"arch {arch} supports {declared} parallelism, not {kind}: must be 1"))
    if ep > 1 and "expert" in supported:
        if world % ep:
            issues.append(ConfigIssue("parallel.expert_parallel_size", ep,
                                      f"must divide the world size tensor x data = {world}"))
        if num_experts % ep:
            issues.append(ConfigIssue("parallel.expert_parallel_size", ep,
                                      f"must divide model.layout.num_experts ({num_experts}): each rank holds an "
                                      f"equal share of the routed experts"))
    return replace(parallel, data_parallel_size=dp, expert_parallel_size=ep), issues
