"""Where a DeepSeek V4 decode step's time goes, in thread CPU time per part (steadier than wall time or a
profiler on a shared machine: time other jobs take is not counted, and no per-op tracing inflates small ops).

    python bench/bench_dsv4_parts.py                      # dsv4_tiny, batch 1 / 8 / 32, median of 30 steps
    python bench/bench_dsv4_parts.py --batch-sizes 32 --steps 50
    python bench/bench_dsv4_parts.py --compare-sinkhorn   # the CPU kernel's Sinkhorn and the torch ops, alternating

Each part is a function of the runner timed inclusively (its ops and Python) by wrapping it for this process
only; indented parts are inside the one above them. Steps are called as the engine calls them (execute, one
thread). Prints a markdown table per batch size: the part's median CPU ms per step and its share of the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_step import Pages, fill_pools, load_avg, machine, pages_needed  # noqa: E402

import npu.deepseek_v4.runner as runner_module  # noqa: E402
from appliance.config.compose import load_runtime_config  # noqa: E402
from npu.deepseek_v4 import hyper  # noqa: E402
from npu.registry import build_runner  # noqa: E402
from npu.step import SeqStep, StepBatch  # noqa: E402

PARTS = [   # (owner, function name, label); a label's indent says which part it is inside
    (runner_module, "build_plan", "build_plan (step indices)"),
    (runner_module.Attention, "rotations", "RoPE tables"),
    (runner_module, "hc_pre", "hc_pre (hyper-connection mixing)"),
    (runner_module.Attention, "__call__", "attention"),
    (runner_module.Attention, "_compress", "  compressors"),
    (runner_module.Attention, "_key_rows", "  key rows (+ CSA indexer top-k)"),
    (runner_module.Attention, "_attend", "  scores, softmax, values"),
    (runner_module, "rms_norm", "attn_norm / ffn_norm / final norm"),
    (runner_module, "route", "MoE routing"),
    (runner_module, "routed_experts", "MoE routed experts"),
    (runner_module, "swiglu", "MoE shared expert"),
    (runner_module, "hc_post", "hc_post"),
    (runner_module, "hc_head", "hc_head"),
]


SINKHORN = "  sinkhorn"     # inside hc_pre: the runner's normalization, timed on the runner (not a module function)
LABELS = [row for _, name, label in PARTS for row in ((label, SINKHORN) if name == "hc_pre" else (label,))]


def timed(spent: dict[str, float], fn, label: str):
    def wrapper(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.thread_time() - t0
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dsv4_tiny")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=256, help="tokens already cached when a decode step runs")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--compare-sinkhorn", action="store_true",
                    help="alternate each step between the runner's Sinkhorn normalization and the torch ops")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spent: dict[str, float] = {}
    for owner, name, label in PARTS:
        setattr(owner, name, timed(spent, getattr(owner, name), label))
    rc = load_runtime_config([f"+model={args.model}", f"max_model_len={args.context + 1}"])
    runner = build_runner(rc.model, torch.device("cpu"))
    runner.load_weights()
    chosen = runner.sinkhorn             # the C++ kernel where the CPU kernels build (npu.deepseek_v4.sinkhorn_cpu)
    normalizations = {"the runner's choice": timed(spent, chosen, SINKHORN)}
    if args.compare_sinkhorn:
        normalizations["torch ops"] = timed(spent, hyper.sinkhorn, SINKHORN)
    load_before = load_avg()
    out = []
    for b in args.batch_sizes:
        runner.allocate_pools(pages_needed(runner, b, args.context + 1), 1)
        fill_pools(runner)
        pages = Pages(runner)
        step = StepBatch([SeqStep(f"d{i}", [(5 * i) % 500 + 3], args.context, pages.tables(args.context + 1))
                          for i in range(b)])
        for _ in range(3):
            runner.execute(step)
        samples: dict[str, dict[str, list[float]]] = {name: {} for name in normalizations}
        for _ in range(args.steps):
            for name, normalize in normalizations.items():     # steps alternate between them (--compare-sinkhorn)
                runner.sinkhorn = normalize
                spent.clear()
                t0 = time.thread_time()
                runner.execute(step)
                samples[name].setdefault("step", []).append(time.thread_time() - t0)
                for label, s in spent.items():
                    samples[name].setdefault(label, []).append(s)
        runner.free_pools()
        for name, taken in samples.items():
            mid = {label: statistics.median(s) * 1e3 for label, s in taken.items()}
            which = f"; Sinkhorn by {name}" if args.compare_sinkhorn else ""
            out += ["", f"batch {b}: decode step {mid['step']:.2f} ms CPU (median of {args.steps}){which}", "",
                    "| part | ms CPU | share of the step |", "|---|---:|---:|"]
            out += [f"| {label.replace('  ', '&nbsp;&nbsp;')} | {mid[label]:.2f} | {mid[label] / mid['step']:.0%} |"
                    for label in LABELS if label in mid]
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {machine()}")
    print(f"load average (1/5/15 min): {load_before} at start, {load_avg()} at end; model {args.model}, decode at "
          f"context {args.context}")
    print("\n".join(out))


if __name__ == "__main__":
    main()
