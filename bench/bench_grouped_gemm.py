"""DeepSeek V4's routed experts of one MoE layer at real widths on a GPU: the Triton grouped GEMM reading FP4 (and FP8)
stacks as stored (npu/grouped_gemm_triton.py) against what ran before it, the stack dequantized for the step and
torch._grouped_mm over the copy, in the same process on the same weights.

    python bench/bench_grouped_gemm.py [--experts 256] [--hidden 4096] [--inter 2048] [--top-k 6]
        [--tokens 16 64 128 4096] [--formats fp4 fp8] [--json out.json]

Per token count: routing is uniform random (each token's top-k distinct experts); the work is moe.grouped_experts
(w1, w3, w2 of every picked expert and the SwiGLU between), timed with CUDA events over repeated calls after a
warm-up, median of the repeats. The floor column is the bytes of the experts some token picked, as stored, at the
device's memory rate measured in the run (a 1 GiB copy). Both paths' outputs are compared (max relative difference).
On a machine without a GPU it exits 2 saying so: the kernel's correctness is tested on the CPU in Triton's
interpreter (tests/npu/test_grouped_gemm_triton.py), its speed needs the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npu.deepseek_v4.moe import grouped_experts, torch_grouped_gemm  # noqa: E402
from npu.grouped_gemm_triton import grouped_gemm_applies, triton_grouped_gemm  # noqa: E402
from npu.quant import QuantizedWeight  # noqa: E402


def random_stack(name: str, experts: int, out: int, inp: int, fmt: str, block: int) -> QuantizedWeight:
    """Random codes and scales made on the GPU in the stored layout (no quantizing pass: the speed does not care
    which values they are, only that they are finite)."""
    if fmt == "fp4":
        values = torch.randint(0, 256, (experts, out, inp // 2), dtype=torch.uint8, device="cuda")
        scale = torch.randint(118, 122, (experts, out, inp // 32), dtype=torch.uint8, device="cuda")
        return QuantizedWeight(name, values.view(torch.float4_e2m1fn_x2), scale.view(torch.float8_e8m0fnu), 32)
    values = (torch.randn(experts, out, inp, device="cuda") * 32).to(torch.float8_e4m3fn)
    scale = torch.randint(118, 122, (experts, -(-out // block), -(-inp // block)), dtype=torch.uint8, device="cuda")
    return QuantizedWeight(name, values, scale.view(torch.float8_e8m0fnu), block)


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls, each between CUDA events, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def memory_rate() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), 10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128, 4096])
    parser.add_argument("--formats", nargs="+", default=["fp4", "fp8"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available() or not grouped_gemm_applies(torch.device("cuda"), torch.bfloat16):
        print("bench_grouped_gemm: needs a CUDA GPU with Triton (the kernel's correctness runs on the CPU in "
              "tests/npu/test_grouped_gemm_triton.py)", file=sys.stderr)
        return 2
    rate = memory_rate()
    rows_out = []
    print(f"{torch.cuda.get_device_name()}: memory rate {rate / 1e9:.0f} GB/s; {args.experts} experts of "
          f"{args.inter} x {args.hidden}, top-{args.top_k}, bf16 activations")
    print("| format | tokens | experts picked | Triton, as stored (ms) | dequantize + _grouped_mm (ms) | speed-up | "
          "floor (ms) | max rel. difference |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for fmt in args.formats:
        stacks = [random_stack(f"w{i}", args.experts, *shape, fmt, 128)
                  for i, shape in ((1, (args.inter, args.hidden)), (3, (args.inter, args.hidden)),
                                   (2, (args.hidden, args.inter)))]
        bytes_per_expert = sum((s.values.numel() + s.scale.numel()) // args.experts for s in stacks)
        for tokens in args.tokens:
            h = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
            experts = torch.rand(tokens, args.experts, device="cuda").argsort(dim=-1)[:, :args.top_k]
            weights = torch.rand(tokens, args.top_k, device="cuda")

            def as_stored():
                return grouped_experts(h, weights, experts, *stacks, 10.0, triton_grouped_gemm)

            def dequantized():
                dense = [s.dequantize(torch.bfloat16) for s in stacks]
                return grouped_experts(h, weights, experts, *dense, 10.0, torch_grouped_gemm)

            a, b = as_stored().float(), dequantized().float()
            difference = ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()
            t_stored, t_dequant = timed(as_stored, args.repeats), timed(dequantized, max(3, args.repeats // 3))
            picked = int(experts.unique().numel())
            floor = picked * bytes_per_expert / rate
            rows_out.append({"format": fmt, "tokens": tokens, "picked": picked, "triton_s": t_stored,
                             "dequantized_s": t_dequant, "floor_s": floor, "max_rel_difference": difference})
            print(f"| {fmt} | {tokens} | {picked} | {t_stored * 1e3:.3f} | {t_dequant * 1e3:.1f} | "
                  f"{t_dequant / t_stored:.1f}x | {floor * 1e3:.3f} | {difference:.1e} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "memory_rate": rate,
                                               "rows": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
