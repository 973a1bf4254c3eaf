"""KV pools on 4 KiB and on 2 MiB pages side by side, in one process: what npu.huge_pages buys a decode step.

    python bench/ab_huge_pages.py --model DIR [--batch 64 --context 192 --pool-mib 1536 --steps 40]

Two runners of the same checkpoint, each with a pool of --pool-mib, one allocated with APPLIANCE_CPU_HUGE_PAGES=0
(4 KiB pages, as before npu.huge_pages) and one as the appliance allocates it now (its 2 MiB-aligned interior
advised for huge pages). Each row's pages are drawn at random over the whole pool, as a server's are after a
while (a fresh pool filled row after row would give every row contiguous pages, which hides the TLB's cost). The
rows are prefilled to --context tokens, then the two runners take decode steps in turn (the order alternating),
one token per row per step. Prints the median step of each and how much of the process's memory the kernel put
on huge pages (AnonHugePages, /proc/self/smaps_rollup): 0 kB means the host's THP is off (`never`) or could not
find free 2 MiB pages, and then the two runners are the same.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from profile_decode_floor import filled_rows  # noqa: E402   (bench/, beside this script)

from appliance.config.compose import load_runtime_config  # noqa: E402
from npu.huge_pages import SWITCH  # noqa: E402
from npu.qwen3.runner import Qwen3Runner  # noqa: E402
from npu.step import SeqStep, StepBatch  # noqa: E402


def anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def scattered_runner(model: str, huge: bool, batch: int, context: int, steps: int, pool_mib: int,
                     seed: int) -> tuple[Qwen3Runner, list[list[int]]]:
    """A runner whose pool holds pool_mib, its pool advised for huge pages or not, with `batch` rows of `context`
    tokens prefilled on pages drawn at random over the pool (room for `steps` more tokens each)."""
    rc = load_runtime_config(["+model=hf", f"model.weights={model}", "device=cpu"])
    runner = Qwen3Runner(rc.model, "cpu")
    runner.load_weights()
    pages = max(1, (pool_mib << 20) // runner.cache_specs[0].page_size_bytes)
    os.environ[SWITCH] = "1" if huge else "0"
    try:
        return runner, filled_rows(runner, batch, context, steps, random.Random(seed), pool_pages=pages)
    finally:
        os.environ.pop(SWITCH, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Qwen3 checkpoint directory (config.json + safetensors)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=192, help="tokens in each row's pages before the first step")
    ap.add_argument("--steps", type=int, default=40, help="decode steps per runner")
    ap.add_argument("--pool-mib", type=int, default=1536, help="each runner's pool (the rows' pages spread over it)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    before = anon_huge_kib()
    runners = {label: scattered_runner(args.model, huge, args.batch, args.context, args.steps, args.pool_mib, seed=5)
               for label, huge in (("4 KiB pages", False), ("2 MiB pages", True))}
    times: dict[str, list[float]] = {label: [] for label in runners}
    rng = random.Random(1)
    context = args.context
    with torch.inference_mode():
        for s in range(args.steps):
            for label in (list(runners) if s % 2 else list(reversed(runners))):
                runner, tables = runners[label]
                step = StepBatch([SeqStep(f"s{i}", [rng.randrange(3, 1000)], context, {"kv": tables[i]})
                                  for i in range(args.batch)])
                t = time.perf_counter()
                runner.execute(step)
                times[label].append(time.perf_counter() - t)
            context += 1
    dtype = next(iter(runners.values()))[0].dtype
    print(f"{args.model}: {dtype}, batch {args.batch} x {args.context}-{context} tokens, pages scattered over "
          f"{args.pool_mib} MiB per runner, {args.threads} threads, {args.steps} steps each, in turn; "
          f"AnonHugePages {anon_huge_kib() - before:,} kB more than before the pools")
    for label, t in times.items():
        print(f"{label}: decode step median {statistics.median(t[2:]) * 1e3:.2f} ms (min {min(t) * 1e3:.2f})")


if __name__ == "__main__":
    main()
