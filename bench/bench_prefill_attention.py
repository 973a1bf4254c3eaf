"""The CPU prefill-attention kernel against torch's SDPA, as the Qwen3 runner calls each (one layer of one step).

    python bench/bench_prefill_attention.py [--threads 2 --repeats 30]

For each case (sequences x length, heads / kv heads x head_dim, like the runner's 2,048-token prefill steps of
bench_peers' shapes) and dtype: the kernel's path for this CPU (npu.prefill_attention_cpu.fast_path; the portable
loops too with --portable), and SDPA causal with GQA over the same strided q/k/v views, as the runner's SDPA path
calls it (sequences of one length grouped). Median ms of --repeats calls after 3 warm-ups, and GFLOP/s counted as
4 x heads x head_dim x length^2 / 2 per sequence (the causal half of QK^T and PV). Max abs difference of the two
outputs is printed as a check. The machine may be shared: compare figures taken back to back.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npu.cpu_kernels import load  # noqa: E402
from npu.prefill_attention_cpu import PORTABLE, CausalPrefillAttention, available_paths, fast_path  # noqa: E402

CASES = ((4, 512, 8, 2, 64), (16, 128, 8, 2, 64), (4, 512, 12, 2, 64), (16, 128, 12, 2, 64), (4, 512, 32, 8, 128))


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--portable", action="store_true", help="time the kernel's portable loops too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = load()
    have = available_paths(lib)
    names = {0: "portable", 1: "AVX-512", 2: "AMX"}
    print(f"threads {args.threads}; kernel paths on this CPU: {', '.join(names[p] for p in sorted(have))}")
    print(f"{'dtype':9} {'seqs x len':>10} {'heads':>9} {'path':>9} {'kernel ms':>9} {'GFLOP/s':>8} "
          f"{'SDPA ms':>8} {'GFLOP/s':>8} {'speed-up':>8} {'max diff':>9}")
    for dtype in (torch.bfloat16, torch.float32):
        for seqs, length, heads, kv_heads, head_dim in CASES:
            qkv = torch.randn(seqs * length, (heads + 2 * kv_heads) * head_dim).to(dtype)
            q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
            views = (qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:])
            rows = qkv.view(seqs, length, heads + 2 * kv_heads, head_dim)
            qp = rows[:, :, :heads].transpose(1, 2)
            kp, vp = rows[:, :, heads:].view(seqs, length, 2, kv_heads, head_dim).permute(2, 0, 3, 1, 4)

            def sdpa():
                return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)

            flop = seqs * 4 * heads * head_dim * length * length / 2
            sdpa_ms = timed(sdpa, args.repeats)
            best, _ = fast_path(dtype, head_dim, have)
            for path in sorted({best} - {None} | ({PORTABLE} if args.portable else set())):
                op = CausalPrefillAttention(lib, dtype, heads, kv_heads, head_dim, path)
                lengths = [length] * seqs
                ms = timed(lambda: op(*views, lengths), args.repeats)
                diff = (op(*views, lengths).float() - sdpa().transpose(1, 2).reshape(-1, heads, head_dim).float())
                print(f"{str(dtype)[6:]:9} {seqs:>4} x {length:<4} {heads:>3} / {kv_heads} x {head_dim:<3} "
                      f"{names[path]:>9} {ms:9.2f} {flop / ms / 1e6:8.0f} {sdpa_ms:8.2f} {flop / sdpa_ms / 1e6:8.0f} "
                      f"{sdpa_ms / ms:7.2f}x {diff.abs().max().item():9.2e}")
            if best is None and not args.portable:
                print(f"{str(dtype)[6:]:9} {seqs:>4} x {length:<4} {heads:>3} / {kv_heads} x {head_dim:<3} "
                      f"{'(SDPA)':>9} {'':9} {'':8} {sdpa_ms:8.2f} {flop / sdpa_ms / 1e6:8.0f}")


if __name__ == "__main__":
    main()
