"""The fastest any engine could run a benchmark workload on this host: its arithmetic and bytes against the CPU's rates.

    python bench/workload_ceiling.py --model DIR [--measured appliance=507,vllm=425 --served-measured ...]

A target such as "1.2x vLLM" is reachable only where vLLM is below 1 / 1.2 of what the host allows. This script
says what the host allows for the workloads of bench_peers (offline: N requests x P prompt ids -> G tokens, greedy)
and bench_serve_peers (served: C streams of P -> G, a new request as one finishes), from the checkpoint's shape
alone, with two rates measured when it runs:

    peak  the faster of a large matrix product in the model's dtype (2,048^3 torch.mm: oneDNN) and, where this CPU
          has it, the project's GEMM kernel (npu/kernels/gemm.cpp) over a weight held in L2: the rate of the CPU's
          multiply-adds themselves (on the AMD EPYC torch.mm's float32 product gave 133-192 GFLOP/s from run to run
          where the kernel gave 194, and the appliance's float32 workload ran at up to 100% of a ceiling taken from
          torch.mm alone)
    DRAM  a float32 sum over a buffer beyond any last-level cache

each the best of --rate-runs measurements (a shared host's rates drift by 10-20% from minute to minute, so
bench_peers measures them before each run's systems).

Each step's floor is the longer of its arithmetic at the peak and its bytes at the DRAM rate, the steps' floors
added (a roofline per step):

    arithmetic per token  2 x (the layers' projection weights) + 4 x heads x head_dim x context per layer
                          (q.k and p.v over the keys before it), and 2 x vocab x hidden per row whose logits
                          are computed (every decode row; a prompt's last token only)
    bytes per step        every weight once, and every decode row's K and V over its context once

Offline, the prompts are prefilled in steps of at most --chunk tokens, then G - 1 decode steps of N rows (the first
token comes from the prefill). Served at concurrency C, the steady state is a cycle in which each of the C streams
prefills one prompt and takes G - 1 decode steps of C rows; a prompt's prefill shares its steps' weight reads with
the decode rows, so it adds only its arithmetic. Nothing is added for norms, RoPE, sampling, scheduling, HTTP or
Python: the ceiling is above what any engine reaches, and a system's share of it (--measured) is how much of the
host's rate its whole path keeps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from profile_decode_floor import dram_read_rate, matmul_rate  # noqa: E402   (bench/, beside this script)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Dense:
    """A dense decoder's sizes, as the arithmetic and bytes of a step need them."""

    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    value_bytes: int             # bytes per weight, K or V value (the pool in the model's dtype, as the peers run)

    @staticmethod
    def of(config: dict, value_bytes: int) -> Dense:
        heads = config["num_attention_heads"]
        return Dense(config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"], heads,
                     config.get("num_key_value_heads", heads), config.get("head_dim") or config["hidden_size"] // heads,
                     config["vocab_size"], value_bytes)

    @property
    def layer_weights(self) -> int:
        """Projection weights of one layer: qkv, o, gate / up and down."""
        h, hd = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * hd + self.heads * hd * h + 3 * h * self.inter

    @property
    def head_weights(self) -> int:
        return self.vocab * self.hidden

    @property
    def all_weight_bytes(self) -> int:
        return (self.layers * self.layer_weights + self.head_weights) * self.value_bytes

    def token_flops(self, keys: float) -> float:
        """One token through every layer, attending over `keys` keys (the head not included)."""
        return 2.0 * self.layers * self.layer_weights + 4.0 * self.layers * self.heads * self.head_dim * keys

    def kv_read(self, keys: float) -> float:
        """Bytes of K and V one decode row reads over `keys` keys."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * keys * self.value_bytes


@dataclass(frozen=True)
class Rates:
    peak: float                  # FLOP/s
    dram: float                  # bytes/s

    def step(self, flops: float, read: float) -> float:
        return max(flops / self.peak, read / self.dram)


def offline_floor(m: Dense, rates: Rates, requests: int, prompt: int, gen: int, chunk: int) -> tuple[float, float]:
    """Seconds of the offline workload at the floor: (prefill, decode)."""
    tokens = requests * prompt
    steps = -(-tokens // chunk)
    flops = requests * sum(m.token_flops(p + 1) for p in range(prompt)) + 2.0 * requests * m.head_weights
    prefill = max(flops / rates.peak, steps * m.all_weight_bytes / rates.dram)
    decode = 0.0
    for s in range(1, gen):
        keys = prompt + s
        decode += rates.step(requests * (m.token_flops(keys) + 2.0 * m.head_weights),
                             m.all_weight_bytes + requests * m.kv_read(keys))
    return prefill, decode


def served_floor(m: Dense, rates: Rates, concurrency: int, prompt: int, gen: int) -> float:
    """Seconds per cycle of the served steady state (each of the C streams: one prefill, G - 1 decode steps)."""
    prefill = concurrency * (sum(m.token_flops(p + 1) for p in range(prompt)) + 2.0 * m.head_weights) / rates.peak
    keys = prompt + gen / 2                  # streams are spread over their lives: the mean context
    decode = (gen - 1) * rates.step(concurrency * (m.token_flops(keys) + 2.0 * m.head_weights),
                                    m.all_weight_bytes + concurrency * m.kv_read(keys))
    return prefill + decode


def kernel_rate(dtype: torch.dtype, repeats: int = 5) -> float:
    """GFLOP/s of the project's GEMM kernel over a 512 x 768 weight and 112 rows (each thread's half of the weight
    stays in its core's L2), the median of `repeats` timed loops after a warm-up; 0 where the library has no kernel
    for the dtype on this CPU."""
    from npu.gemm_cpu import PackedWeight, kernel_library

    lib = kernel_library(torch.device("cpu"), dtype)
    if lib is None:
        return 0.0
    weight = PackedWeight.of(torch.randn(512, 768).to(dtype), lib)
    x = torch.randn(112, 768).to(dtype)
    for _ in range(50):
        weight(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(200):
            weight(x)
        times.append((time.perf_counter() - t) / 200)
    return 2 * 112 * 512 * 768 / statistics.median(times) / 1e9


def parse_measured(text: str) -> list[tuple[str, float]]:
    out = []
    for part in filter(None, text.split(",")):
        label, _, value = part.partition("=")
        out.append((label.strip(), float(value)))
    return out


def shares(ceiling: float, measured: list[tuple[str, float]]) -> str:
    """Each system's tok/s as a share of the ceiling, and the first against the others."""
    if not measured:
        return ""
    cells = [f"{label} {tps:,.0f} ({tps / ceiling:.0%})" for label, tps in measured]
    first = measured[0][1]
    cells += [f"{measured[0][0]} / {label} {first / tps:.2f}x (at most {ceiling / tps:.2f}x)"
              for label, tps in measured[1:]]
    return "; ".join(cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Qwen3 checkpoint directory (its config.json is read)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64, help="offline: requests (bench_peers: 64)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=2048, help="offline: prefill tokens per step (max_num_batched_tokens)")
    ap.add_argument("--concurrency", default="1,8,32", help="served: comma-separated stream counts")
    ap.add_argument("--measured", default="", help="offline tok/s to set against the ceiling: label=tok/s,...")
    ap.add_argument("--served-measured", action="append", default=[],
                    help="C:label=tok/s,... (repeatable): served tok/s at concurrency C")
    ap.add_argument("--stream-mib", type=int, default=1024)
    ap.add_argument("--matmul-n", type=int, default=2048)
    ap.add_argument("--rate-runs", type=int, default=3, help="measure each rate this many times, keep the best")
    ap.add_argument("--json", default=None, help="also write the rates and ceilings here (bench_peers reads it)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    config = json.loads((Path(args.model) / "config.json").read_text())
    dtype = DTYPES[args.dtype or str(config.get("dtype") or config.get("torch_dtype") or "float32")]
    m = Dense.of(config, torch.tensor([], dtype=dtype).element_size())
    # the best of --rate-runs measurements: a ceiling takes the most the host gave (it drifts by 10-15% here)
    product = max(matmul_rate(dtype, args.matmul_n) for _ in range(args.rate_runs))
    kernel = max(kernel_rate(dtype) for _ in range(args.rate_runs))
    rates = Rates(max(product, kernel) * 1e9, max(dram_read_rate(args.stream_mib) for _ in range(args.rate_runs)) * 1e9)
    print(f"{args.model}: {m.layers} layers x hidden {m.hidden}, {m.heads} / {m.kv_heads} heads x {m.head_dim}, "
          f"intermediate {m.inter}, vocab {m.vocab}, {dtype}; {m.all_weight_bytes / 1e6:.0f} MB of weights")
    kernel_text = f"the GEMM kernel {kernel:.0f}" if kernel else "no GEMM kernel for this dtype here"
    print(f"rates ({args.threads} threads, the best of {args.rate_runs}): peak {rates.peak / 1e9:.0f} GFLOP/s "
          f"({args.matmul_n}^3 torch.mm {product:.0f}, {kernel_text}), DRAM {rates.dram / 1e9:.1f} GB/s "
          f"(float32 sum over {args.stream_mib} MiB)\n")

    prefill, decode = offline_floor(m, rates, args.requests, args.prompt_len, args.gen_len, args.chunk)
    ceiling = args.requests * args.gen_len / (prefill + decode)
    print("| workload | floor s (prefill + decode) | ceiling tok/s | measured (share of the ceiling) |")
    print("|---|---:|---:|---|")
    print(f"| offline {args.requests} x {args.prompt_len} -> {args.gen_len} | {prefill + decode:.3g} ({prefill:.3g} + "
          f"{decode:.3g}) | {ceiling:,.0f} | {shares(ceiling, parse_measured(args.measured))} |")
    result = {"peak_gflops": rates.peak / 1e9, "product_gflops": product, "kernel_gflops": kernel,
              "dram_gbps": rates.dram / 1e9, "offline_floor_s": prefill + decode, "offline_tok_s": ceiling,
              "served_tok_s": {}}
    served = {}
    for item in args.served_measured:
        c, _, rest = item.partition(":")
        served[int(c)] = parse_measured(rest)
    for c in (int(x) for x in args.concurrency.split(",") if x):
        cycle = served_floor(m, rates, c, args.prompt_len, args.gen_len)
        ceiling = c * args.gen_len / cycle
        print(f"| served, concurrency {c}, {args.prompt_len} -> {args.gen_len} | {cycle:.3g} per cycle | "
              f"{ceiling:,.0f} | {shares(ceiling, served.get(c, []))} |")
        result["served_tok_s"][str(c)] = ceiling
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
