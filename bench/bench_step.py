"""Prefill and decode step times of the tiny models' runners, straight through ModelRunner.execute.

    python bench/bench_step.py                       # qwen3_tiny and dsv4_tiny
    python bench/bench_step.py --batch-sizes 1 8 32 --prompt-len 64 --context 256 --iters 20
    python bench/bench_step.py --models dsv4_tiny --profile-ops 12 --stat min     # + where a step's time goes
    python bench/bench_step.py --decode-only --threads 1 --repeats 5      # decode at batch 1 / 8 / 32, both runners

--decode-only times only the decode step, the models interleaved (qwen3_tiny, dsv4_tiny, qwen3_tiny, ...) for
--repeats rounds so that load from other jobs falls on both; each cell is the median over rounds of a round's
step time (--stat of its steps), with the rounds' min-max.

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
import os
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


def fill_pools(runner) -> None:
    """Write random values into every page of every pool. A pool no step has written is untouched memory,
    which the kernel maps to its one shared zero page: gathers and attention over it read from cache and
    are timed far too fast (a qwen3 decode step at 64 rows and 192 tokens of context: 12 ms over an
    untouched pool, 19 ms over a written one, what the engine's steps take)."""
    g = torch.Generator().manual_seed(0)
    for pool in runner.pools.values():
        for chunk in pool.view(-1).split(1 << 22):
            chunk.copy_(torch.randn(chunk.numel(), generator=g))


STATS = {"median": statistics.median, "min": min}


def load_avg() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def time_step(runner, batch: StepBatch, iters: int, stat: str, warmup: int = 2) -> float:
    """execute as the engine calls it: no grad mode set around it (each runner picks its own)."""
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


def profile_parts(runner, batch: StepBatch, top: int) -> str:
    """One step under torch.profiler with Python stacks: the `top` functions of npu/ by inclusive time (their
    torch ops and Python together), as markdown. Stack tracing slows Python more than ops: compare shares of
    one profile, not milliseconds across profiles."""
    from torch.profiler import ProfilerActivity, profile
    with torch.inference_mode():
        runner.execute(batch)
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
            runner.execute(batch)
    parts: dict[str, list[float]] = {}
    for e in prof.events():
        if e.name.startswith("npu/"):
            entry = parts.setdefault(e.name.split(" ", 1)[-1] if ": " in e.name else e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.cpu_time_total / 1e3
    step = max(ms for _, ms in parts.values())
    lines = ["| function (inclusive: its ops and Python) | calls | ms | share of the step |", "|---|---:|---:|---:|"]
    for name, (calls, ms) in sorted(parts.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| {name} | {calls} | {ms:.2f} | {ms / step:.0%} |")
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
        fill_pools(runner)
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


def decode_side_by_side(models: list[str], batch_sizes: list[int], context: int, iters: int, repeats: int,
                        stat: str, profile_top: int, parts_top: int) -> list[str]:
    """Decode step times of the models at each batch size, the models interleaved for `repeats` rounds: per
    model and batch, the median over rounds of a round's step time (`stat` of its steps), with the rounds'
    min-max."""
    runners = {}
    for name in models:
        rc = load_runtime_config([f"+model={name}", f"max_model_len={context + 1}"])
        runners[name] = build_runner(rc.model, torch.device("cpu"))
        runners[name].load_weights()
    head = " | ".join(f"{m} decode step ms (min-max)" for m in models)
    ratio = f" {models[-1]} / {models[0]} |" if len(models) > 1 else ""
    lines = [f"| batch | {head} |{ratio}", "|---:|" + "---:|" * (len(models) + (len(models) > 1))]
    profiles = []
    for b in batch_sizes:
        steps = {}
        for name, runner in runners.items():
            runner.allocate_pools(pages_needed(runner, b, context + 1), 1)
            fill_pools(runner)
            pages = Pages(runner)
            steps[name] = StepBatch([SeqStep(f"d{i}", [(5 * i) % 500 + 3], context, pages.tables(context + 1))
                                     for i in range(b)])
        rounds = {name: [] for name in models}
        for _ in range(repeats):
            for name in models:
                rounds[name].append(time_step(runners[name], steps[name], iters, stat) * 1e3)
        mid = {name: statistics.median(ms) for name, ms in rounds.items()}
        cells = " | ".join(f"{mid[m]:.2f} ({min(rounds[m]):.2f}-{max(rounds[m]):.2f})" for m in models)
        lines.append(f"| {b} | {cells} |" + (f" {mid[models[-1]] / mid[models[0]]:.1f}x |" if ratio else ""))
        for name in models:
            if profile_top:
                profiles.append(f"\n{name}, decode step at batch {b}, ops:\n"
                                + profile_ops(runners[name], steps[name], profile_top))
            if parts_top:
                profiles.append(f"\n{name}, decode step at batch {b}, functions:\n"
                                + profile_parts(runners[name], steps[name], parts_top))
            runners[name].free_pools()
    return lines + profiles


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
    ap.add_argument("--profile-parts", type=int, default=0, metavar="N",
                    help="--decode-only: profile each decode step with Python stacks: the N costliest functions")
    ap.add_argument("--decode-only", action="store_true",
                    help="only decode steps, the models side by side, interleaved for --repeats rounds")
    ap.add_argument("--repeats", type=int, default=3, help="--decode-only: rounds per batch size")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = args.models or ["qwen3_tiny", "dsv4_tiny"]
    if args.decode_only:
        load_before = load_avg()
        lines = decode_side_by_side(models, args.batch_sizes, args.context, args.iters, args.repeats, args.stat,
                                    args.profile_ops, args.profile_parts)
        print(f"command: python {' '.join(sys.argv)}")
        print(f"machine: {machine()}")
        print(f"load average (1/5/15 min): {load_before} at start, {load_avg()} at end")
        print(f"decode at context {args.context}: median of {args.repeats} rounds (min-max) of a round's "
              f"{args.stat} of {args.iters} steps after 2 warm-up steps\n")
        print("\n".join(lines))
        return
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
