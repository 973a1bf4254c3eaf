"""Paged decode-attention kernel builds side by side inside a model's decode steps, in one process.

    git show 8b22cba:npu/kernels/paged_attention.cpp > /tmp/before.cpp
    python bench/ab_decode_attention.py --model DIR before=/tmp/before.cpp after=npu/kernels/paged_attention.cpp

Why one process: on a shared 2-core host a decode step's time moves by 10-30% between processes and minutes, more
than a kernel change; here every build runs in turn, step after step, over the same runner, pools and host state, so
what differs is the kernel. Each LABEL=SOURCE is a variant of npu/kernels/paged_attention.cpp, compiled with the
project's flags (npu.cpu_kernels) into a temporary library; the runner's decode attention calls each build's entry
point in turn (the AMX path is not switched: this compares the vector kernels). The rows' pages are laid out one row
after another, as after a prefill; the context grows by one token per step.

Prints, per build, the median decode step, the attention's ms per step and per layer call, and, with --repeat, one
captured layer call repeated with its rows in cache (what the call costs when nothing is fetched from DRAM).
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from profile_decode_floor import filled_rows  # noqa: E402   (bench/, beside this script)

from appliance.config.compose import load_runtime_config  # noqa: E402
from npu.cpu_kernels import COMPILE_FLAGS, KERNELS, find_compiler  # noqa: E402
from npu.qwen3.runner import Qwen3Runner  # noqa: E402
from npu.step import SeqStep, StepBatch  # noqa: E402


def build(label: str, source: Path, workdir: Path) -> ctypes.CDLL:
    """One variant as a shared library (compiled and linked at once, with the project's flags and headers)."""
    out = workdir / f"{label}.so"
    flags = [f for f in COMPILE_FLAGS if f != "-c"]
    subprocess.run([find_compiler(), *flags, "-shared", f"-I{KERNELS}", str(source), "-o", str(out)], check=True)
    return ctypes.CDLL(str(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Qwen3 checkpoint directory (config.json + safetensors)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=193, help="tokens in each row's pages before the first step")
    ap.add_argument("--steps", type=int, default=30, help="decode steps per build")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", action="store_true", help="also one captured layer call repeated, rows in cache")
    ap.add_argument("builds", nargs="+", metavar="LABEL=SOURCE")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pairs = [b.partition("=") for b in args.builds]
    if any(not label or not source for label, _, source in pairs):
        sys.exit("each build is LABEL=SOURCE (a variant of npu/kernels/paged_attention.cpp)")

    rc = load_runtime_config(["+model=hf", f"model.weights={args.model}", "device=cpu"])
    runner = Qwen3Runner(rc.model, "cpu")
    runner.load_weights()
    attend = runner.paged_decode
    if attend is None:
        sys.exit("this runner has no CPU paged decode attention (kernels off, or not a CPU float32 / bfloat16 model)")
    suffix = "bf16" if runner.dtype == torch.bfloat16 else "f32"
    with tempfile.TemporaryDirectory() as tmp:
        fns = {}
        for label, _, source in pairs:
            fn = getattr(build(label, Path(source), Path(tmp)), f"paged_decode_attention_{suffix}")
            fn.restype = None
            fns[label] = fn
        if attend.tiles:
            attend.tiles = False          # the vector kernels are what the builds differ in
        rng = random.Random(0)
        vocab = min(1000, rc.model.layout.vocab_size)
        tables = filled_rows(runner, args.batch, args.context, args.steps * len(fns), rng)
        calls: dict[str, list[float]] = {label: [] for label in fns}
        steps: dict[str, list[float]] = {label: [] for label in fns}
        current = [""]
        captured: list[tuple] = []

        def timed(query, planes, pages, lengths, **kw):
            t = time.perf_counter()
            out = attend(query, planes, pages, lengths, **kw)
            calls[current[0]].append(time.perf_counter() - t)
            if not captured:
                captured.append((query.clone(), planes, pages.clone(), lengths.clone(), kw))
            return out

        with torch.inference_mode():
            runner.paged_decode = timed
            context = args.context
            for s in range(args.steps):
                order = list(fns)
                random.Random(s).shuffle(order)
                for label in order:
                    attend.fn, current[0] = fns[label], label
                    step = StepBatch([SeqStep(f"s{i}", [rng.randrange(3, vocab)], context, {"kv": tables[i]})
                                      for i in range(args.batch)])
                    t = time.perf_counter()
                    runner.execute(step)
                    steps[label].append(time.perf_counter() - t)
                    context += 1
            print(f"{args.model}: {runner.dtype}, batch {args.batch} x {args.context}-{context} tokens, "
                  f"{args.threads} threads, {args.steps} steps per build, builds in turn")
            for label in fns:
                per_step = sum(calls[label]) / len(steps[label]) * 1e3
                print(f"{label}: step median {statistics.median(steps[label]) * 1e3:.2f} ms; attention {per_step:.2f} "
                      f"ms per step, {statistics.median(calls[label]) * 1e3:.3f} ms per layer call (median of "
                      f"{len(calls[label])} calls in {len(steps[label])} steps)")
            if args.repeat and captured:
                query, planes, pages, lengths, kw = captured[0]
                for label, fn in fns.items():
                    attend.fn = fn
                    times = []
                    for _ in range(20):
                        t = time.perf_counter()
                        attend(query, planes, pages, lengths, **kw)
                        times.append(time.perf_counter() - t)
                    print(f"{label}: one layer call repeated, rows in cache: {statistics.median(times) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
