"""The KV pool's two CPU layouts side by side inside a model's decode steps, in one process.

    python bench/ab_kv_layout.py --model /work/peers/qwen3-12x1024-bf16 [--batch 64 --context 192 --steps 30]

Why one process: a decode step on a shared 2-core host moves by 10-30% between processes and minutes, more than the
layout changes it. Here two runners over the same checkpoint, one per layout (APPLIANCE_CPU_KV_LAYOUT=rows and
=pairs when each is built: npu.kv_pairs), hold the same rows (filled as after a prefill: bench/profile_decode_floor
filled_rows) and take decode steps in turn, in a shuffled order per step. Prints per layout the median decode
step, the decode attention's ms per step and per layer call, and whether their logits agreed (the two layouts'
kernels are meant to give the same bits).
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
from npu.kv_pairs import LAYOUT_SWITCH  # noqa: E402
from npu.qwen3.runner import Qwen3Runner  # noqa: E402
from npu.step import SeqStep, StepBatch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a bfloat16 Qwen3 checkpoint directory (config.json + safetensors)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=192, help="tokens in each row's pages before the first step")
    ap.add_argument("--steps", type=int, default=30, help="decode steps per layout")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rc = load_runtime_config(["+model=hf", f"model.weights={args.model}", "device=cpu"])
    runners: dict[str, Qwen3Runner] = {}
    for layout in ("rows", "pairs"):
        os.environ[LAYOUT_SWITCH] = layout
        runner = Qwen3Runner(rc.model, "cpu")
        if (runner.kv_pairs is not None) != (layout == "pairs") or runner.paged_decode is None:
            sys.exit(f"no {layout} layout here (npu.kv_pairs logs why): a bfloat16 model on a CPU with AVX512-BF16")
        runner.load_weights()
        runners[layout] = runner
    tables = {layout: filled_rows(r, args.batch, args.context, args.steps, random.Random(0))
              for layout, r in runners.items()}
    calls: dict[str, list[float]] = {layout: [] for layout in runners}
    steps: dict[str, list[float]] = {layout: [] for layout in runners}
    for layout, runner in runners.items():
        attend = runner.paged_decode

        def timed(*a, attend=attend, spent=calls[layout], **kw):
            t = time.perf_counter()
            out = attend(*a, **kw)
            spent.append(time.perf_counter() - t)
            return out
        runner.paged_decode = timed
    rng = random.Random(1)
    vocab = min(1000, rc.model.layout.vocab_size)
    same = True
    with torch.inference_mode():
        for s in range(args.steps):
            tokens = [rng.randrange(3, vocab) for _ in range(args.batch)]
            order = list(runners)
            random.Random(s).shuffle(order)
            logits = {}
            for layout in order:
                step = StepBatch([SeqStep(f"s{i}", [tokens[i]], args.context + s, {"kv": tables[layout][i]})
                                  for i in range(args.batch)])
                t = time.perf_counter()
                logits[layout] = runners[layout].execute(step)
                steps[layout].append(time.perf_counter() - t)
            same = same and torch.equal(logits["rows"], logits["pairs"])
    print(f"{args.model}: {rc.model.layout.dtype}, batch {args.batch} x {args.context}-{args.context + args.steps} "
          f"tokens, {args.threads} threads, {args.steps} steps per layout, in turn")
    for layout in runners:
        per_step = sum(calls[layout]) / len(steps[layout]) * 1e3
        print(f"{layout}: step median {statistics.median(steps[layout]) * 1e3:.2f} ms; decode attention "
              f"{per_step:.2f} ms per step, {statistics.median(calls[layout]) * 1e3:.3f} ms per layer call")
    print(f"logits of the two layouts {'identical' if same else 'DIFFERENT'} in every step")


if __name__ == "__main__":
    main()
