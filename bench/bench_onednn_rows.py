"""What oneDNN's per-row-count primitives cost a server, and what npu.linear's row buckets save.

    python bench/bench_onednn_rows.py                              # the 4 x 512 model's bf16 layer shapes
    python bench/bench_onednn_rows.py --dtype float32 --shapes 1024x768,768x768,4096x768,768x2048 --steps 400

oneDNN builds a primitive for each (weight shape, row count) the first time it sees it and keeps 1,024 of them
(least recently used out). A server's steps have any row count up to max_num_batched_tokens. This replays --steps
random row counts (1 to --max-rows) through every shape, three passes of the same sequence, in two child processes:
`exact` calls each count as it is (what npu.linear did before its buckets), `bucketed` at npu.linear.onednn_rows.
Per pass: seconds, and the row counts x shapes met so far; per process: the resident memory the primitives added
(the inputs and weights are allocated before). The first pass pays the builds; later passes pay them again only
where the shapes x counts exceed the cache. Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import cpu_and_load  # noqa: E402 (bench/: the script directory)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def child(args: argparse.Namespace) -> None:
    import torch

    from npu.linear import Projection, onednn_rows
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    projections = [Projection.of(torch.randn(n, k).to(dtype)) for n, k in shapes]   # packed as the runners pack
    if any(p.onednn_packed is None for p in projections):
        sys.exit(f"npu.linear does not take oneDNN's packed path for {args.dtype} on this CPU: nothing to measure")
    inputs = {k: torch.randn(args.max_rows, k).to(dtype) for _, k in shapes}
    rng = random.Random(0)
    counts = [rng.randrange(1, args.max_rows + 1) for _ in range(args.steps)]
    bucketed = args.child == "bucketed"
    before, met, passes = rss_mib(), set(), []
    for _ in range(3):
        start = time.perf_counter()
        for rows in counts:
            for shape, proj in zip(shapes, projections):
                x = inputs[shape[1]][:rows]
                if bucketed:
                    proj(x)
                else:
                    torch.ops.mkldnn._linear_pointwise(x, proj.onednn_packed, None, "none", [], "")
                met.add((shape, onednn_rows(rows) if bucketed else rows))
        passes.append((time.perf_counter() - start, len(met)))
    print(json.dumps({"passes": passes, "rss_added_mib": rss_mib() - before}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--shapes", default="1024x512,512x512,3072x512,512x1536",
                    help="comma-separated OUTxIN weight shapes (default: the 4 x 512 model's qkv, o, gate_up, down)")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--max-rows", type=int, default=600)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--child", choices=["exact", "bucketed"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    print(cpu_and_load() + f"; {args.dtype}, shapes {args.shapes}, {args.steps} random row counts in 1-{args.max_rows}, "
          f"{args.threads} threads")
    print("| calls | pass 1 s | pass 2 s | pass 3 s | shapes x row counts met | RSS added |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in ("exact", "bucketed"):
        out = subprocess.run([sys.executable, __file__, "--child", mode] + sys.argv[1:], check=True,
                             capture_output=True, text=True).stdout
        got = json.loads(out.strip().splitlines()[-1])
        seconds = " | ".join(f"{s:.2f}" for s, _ in got["passes"])
        print(f"| {mode} | {seconds} | {got['passes'][-1][1]} | {got['rss_added_mib']:.0f} MiB |")


if __name__ == "__main__":
    main()
