#!/usr/bin/env python3
"""Does the engine warm up over its first requests? The same workload run again and again in one process.

    python bench/bench_first_request.py                       # 6 layers x hidden 768, fp32, 4 rounds each way
    python bench/bench_first_request.py --dtype bfloat16 --requests 32 --rounds 3

Issue 37 saw the offline API speed up run after run in one process (666, 841, 947, 1,000 tok/s) and asked what
warms. This runs R rounds of N requests x P prompt ids -> G tokens (greedy, EOS ignored) on one started engine,
twice over: with FRESH prompts every round (new random ids: nothing can be reused) and with the SAME prompts
every round (what a loop over one prompt list does). For every round it prints output tok/s, the prompt tokens
the prefix cache served and the CPU it ran on. A kernel or allocator warm-up shows as fresh round 1 slower than
fresh rounds 2..R; prefix caching shows as repeat rounds 2..R faster with their prompt tokens served from cache.

The checkpoint (random weights, word-level tokenizer) is made with bench/make_tiny_qwen3.py under --workdir when
absent. One engine per mode, started before its rounds; the load average is printed, since the host may be shared.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from peer_workers import appliance_overrides  # noqa: E402  (bench/ is not a package)

VOCAB = 32000


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_checkpoint(args: argparse.Namespace) -> Path:
    path = Path(args.workdir) / f"qwen3-{args.layers}x{args.hidden}-{args.dtype}"
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "bench" / "make_tiny_qwen3.py"), str(path),
                        "--dtype", args.dtype, "--hidden", str(args.hidden), "--inter", str(args.inter),
                        "--layers", str(args.layers), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
                        "--head-dim", str(args.head_dim), "--with-tokenizer"], check=True)
    return path


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(length)] for _ in range(n)]


def run_mode(mode: str, model: Path, args: argparse.Namespace) -> list[dict]:
    from appliance.core.request import SamplingParams
    from appliance.offline import Appliance

    overrides = appliance_overrides(str(model), args.threads, args.requests, args.prompt_len + args.gen_len + 8)
    params = SamplingParams(max_tokens=args.gen_len, ignore_eos=True)
    rounds = []
    with Appliance.from_config(overrides) as app:
        app.generate(prompts(999, 2, args.prompt_len), SamplingParams(max_tokens=4, ignore_eos=True))
        for r in range(args.rounds):
            batch = prompts(1 if mode == "repeat" else 1 + r, args.requests, args.prompt_len)
            before = app.engine.stats()
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            results = app.generate(batch, params)
            seconds = time.perf_counter() - t0
            after = app.engine.stats()
            out = sum(len(x.token_ids) for x in results)
            rounds.append({"mode": mode, "round": r + 1, "seconds": seconds, "tok_s": out / seconds,
                           "cached": after.prefix_cache_hits - before.prefix_cache_hits,
                           "queried": after.prefix_cache_queries - before.prefix_cache_queries, "load": load})
            print(f"  {mode} round {r + 1}: {out / seconds:8.1f} tok/s  ({seconds:.2f} s, prompt tokens from "
                  f"cache {rounds[-1]['cached']}/{rounds[-1]['queried']}, load {load:.2f})", flush=True)
    return rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/appliance-bench-first-request")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()

    model = make_checkpoint(args)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; {args.layers} layers x hidden {args.hidden}, {args.dtype}; "
          f"{args.requests} x {args.prompt_len} -> {args.gen_len}, {args.threads} threads")
    rows = [row for mode in ("fresh", "repeat") for row in run_mode(mode, model, args)]
    print("\n| prompts | " + " | ".join(f"round {r + 1}" for r in range(args.rounds)) + " |")
    print("|---|" + "---|" * args.rounds)
    for mode in ("fresh", "repeat"):
        cells = [f"{r['tok_s']:.0f} tok/s ({r['cached']} cached)" for r in rows if r["mode"] == mode]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
