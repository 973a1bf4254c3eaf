"""Prefill and decode step times of the tiny models' runners, straight through ModelRunner.execute.

    python bench/bench_step.py                       # qwen3_tiny and dsv4_tiny
    python bench/bench_step.py --batch-sizes 1 8 32 --prompt-len 64 --context 256 --iters 20
    python bench/bench_step.py --models dsv4_tiny --profile-ops 12 --stat min     # + where a step's time goes

Prefill: B sequences, each a prompt chunk of --prompt-len tokens from position 0 (deepseek_v4 caps a
chunk at layout.tokens_in_flight). Decode: B sequences, one token each at position --context.
Mixed decode: B decode rows whose contexts alternate between --context and 3/4 of it (one padded batch
with a mask). Cached chunk: B chunks of --prompt-len tokens after --context cached tokens (a later chunk
or a prefix-cache hit: attention over pages with an offset-causal mask). The last two are the steps whose
attention takes a mask. Decodes + chunk: B decode rows at --context next to one prompt chunk of --prompt-len
tokens from position 0, the step continuous batching issues while a new request is admitted (a runner that
pads every row to the longest chunk pays B x the chunk here). Each sequence has its own pages. Prints a markdown table, the command and the
machine. --stat min reports the fastest step instead of the median (steadier on a shared machine).
--profile-ops N then runs one decode and one prefill step at the largest batch under torch.profiler and
prints the N ops with the most self CPU time, and how much of the step no torch op accounts for (Python).
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from appliance.config.compose import load_runtime_config  # noqa: E402
from npu.registry import build_runner  # noqa: E402
from npu.step import SeqStep, StepBatch  # noqa: E402


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    except OSError:
        model = platform.processor() or "?"
    import os
    return (f"{model}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"Python {platform.python_version()}")


class Pages:
    """Hands each sequence its own pages in every group."""

    def __init__(self, runner):
        self.runner = runner
        self.next = {s.name: 0 for s in runner.model.cache_groups}

    def tables(self, end_tokens: int) -> dict[str, list[int]]:
        out = {}
        for spec in self.runner.model.cache_groups:
            n = spec.max_blocks_per_seq if spec.is_ring else math.ceil(end_tokens / spec.tokens_per_page)
            start = self.next[spec.name]
            out[spec.name] = list(range(start, start + n))
            self.next[spec.name] = start + n
        return out


def pages_needed(runner, batch: int, end_tokens: int) -> dict[str, int]:
    return {s.name: batch * (s.max_blocks_per_seq if s.is_ring else math.ceil(end_tokens / s.tokens_per_page))
            for s in runner.model.cache_groups}


STATS = {"median": statistics.median, "min": min}


def time_step(runner, batch: StepBatch, iters: int, stat: str, warmup: int = 2) -> float:
    with torch.inference_mode():
        for _ in range(warmup):
            runner.execute(batch)
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            runner.execute(batch)
            samples.append(time.perf_counter() - t0)
    return STATS[stat](samples)


def profile_ops(runner, batch: StepBatch, top: int) -> str:
    """One step under torch.profiler: the `top` ops by self CPU time, as markdown."""
    from torch.profiler import ProfilerActivity, profile
    with torch.inference_mode():
        runner.execute(batch)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            runner.execute(batch)
            wall = time.perf_counter() - t0
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    in_ops = sum(e.self_cpu_time_total for e in events) / 1e6
    lines = [f"step {wall * 1e3:.2f} ms under the profiler: torch ops {in_ops * 1e3:.2f} ms (self), "
             f"the other {max(0.0, wall - in_ops) * 1e3:.2f} ms in Python between them", "",
             "| op | calls | self ms | share of the step |", "|---|---:|---:|---:|"]
    for e in events[:top]:
        ms = e.self_cpu_time_total / 1e3
        lines.append(f"| {e.key} | {e.count} | {ms:.2f} | {ms / (wall * 1e3):.0%} |")
    return "\n".join(lines)


def bench_model(name: str, batch_sizes: list[int], prompt_len: int, context: int, iters: int, stat: str,
                profile_top: int) -> list[dict]:
    rc = load_runtime_config([f"+model={name}", f"max_model_len={context + prompt_len}"])
    runner = build_runner(rc.model, torch.device("cpu"))
    runner.load_weights()
    chunk = prompt_len
    if rc.model.arch == "deepseek_v4" and rc.model.layout.tokens_in_flight:
        chunk = min(chunk, rc.model.layout.tokens_in_flight)
    rows = []
    for b in batch_sizes:
        end = max(context + 1, chunk)
        runner.allocate_pools(pages_needed(runner, 4 * b + 1, context + chunk), 1)
        pages = Pages(runner)
        prefill = StepBatch([SeqStep(f"p{i}", [(7 * i + j) % 500 + 3 for j in range(chunk)], 0, pages.tables(chunk))
                             for i in range(b)])
        decode = StepBatch([SeqStep(f"d{i}", [(5 * i) % 500 + 3], context, pages.tables(end))
                            for i in range(b)])
        mixed_ctx = [context if i % 2 == 0 else context * 3 // 4 for i in range(b)]
        mixed = StepBatch([SeqStep(f"m{i}", [(3 * i) % 500 + 3], c, pages.tables(c + 1))
                           for i, c in enumerate(mixed_ctx)])
        cached = StepBatch([SeqStep(f"c{i}", [(11 * i + j) % 500 + 3 for j in range(chunk)], context,
                                    pages.tables(context + chunk)) for i in range(b)])
        admit = StepBatch(decode.seqs + [SeqStep("new", [(13 * j) % 500 + 3 for j in range(chunk)], 0,
                                                 pages.tables(chunk))])
        t_pre, t_dec = time_step(runner, prefill, iters, stat), time_step(runner, decode, iters, stat)
        t_admit = time_step(runner, admit, iters, stat)
        t_mix, t_cached = time_step(runner, mixed, iters, stat), time_step(runner, cached, iters, stat)
        rows.append(dict(model=name, batch=b, chunk=chunk, context=context, prefill_ms=t_pre * 1e3,
                         prefill_tps=b * chunk / t_pre, decode_ms=t_dec * 1e3, decode_tps=b / t_dec,
                         mixed_ms=t_mix * 1e3, cached_ms=t_cached * 1e3, admit_ms=t_admit * 1e3))
        if profile_top and b == batch_sizes[-1]:
            for what, step in (("decode", decode), ("prefill", prefill)):
                rows[-1][f"{what}_ops"] = profile_ops(runner, step, profile_top)
        runner.free_pools()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=None, help="conf/model names (default: the tiny models)")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--context", type=int, default=256, help="tokens already cached when a decode step runs")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--stat", choices=sorted(STATS), default="median", help="step time reported over --iters steps")
    ap.add_argument("--profile-ops", type=int, default=0, metavar="N",
                    help="profile one decode and one prefill step at the largest batch: the N costliest ops")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = args.models or ["qwen3_tiny", "dsv4_tiny"]
    rows = [r for m in models for r in bench_model(m, args.batch_sizes, args.prompt_len, args.context, args.iters,
                                                   args.stat, args.profile_ops)]
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {machine()}")
    print(f"{args.stat} of {args.iters} steps after 2 warm-up steps\n")
    print("| model | batch | prefill tokens/seq | prefill step ms | prefill tok/s | decode context | decode step ms "
          "| decode tok/s | mixed-context decode ms | cached chunk ms | decodes + chunk ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['batch']} | {r['chunk']} | {r['prefill_ms']:.2f} | {r['prefill_tps']:,.0f} | "
              f"{r['context']} | {r['decode_ms']:.2f} | {r['decode_tps']:,.0f} | {r['mixed_ms']:.2f} | "
              f"{r['cached_ms']:.2f} | {r['admit_ms']:.2f} |")
    for r in rows:
        for what in ("decode", "prefill"):
            if f"{what}_ops" in r:
                print(f"\n{r['model']}, {what} step at batch {r['batch']}:\n{r[what + '_ops']}")


if __name__ == "__main__":
    main()
