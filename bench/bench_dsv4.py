"""The engine serving DeepSeek V4 against transformers `generate`, side by side in one run, on the same weights.

    python bench/bench_dsv4.py                  # 32 requests, prompts 16-128, outputs 16-64 (the bench.* defaults)
    python bench/bench_dsv4.py --requests 8 --runs 1     # smoke run
    python bench/bench_dsv4.py --threads 1

Both sides load one tiny random DeepSeek V4 checkpoint written here (dsv4_tiny, released tensor names, fixed
seed). Greedy, ignore_eos, and only the requested output tokens are counted on both sides.

- engine: Appliance (weights = the checkpoint, device=cpu, pinned kv_cache.num_slots_override, every request
  admitted at once), workload appliance.modes.bench.seeded_workload; requests go through Engine.submit with a
  callback (bench/bench_engine.py's run_engine), as mode=bench does.
- transformers: DeepseekV4ForCausalLM.generate one request at a time. Batching would need padding, and V4's
  compressors pool fixed windows of positions, which left padding shifts: transformers' V4 has no padded
  batch path that gives the unpadded tokens, so batch 1 is what a careful user runs.
--runs N (default 3) runs each side N times, interleaved (engine run 1, transformers run 1, ...): a fresh
Appliance per engine run (its start-up reported apart), one transformers model for all its runs. Prints a
markdown section (machine, load, median [min-max] tok/s side by side, greedy match in every run).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_engine import load_avg, machine, run_engine  # noqa: E402
from report import add_runs_argument, interleave, spread  # noqa: E402

from appliance.config.compose import load_runtime_config  # noqa: E402
from appliance.modes.bench import seeded_workload  # noqa: E402
from appliance.offline import Appliance  # noqa: E402
from tests.support.checkpoints import write_tiny_checkpoint  # noqa: E402

WEIGHTS_SEED = 7


def engine_side(overrides: list[str], work) -> dict:
    t0 = time.perf_counter()
    app = Appliance.from_config(overrides)
    startup_s = time.perf_counter() - t0
    try:
        run_engine(app.engine, [(p[:16], 4) for p, _ in work[:4]], "warmup")
        steps0 = app.engine.steps
        res = run_engine(app.engine, work, "work")
        res["steps"] = app.engine.steps - steps0
        res["preemptions"] = app.engine.scheduler.num_preemptions
    finally:
        app.close()
    res["startup_s"] = startup_s
    return res


def hf_side(model, work) -> dict:
    def generate(prompt: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
        return out[0, len(prompt):].tolist()

    generate(work[0][0][:16], 4)   # warm-up
    start = time.perf_counter()
    tokens = [generate(p, n) for p, n in work]
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "elapsed_s": elapsed, "output_tokens": sum(len(t) for t in tokens)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the whole process")
    ap.add_argument("--std", type=float, default=0.1, help="std of the random weights")
    ap.add_argument("--seed", type=int, default=1234, help="workload seed (bench.seed)")
    ap.add_argument("--decode-batch", type=int, default=32, help="engine decode_batch")
    add_runs_argument(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loads = [load_avg()]
    base = ["+model=dsv4_tiny", "max_model_len=256", f"bench.num_requests={args.requests}", f"bench.seed={args.seed}"]
    rc0 = load_runtime_config(base)
    work = seeded_workload(rc0)
    with tempfile.TemporaryDirectory(prefix="bench_dsv4_") as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "ckpt", rc0.model, seed=WEIGHTS_SEED, std=args.std)
        engine = [f"model.weights={ckpt}", "device=cpu", f"kv_cache.num_slots_override={args.requests}",
                  f"max_num_seqs={max(64, args.requests)}", f"decode_batch={args.decode_batch}",
                  "max_num_batched_tokens=1024"]
        import transformers
        t0 = time.perf_counter()
        model = transformers.DeepseekV4ForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None      # ignore_eos: always generate max_new_tokens
        hf_load_s = time.perf_counter() - t0
        runs = interleave(args.runs, {"engine": lambda i: engine_side(base + engine, work),
                                      "transformers": lambda i: hf_side(model, work)}, "bench_dsv4")
    loads.append(load_avg())
    eng_runs, hf_runs = runs["engine"], runs["transformers"]
    eng = eng_runs[0]
    matches = min(sum(e == h for e, h in zip(er["tokens"], hr["tokens"], strict=True))
                  for er in eng_runs for hr in hf_runs)
    mach = machine()
    lay = rc0.model.layout
    prompt_lens, out_lens = [len(p) for p, _ in work], [n for _, n in work]
    shown = " ".join(o if not o.startswith("model.weights=") else "model.weights=<checkpoint dir>"
                     for o in base + engine)
    tps = {name: [r["output_tokens"] / r["elapsed_s"] for r in rs] for name, rs in (("e", eng_runs), ("h", hf_runs))}
    L = ["### DeepSeek V4 (tiny): engine vs transformers `generate`", "", "```", f"python {shlex.join(sys.argv)}",
         "```", "",
         f"- machine: {mach['cpu']}, nproc {mach['nproc']}, torch {mach['torch']} ({mach['threads']} threads), "
         f"transformers {mach['transformers']}, Python {mach['python']}; load average (1/5/15 min) {loads[0]} "
         f"at start, {loads[1]} at end",
         f"- model: dsv4_tiny with random weights (seed {WEIGHTS_SEED}, std {args.std}): hidden {lay.hidden_size}, "
         f"{lay.num_layers} layers + {lay.num_mtp_layers} MTP, {lay.num_experts} experts "
         f"top-{lay.num_experts_per_tok}, "
         f"hc_mult {lay.hc_mult}, ratios {sorted(set(lay.main_layer_ratios))}, {lay.dtype}; one checkpoint for both",
         f"- workload: {len(work)} requests, prompt {min(prompt_lens)}-{max(prompt_lens)} tokens, output "
         f"{min(out_lens)}-{max(out_lens)}, greedy, ignore_eos; engine: all submitted at once (`{shown}`); "
         f"transformers: one request at a time",
         f"- every figure: median [min-max] over {args.runs} run(s), engine and transformers interleaved run by run; "
         f"ratios per run (engine / transformers of the same round)", "",
         "| system | output tokens | wall s | output tok/s | vs transformers |", "|---|---:|---:|---:|---:|"]
    ratios = [e / h for e, h in zip(tps["e"], tps["h"])]
    for name, rs, key, ratio in (("this engine", eng_runs, "e", spread(ratios, "{:.2f}") + "x"),
                                 ("transformers generate", hf_runs, "h", "1.00x")):
        L.append(f"| {name} | {rs[0]['output_tokens']:,} | {spread([r['elapsed_s'] for r in rs], '{:.2f}')} | "
                 f"{spread(tps[key], '{:,.0f}')} | {ratio} |")
    L += ["", f"- engine: time to ready {spread([r['startup_s'] for r in eng_runs], '{:.2f}')} s, {eng['steps']} steps, "
              f"{eng['preemptions']} preemptions; transformers from_pretrained {hf_load_s:.2f} s (once)",
          f"- greedy match: **{matches}/{len(work)}** requests token-identical (the lowest over every pair of runs)"]
    print("\n".join(L))


if __name__ == "__main__":
    main()
