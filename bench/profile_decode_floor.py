"""A Qwen3 decode step against its floor: the bytes and arithmetic of each part of the step and how fast each runs.

    python bench/profile_decode_floor.py --model DIR [--batch 64 --context 193 --threads 2 --steps 30]

At batch 64 a CPU decode step of a small model reads every weight once (the projections and the head) and every
row's K and V pages once (the paged decode attention); everything else is small. So its floor is those bytes over
the host's DRAM read rate, or the arithmetic over the CPU's matrix rate where that is longer, and a step near its
floor cannot get much faster, in this engine or another that does the same work (issue 37's held-out 12 x 1024 shape). This script builds the runner on the
checkpoint (the model's own code path, no engine around it), fills `batch` rows of `context` tokens each, then
times `steps` decode steps with a timer around each projection call (by weight shape) and each attention call, and
prints per part: ms per step, MB read and GFLOP per step, and its floor: the longer of its bytes at the DRAM read rate
(a float32 sum over a 1 GiB buffer, beyond any last-level cache) and its arithmetic at the rate of a large matrix
product in the model's dtype (2,048 x 2,048 x 2,048 through torch.mm: oneDNN / MKL, the best this CPU gives torch),
both measured in the same run. A float32 step is bound by arithmetic (64 rows x 2 FLOP per 4-byte weight), a
bfloat16 one on a CPU with AMX by bytes.

The rows' pages are laid out one row after another, so the attention's reads are as the engine's after a prefill
of those rows.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from appliance.config.compose import load_runtime_config  # noqa: E402
from npu import linear  # noqa: E402
from npu.qwen3.runner import Qwen3Runner  # noqa: E402
from npu.step import SeqStep, StepBatch  # noqa: E402


def dram_read_rate(mib: int, repeats: int = 5) -> float:
    """GB/s of a float32 sum over `mib` MiB (the median of `repeats`)."""
    buf = torch.ones(mib * 2**20 // 4)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return buf.numel() * 4 / statistics.median(times) / 1e9


def matmul_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of an n x n x n torch.mm in `dtype` (the median of `repeats`, after one warm-up call)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(times) / 1e9


def filled_rows(runner: Qwen3Runner, batch: int, context: int, decode_steps: int, rng: random.Random,
                pool_pages: int | None = None) -> list[list[int]]:
    """The runner's pool sized for `batch` rows of `context` tokens plus `decode_steps` more, each row's pages one
    after another (as after a prefill), and the rows prefilled with random ids, 8 at a time; their page tables.
    With pool_pages, the pool holds that many pages and each row's are drawn at random over it (page 0 left out),
    as a server's are after a while."""
    per_row = -(-(context + decode_steps + 1) // runner.block_size)
    if pool_pages is None:
        runner.allocate_pools({"kv": batch * per_row}, 1)
        tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(batch)]
    else:
        if batch * per_row > pool_pages - 1:
            sys.exit(f"a pool of {pool_pages} pages cannot hold {batch} rows of {per_row} pages")
        runner.allocate_pools({"kv": pool_pages}, 1)
        ids = rng.sample(range(1, pool_pages), batch * per_row)
        tables = [ids[i * per_row:(i + 1) * per_row] for i in range(batch)]
    vocab = min(1000, runner.model.layout.vocab_size)
    with torch.inference_mode():
        for first in range(0, batch, 8):
            rows = range(first, min(first + 8, batch))
            runner.execute(StepBatch(
                [SeqStep(f"s{i}", [rng.randrange(3, vocab) for _ in range(context)], 0, {"kv": tables[i]},
                         sample=False) for i in rows],
                new_pages={"kv": [p for i in rows for p in tables[i]]}))
    return tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Qwen3 checkpoint directory (config.json + safetensors)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=193, help="tokens already in each row's pages")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--stream-mib", type=int, default=1024, help="the DRAM reference's buffer (beyond the LLC)")
    ap.add_argument("--matmul-n", type=int, default=2048, help="the arithmetic reference's n x n x n product")
    ap.add_argument("--ops", type=int, default=0, help="also the N torch ops with the most self CPU time over the "
                                                       "steps (torch.profiler; the kernels' calls show as their caller)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    rc = load_runtime_config(["+model=hf", f"model.weights={args.model}", "device=cpu"])
    runner = Qwen3Runner(rc.model, "cpu")
    runner.load_weights()
    rng = random.Random(0)
    vocab = min(1000, rc.model.layout.vocab_size)
    tables = filled_rows(runner, args.batch, args.context, args.steps, rng)

    times: dict[str, float] = defaultdict(float)
    flops: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    weight_bytes: dict[str, int] = {}
    project = linear.Projection.__call__

    def timed_projection(self: linear.Projection, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        out = project(self, x)
        out_features, in_features = self.shape
        name = f"projection {out_features} x {in_features}"
        times[name] += time.perf_counter() - t
        calls[name] += 1
        flops[name] += 2 * x.shape[0] * out_features * in_features
        weight_bytes[name] = sum(w.numel() * w.element_size() for w in self.tensors())
        return out

    with torch.inference_mode():
        attend = runner.paged_decode
        if attend is None:
            raise SystemExit("this runner has no paged decode attention on this device and dtype: nothing to time")

        def timed_attention(query, planes, pages, lengths, **k):
            t = time.perf_counter()
            out = attend(query, planes, pages, lengths, **k)
            times["decode attention"] += time.perf_counter() - t
            flops["decode attention"] += 4 * query.shape[1] * query.shape[2] * float(lengths.sum())
            return out

        runner.paged_decode = timed_attention
        linear.Projection.__call__ = timed_projection
        step_times = []
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.ops else None
        if profiler is not None:
            profiler.__enter__()
        for s in range(args.steps):
            context = args.context + s
            step = StepBatch([SeqStep(f"s{i}", [rng.randrange(3, vocab)], context, {"kv": tables[i]})
                              for i in range(args.batch)])
            t = time.perf_counter()
            runner.execute(step)
            step_times.append(time.perf_counter() - t)
        if profiler is not None:
            profiler.__exit__(None, None, None)
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))
        linear.Projection.__call__ = project
    rate, peak = dram_read_rate(args.stream_mib), matmul_rate(runner.dtype, args.matmul_n)

    kv_row_bytes = 2 * runner.num_kv_heads * runner.head_dim * runner.pools["kv"].element_size()
    kv_bytes = rc.model.layout.num_layers * args.batch * (args.context + (args.steps - 1) / 2) * kv_row_bytes
    step_ms = statistics.median(step_times) * 1e3
    print(f"{args.model}: {rc.model.layout.num_layers} layers, {runner.dtype}, batch {args.batch} x {args.context}+ "
          f"tokens, {args.threads} threads; DRAM read {rate:.1f} GB/s (float32 sum over {args.stream_mib} MiB), matrix "
          f"product {peak:.0f} GFLOP/s ({args.matmul_n}^3 torch.mm, {runner.dtype})")
    print(f"decode step median {step_ms:.2f} ms (mean {statistics.mean(step_times) * 1e3:.2f})\n")
    print("| part | ms per step | MB read | GFLOP | GB/s | GFLOP/s | floor ms (bytes / arithmetic) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    floor = 0.0
    for name in sorted(times, key=times.get, reverse=True):
        ms = times[name] / args.steps * 1e3
        read = kv_bytes if name == "decode attention" else weight_bytes[name] * calls[name] / args.steps
        work = flops[name] / args.steps
        by_bytes, by_work = read / rate / 1e6, work / peak / 1e6
        floor += max(by_bytes, by_work)
        print(f"| {name} | {ms:.2f} | {read / 1e6:.4g} | {work / 1e9:.4g} | {read / ms / 1e6:.1f} | {work / ms / 1e6:.0f} "
              f"| {max(by_bytes, by_work):.2f} ({by_bytes:.2f} / {by_work:.2f}) |")
    rest = step_ms - sum(times.values()) / args.steps * 1e3
    print(f"| everything else | {rest:.2f} | | | | | |")
    print(f"\nthe step's floor (the parts' floors added): {floor:.2f} ms = {floor / step_ms:.0%} of its {step_ms:.2f} ms")


if __name__ == "__main__":
    main()
