"""One rank of a two-rank launch with a scripted memory probe (for tests/npu/test_ranks.py), as its own process:

    python -m tests.npu.rank_launch RANK TOTAL_BYTES [--port PORT] [--timeout SECONDS]
                                    [--pool-limit BYTES --free-after BYTES]

Rank 0 hosts the rendezvous store and prints `port N` first; rank 1 is given that port. Each runs the real
launcher with the real qwen3_tiny tensor-parallel runner on the CPU, but its device's total memory and peak come
from a FakeMemoryProbe, so one rank can have less memory than the other. Prints the startup report as JSON
(what each rank planned and allocated), or the startup error and exits 2. --pool-limit makes this rank's pool
allocation fail above that many bytes, after which its device reports --free-after bytes free (another process
took memory): the rank shrinks alone, and every rank must then agree on its smaller capacity.
"""

from __future__ import annotations

import argparse
import json
import sys

from appliance.config.compose import load_runtime_config
from appliance.core.errors import StartupError
from appliance.core.parallel import place_of
from appliance.serve.convert import startup_response
from npu.launcher import launch
from npu.leaving import leave_process
from npu.qwen3.runner import Qwen3Runner
from npu.ranks import RankGroup, Rendezvous, StartupBoard, connect_store, host_store
from tests.support.fake_device import FakeBackend, FakeMemoryProbe

OVERRIDES = ["+model=qwen3_tiny", "device=cpu", "device.count=2", "parallel.tensor_parallel_size=2",
             "device.cpu_threads=1"]
PEAK_BYTES = 10 << 20            # the probe's allocator peak after profiling (weights + activations + scratch)


class PoolLimitedRunner(Qwen3Runner):
    """The real runner, but its device refuses pools above `limit` bytes (a rank whose allocation fails)."""

    def __init__(self, model, device, place, limit: int):
        super().__init__(model, device, place)
        self.limit = limit

    def allocate_pools(self, num_blocks, num_scratch: int) -> None:
        need = sum((num_blocks[s.name] + num_scratch) * s.page_size_bytes for s in self.cache_specs)
        if need > self.limit:
            raise RuntimeError(f"simulated out of memory: pools need {need:,} B, the device gives {self.limit:,} B")
        super().allocate_pools(num_blocks, num_scratch)


class DeviceThatShrinks(FakeBackend):
    """After a failed allocation (the launcher empties the cache), the device reports `free_after` free."""

    def __init__(self, probe: FakeMemoryProbe, free_after: int):
        super().__init__(probe, kind="cpu", tensor_device="cpu")
        self.free_after = free_after

    def empty_cache(self) -> None:
        self.probe.free = [self.free_after] * self.count


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("total", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--pool-limit", type=int)
    parser.add_argument("--free-after", type=int)
    args = parser.parse_args(argv)
    rank, timeout = args.rank, args.timeout
    rc = load_runtime_config(OVERRIDES + [f"parallel.startup_timeout_s={timeout}"])
    if rank == 0:
        store = host_store(2, timeout)
        print(f"port {store.port}", flush=True)
    else:
        store = connect_store(Rendezvous(rank, 2, rank, "127.0.0.1", args.port), timeout)
    place = place_of(rc.parallel, rank)
    probe = FakeMemoryProbe(1, args.total, PEAK_BYTES)
    if args.pool_limit is None:
        backend, runner = FakeBackend(probe, kind="cpu", tensor_device="cpu"), Qwen3Runner(rc.model, "cpu", place)
    else:
        backend = DeviceThatShrinks(probe, args.free_after)
        runner = PoolLimitedRunner(rc.model, "cpu", place, args.pool_limit)
    try:
        group = RankGroup(place, StartupBoard(store, rank, 2), "cpu", timeout)
        runner, report = launch(rc, backend, runner, group)
    except StartupError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    print(json.dumps({"limiting": report.plan.limiting_device,
                      "response_limiting": startup_response(report).limiting_device,
                      "devices": [[d.name, d.total_bytes, d.budget_bytes] for d in report.plan.devices],
                      "num_blocks": report.plan.num_blocks, "capacity_slots": report.capacity_slots,
                      "retries": report.allocation_retries,
                      "pool_pages": {n: p.shape[1] for n, p in runner.pools.items()}}), flush=True)
    group.close()
    return 0


if __name__ == "__main__":
    leave_process(main(sys.argv[1:]))
