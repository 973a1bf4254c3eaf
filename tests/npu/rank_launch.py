"""One rank of a two-rank launch with a scripted memory probe (for tests/npu/test_ranks.py), as its own process:

    python -m tests.npu.rank_launch RANK TOTAL_BYTES [--port PORT] [--timeout SECONDS]

Rank 0 hosts the rendezvous store and prints `port N` first; rank 1 is given that port. Each runs the real
launcher with the real qwen3_tiny tensor-parallel runner on the CPU, but its device's total memory and peak come
from a FakeMemoryProbe, so one rank can have less memory than the other. Prints the startup report as JSON
(what each rank planned and allocated), or the startup error and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from appliance.config.compose import load_runtime_config
from appliance.core.errors import StartupError
from appliance.core.parallel import place_of
from appliance.serve.convert import startup_response
from npu.fake import FakeBackend, FakeMemoryProbe
from npu.launcher import launch
from npu.qwen3 import Qwen3Runner
from npu.ranks import RankGroup, Rendezvous, StartupBoard, connect_store, host_store, leave_process

OVERRIDES = ["+model=qwen3_tiny", "device=cpu", "device.count=2", "parallel.tensor_parallel_size=2",
             "device.cpu_threads=1"]
PEAK_BYTES = 10 << 20            # the probe's allocator peak after profiling (weights + activations + scratch)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("total", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args(argv)
    rank, timeout = args.rank, args.timeout
    rc = load_runtime_config(OVERRIDES + [f"parallel.startup_timeout_s={timeout}"])
    if rank == 0:
        store = host_store(2, timeout)
        print(f"port {store.port}", flush=True)
    else:
        store = connect_store(Rendezvous(rank, 2, rank, "127.0.0.1", args.port), timeout)
    place = place_of(rc.parallel, rank)
    backend = FakeBackend(FakeMemoryProbe(1, args.total, PEAK_BYTES), kind="cpu", tensor_device="cpu")
    try:
        group = RankGroup(place, StartupBoard(store, rank, 2), "cpu", timeout)
        runner, report = launch(rc, backend, Qwen3Runner(rc.model, "cpu", place), group)
    except StartupError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    print(json.dumps({"limiting": report.plan.limiting_device,
                      "response_limiting": startup_response(report).limiting_device,
                      "devices": [[d.name, d.total_bytes, d.budget_bytes] for d in report.plan.devices],
                      "num_blocks": report.plan.num_blocks, "capacity_slots": report.capacity_slots,
                      "pool_pages": {n: p.shape[1] for n, p in runner.pools.items()}}), flush=True)
    group.close()
    return 0


if __name__ == "__main__":
    leave_process(main(sys.argv[1:]))
