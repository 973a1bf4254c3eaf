"""The CPU GEMM paths npu/linear.py chooses between, side by side on this CPU: y = x W^T per projection shape and row
count, for float32 (F.linear, MKL's packed GEMM, oneDNN's packed GEMM) and bfloat16 (F.linear, oneDNN packed), and
the project's kernel (npu/kernels/gemm.cpp) where the CPU has AVX-512 (bfloat16: AVX512-BF16).

    python bench/bench_cpu_gemm.py                                   # the 6 x 768 benchmark model's projections
    python bench/bench_cpu_gemm.py --dtype float32 --rows 1,8,64 --threads 1 --shapes 4096x768,32000x768
    python bench/bench_cpu_gemm.py --dtype bfloat16 --layers 12 --shapes 1536x1024,1024x1024,6144x1024,1024x3072

With --layers L the shapes are one layer's projections and L layers of them (distinct weights) run in turn, as a
decode step does, so the weights come from DRAM rather than cache: each path's pass over them is timed in rounds
that alternate the paths (--calls rounds), and the table gives each path's median pass and its GFLOP/s.

Each cell is the fastest of --calls calls (after two unmeasured ones) in microseconds, and the fastest path of the
row is marked with *. The weights are the same for every path of a cell; every call reads them from cache when they
fit, so a cell is the GEMM's own speed, not the model's memory traffic. The line above the table names the CPU
(model, avx512f / avx512_bf16 / amx_bf16), the threads and the load average: the choice in npu/linear.py was made
from this table on an Intel Xeon (Emerald Rapids) and an AMD EPYC.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import cpu_and_load  # noqa: E402 (bench/: the script directory)

from npu.gemm_cpu import PackedWeight, kernel_library  # noqa: E402
from npu.linear import MKL_PACK_ROWS, ONEDNN_PACK_ROWS  # noqa: E402 (npu.linear's packing hints)


def fastest_us(fn, calls: int) -> float:
    fn()
    fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def paths(weight: torch.Tensor) -> dict:
    """name -> a callable x -> x W^T, for every path this torch build offers for the weight's dtype."""
    out = {"F.linear": lambda x: F.linear(x, weight)}
    if weight.dtype == torch.float32 and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_PACK_ROWS)
        out["MKL packed"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl, weight, None, x.shape[0])
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_PACK_ROWS)
        out["oneDNN packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    lib = kernel_library(weight.device, weight.dtype)
    if lib is not None:
        out["kernel"] = PackedWeight.of(weight, lib)
    return out


def model_pass(shapes: list[tuple[int, int]], layers: int, dtype: torch.dtype, rows: list[int], rounds: int) -> None:
    """Every path over `layers` layers of `shapes` (distinct weights: from DRAM, as in a step), alternating."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(*s, generator=g).to(dtype) for _ in range(layers) for s in shapes]
    table = [paths(w) for w in weights]
    names = [n for n in table[0] if n != "F.linear"]
    print(f"{str(dtype).removeprefix('torch.')}, {layers} layers of " + ", ".join(f"{o} x {i}" for o, i in shapes)
          + f" in turn ({sum(w.numel() * w.element_size() for w in weights) / 1e6:.0f} MB); median of {rounds} "
          f"alternating passes, ms (GFLOP/s)")
    print("| rows | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for n in rows:
        xs = [torch.randn(n, w.shape[1], generator=g).to(dtype) for w in weights]
        flop = sum(2 * n * w.shape[0] * w.shape[1] for w in weights)
        passes: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(rounds + 1):
            for name in names:
                start = time.perf_counter()
                for x, p in zip(xs, table):
                    p[name](x)
                passes[name].append(time.perf_counter() - start)
        medians = {name: sorted(t[1:])[len(t[1:]) // 2] for name, t in passes.items()}   # the first is a warm-up
        print(f"| {n} | " + " | ".join(f"{medians[k] * 1e3:.2f} ({flop / medians[k] / 1e9:.0f})" for k in names)
              + " |", flush=True)
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    ap.add_argument("--shapes", default="1024x768,4096x768,768x2048,32000x768",
                    help="comma-separated OUTxIN weights (default: 6 x 768's qkv, gate_up, down and head)")
    ap.add_argument("--rows", default="1,4,8,32,64,128,512")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--calls", type=int, default=30, help="calls per cell (with --layers: alternating passes)")
    ap.add_argument("--layers", type=int, default=0, help="the shapes as one layer, this many layers in turn")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    rows = [int(r) for r in a.rows.split(",")]
    if a.layers:
        print(f"{cpu_and_load()}; torch {torch.__version__}, {a.threads} threads\n")
        for dtype in (getattr(torch, d) for d in a.dtype.split(",")):
            model_pass(shapes, a.layers, dtype, rows, a.calls)
        return
    print(f"{cpu_and_load()}; torch {torch.__version__}, {a.threads} threads; fastest of {a.calls} calls, us\n")
    for dtype in (getattr(torch, d) for d in a.dtype.split(",")):
        g = torch.Generator().manual_seed(0)
        weights = {s: torch.randn(*s, generator=g).to(dtype) for s in shapes}
        table = {s: paths(w) for s, w in weights.items()}
        names = list(next(iter(table.values())))
        print(f"{str(dtype).removeprefix('torch.')}: " + ", ".join(names) + " per shape")
        print("| rows | " + " | ".join(f"{o} x {i}" for o, i in shapes) + " |")
        print("|---:|" + "---|" * len(shapes))
        for n in rows:
            cells = []
            for s in shapes:
                x = torch.randn(n, s[1], generator=g).to(dtype)
                times = {name: fastest_us(lambda f=f, x=x: f(x), a.calls) for name, f in table[s].items()}
                best = min(times, key=times.get)
                cells.append(" / ".join(f"{times[k]:,.0f}{'*' if k == best else ''}" for k in names))
            print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
        print()


if __name__ == "__main__":
    main()
