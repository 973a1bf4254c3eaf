"""The engine against Hugging Face transformers `generate`, side by side in one run, on the same weights.

    python bench/bench_engine.py                        # mixed: 64 requests, prompts 16-512, outputs 16-256
    python bench/bench_engine.py --workload scale       # 4-layer hidden-512 bf16 Qwen3, 64 x 128 in / 128 out
    python bench/bench_engine.py --quick                # smoke run (fewer, shorter requests)
    python bench/bench_engine.py --threads 2 --profile  # + cProfile of the engine loop thread
    python bench/bench_engine.py --runs 5               # 5 interleaved runs per side (default 3)

Both sides load one tiny random Qwen3 checkpoint written here (tests.support.checkpoints.write_tiny_checkpoint, fixed
seed). Greedy, ignore_eos, and only the requested output tokens are counted on both sides.

- engine: Appliance (weights = the checkpoint, device=cpu, pinned kv_cache.num_slots_override, every
  request admitted at once); the workload is appliance.modes.bench.seeded_workload over bench.* overrides;
  requests go through Engine.submit with a callback, as mode=bench does, so tokens are timestamped.
- transformers: what a careful user does with `generate`: requests sorted by prompt length, cut into
  batches, left padding with an attention mask, max_new_tokens = the longest output of the batch, each row
  then truncated to its own output length. The batch size and torch thread count are transformers' best for
  the workload: a quick pass runs the workload once at each of --hf-batches (8 16 32 64) x --hf-threads (1
  and torch's default) and keeps the fastest (--hf-batch pins the size). The thread count matters: on a
  loaded 2-core host, 2 OpenMP threads made `generate` over 10x slower than 1 while the engine barely moved.
  The tokens HF computes past a row's length are work it wastes; they are reported (as "computed tok/s") but
  not counted as output.

Each side runs --runs times (default 3), interleaved: engine run 1, transformers run 1, engine run 2, ...; the
engine is a fresh Appliance each run (a reused one would serve the repeated prompts from its prefix cache),
the transformers model is loaded once. Every figure is the median [min-max] over the runs; the load average is
printed at start and end.

Also: the engine's time to ready, the greedy match rate (first divergence and the HF top-2 logit gap there
for each mismatch), and steady-state decode tokens/s at batch 1, 8, 32 (short prompts, long outputs,
started together; timed from the step where every request has its first token to the last token; HF:
(T(N) - T(1)) of generate with N and 1 new tokens), measured in the same interleaved runs. Prints a
markdown section for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import platform
import pstats
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from report import (  # noqa: E402
    LoadWatch,
    add_runs_argument,
    cpu_model,
    format_load,
    interleave,
    package_version,
    progress,
    spread,
    usable_cores,
)

from appliance.config.compose import load_runtime_config  # noqa: E402
from appliance.core.config import RuntimeConfig  # noqa: E402
from appliance.core.request import SamplingParams  # noqa: E402
from appliance.modes.bench import seeded_workload  # noqa: E402
from appliance.offline import Appliance  # noqa: E402
from tests.support.checkpoints import write_tiny_checkpoint  # noqa: E402

SCALE_LAYOUT = [
    "model.layout.hidden_size=512", "model.layout.num_layers=4", "model.layout.num_heads=8",
    "model.layout.num_kv_heads=4", "model.layout.head_dim=64", "model.layout.intermediate_size=1536",
    "model.layout.dtype=bfloat16", "model.cache_groups.0.row.dtype=bfloat16", "model.cache_groups.0.row.width=512",
]
WEIGHTS_SEED = 7
DECODE_PROMPT_LEN = 16


# -- setup -------------------------------------------------------------------------------------------------
def workload_overrides(args: argparse.Namespace) -> list[str]:
    """Hydra overrides of the model and the workload (bench.*), before the engine-only settings."""
    n = args.requests
    if args.workload == "mixed":
        lens = (16, 128, 16, 64) if args.quick else (16, 512, 16, 256)
        out = ["+model=qwen3_tiny", f"max_model_len={args.max_model_len or 1024}"]
    else:
        lens = (64, 64, 32, 32) if args.quick else (128, 128, 128, 128)
        out = ["+model=qwen3_tiny", *SCALE_LAYOUT, f"max_model_len={args.max_model_len or 512}"]
    if args.vocab:
        out.append(f"model.layout.vocab_size={args.vocab}")
    out += [f"bench.num_requests={n}", f"bench.prompt_len_min={lens[0]}", f"bench.prompt_len_max={lens[1]}",
            f"bench.output_len_min={lens[2]}", f"bench.output_len_max={lens[3]}", f"bench.seed={args.seed}"]
    return out


def engine_overrides(args: argparse.Namespace, weights: str) -> list[str]:
    slots = max(args.requests, max(args.decode_batches))
    out = [f"model.weights={weights}", "device=cpu", f"kv_cache.num_slots_override={slots}",
           f"max_num_seqs={max(64, slots)}", f"decode_batch={args.decode_batch}",
           f"max_num_batched_tokens={args.max_num_batched_tokens}"]
    return out  # no device.cpu_threads: --threads / torch's default holds for both sides (checked in main)


def machine() -> dict[str, str]:
    """The machine as a dict (bench_dsv4.py formats it itself; new scripts use report.LoadWatch.header)."""
    return {"cpu": cpu_model(), "nproc": str(usable_cores()), "torch": torch.__version__,
            "threads": str(torch.get_num_threads()), "transformers": package_version("transformers"),
            "python": platform.python_version()}


def load_avg() -> str:
    return format_load(os.getloadavg())


# -- engine side ---------------------------------------------------------------------------------------------
def run_engine(engine, work: list[tuple[list[int], int]], prefix: str, timeout: float = 1800) -> dict:
    """Submit every request at once (greedy, ignore_eos); record each token's arrival time in the callback."""
    tokens: list[list[int]] = [[] for _ in work]
    times: list[list[float]] = [[] for _ in work]
    errors: list[str] = []
    loop_threads: list[int] = []     # torch's thread count as the engine loop thread sees it
    remaining = [len(work)]
    all_done = threading.Event()

    def record(i: int, out) -> None:  # runs on the engine loop thread
        now = time.perf_counter()
        if not loop_threads:
            loop_threads.append(torch.get_num_threads())
        tokens[i].extend(out.new_token_ids)
        times[i].extend([now] * len(out.new_token_ids))
        if out.finished:
            if out.error or out.finish_reason.value != "length":
                errors.append(f"{out.request_id}: finish {out.finish_reason.value} {out.error or ''}")
            remaining[0] -= 1
            if remaining[0] == 0:
                all_done.set()

    start = time.perf_counter()
    for i, (prompt, n_out) in enumerate(work):
        engine.submit(f"{prefix}-{i}", prompt, SamplingParams(max_tokens=n_out, ignore_eos=True),
                      on_output=lambda out, i=i: record(i, out))
    if not all_done.wait(timeout):
        raise RuntimeError(f"{remaining[0]} of {len(work)} engine requests ({prefix}) unfinished after {timeout:.0f} s")
    elapsed = time.perf_counter() - start
    if errors:
        raise RuntimeError("engine requests did not finish by length: " + "; ".join(errors[:5]))
    return {"tokens": tokens, "times": times, "start": start, "elapsed_s": elapsed, "loop_threads": loop_threads[0],
            "output_tokens": sum(len(t) for t in tokens)}


def decode_window(times: list[list[float]]) -> tuple[float, int, int]:
    """(seconds, tokens, steps) from the moment every request has its first token to the last token."""
    t0 = max(t[0] for t in times)
    t1 = max(t[-1] for t in times)
    n = sum(sum(1 for x in t if x > t0) for t in times)
    steps = max(sum(1 for x in t if x > t0) for t in times)
    return t1 - t0, n, steps


def decode_prompts(batch: int, vocab: int) -> list[list[int]]:
    """Distinct prompts per row and per batch size (no prefix-cache hits between the decode runs)."""
    return [[3 + (97 * b + 31 * batch + 13 * j + b * j) % (vocab - 3) for j in range(DECODE_PROMPT_LEN)]
            for b in range(batch)]


def engine_side(rc: RuntimeConfig, work, args) -> dict:
    t0 = time.perf_counter()
    app = Appliance(rc)
    startup_s = time.perf_counter() - t0
    engine = app.engine
    try:
        run_engine(engine, [(p[:16][::-1], 4) for p, _ in work[:4]], "warmup")  # no prefix of the work
        steps0 = engine.steps
        res = run_engine(engine, work, "work")
        res["steps"] = engine.steps - steps0
        res["preemptions"] = engine.scheduler.num_preemptions
        decode = {}
        vocab = rc.model.layout.vocab_size
        for b in args.decode_batches:
            r = run_engine(engine, [(p, args.decode_len) for p in decode_prompts(b, vocab)], f"decode{b}")
            secs, n, steps = decode_window(r["times"])
            decode[b] = {"tok_s": n / secs, "ms_step": secs / steps * 1e3}
    finally:
        app.close()
    res.update(startup_s=startup_s, decode=decode)
    return res


def profile_engine(rc: RuntimeConfig, work, top: int) -> str:
    """cProfile of the engine loop thread over the workload (a fresh Appliance; its thread is hooked at start)."""
    prof = cProfile.Profile()

    def hook(*_):  # first profile event on a newly started thread: hand that thread to cProfile
        sys.setprofile(None)
        prof.enable()

    threading.setprofile(hook)
    try:
        app = Appliance(rc)
    finally:
        threading.setprofile(None)
    try:
        run_engine(app.engine, work, "profile")
    finally:
        app.close()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


# -- transformers side ---------------------------------------------------------------------------------------
def load_hf(ckpt: Path, dtype: torch.dtype):
    import transformers  # imported before the timer starts (see main)
    try:
        model = transformers.Qwen3ForCausalLM.from_pretrained(str(ckpt), dtype=dtype)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = transformers.Qwen3ForCausalLM.from_pretrained(str(ckpt), torch_dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None      # ignore_eos: always generate max_new_tokens
    return model


def hf_generate(model, prompts: list[list[int]], max_new: int, pad_id: int) -> list[list[int]]:
    """One left-padded batch, greedy; returns each row's max_new new tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                             do_sample=False, pad_token_id=pad_id)
    return out[:, width:].tolist()


def hf_mixed(model, work, hf_batch: int, pad_id: int) -> dict:
    """The workload as a careful user batches it for `generate` (see the module docstring)."""
    order = sorted(range(len(work)), key=lambda i: len(work[i][0]))
    tokens: list[list[int]] = [[] for _ in work]
    computed = 0
    start = time.perf_counter()
    for b in range(0, len(order), hf_batch):
        idx = order[b:b + hf_batch]
        max_new = max(work[i][1] for i in idx)
        out = hf_generate(model, [work[i][0] for i in idx], max_new, pad_id)
        computed += len(idx) * max_new
        for i, row in zip(idx, out):
            tokens[i] = row[:work[i][1]]
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "elapsed_s": elapsed, "output_tokens": sum(len(t) for t in tokens),
            "computed_tokens": computed}


def hf_decode(model, batch: int, decode_len: int, vocab: int, pad_id: int) -> dict:
    """Steady decode of `batch` rows: (T(N new tokens) - T(1 new token)) takes the prefill out."""
    prompts = decode_prompts(batch, vocab)
    t0 = time.perf_counter()
    hf_generate(model, prompts, 1, pad_id)
    t1 = time.perf_counter()
    hf_generate(model, prompts, decode_len, pad_id)
    t2 = time.perf_counter()
    secs = (t2 - t1) - (t1 - t0)
    return {"tok_s": batch * (decode_len - 1) / secs, "ms_step": secs / (decode_len - 1) * 1e3}


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to n for the block (this thread), then put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def hf_side(model, work, setting: tuple[int, int], pad_id: int, args, vocab: int) -> dict:
    """One transformers run at setting = (threads, batch size): the workload, then steady decode."""
    threads, batch = setting
    with torch_threads(threads):
        res = hf_mixed(model, work, batch, pad_id)
        res["decode"] = {b: hf_decode(model, b, args.decode_len, vocab, pad_id) for b in args.decode_batches}
    return res


def best_hf_setting(model, work, batches: list[int], threads: list[int],
                    pad_id: int) -> tuple[tuple[int, int], dict[tuple[int, int], float]]:
    """transformers' fastest (threads, batch size) for this workload: one run at each pair (batch sizes capped
    at the number of requests). Returns (best, output tok/s per pair tried)."""
    tried: dict[tuple[int, int], float] = {}
    for t in sorted(set(threads)):
        with torch_threads(t):
            for b in sorted({min(c, len(work)) for c in batches}):
                progress(f"[bench_engine] transformers setting search: {t} thread(s), batch {b} ...")
                r = hf_mixed(model, work, b, pad_id)
                tried[(t, b)] = r["output_tokens"] / r["elapsed_s"]
    return max(tried, key=tried.get), tried


def divergence(model, prompt: list[int], hf_toks: list[int], eng_toks: list[int]) -> dict:
    """First differing position; there, HF's (unpadded) top-2 logit gap and the engine token's rank and deficit."""
    d = next((k for k, (a, b) in enumerate(zip(hf_toks, eng_toks)) if a != b), min(len(hf_toks), len(eng_toks)))
    if d == len(eng_toks) or d == len(hf_toks):
        raise RuntimeError(f"engine gave {len(eng_toks)} tokens, transformers {len(hf_toks)}: lengths must agree")
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + hf_toks[:d]])).logits[0, -1].float()
    top2 = logits.topk(2).values
    eng = eng_toks[d]
    return {"pos": d, "gap": float(top2[0] - top2[1]), "deficit": float(logits.max() - logits[eng]),
            "rank": int((logits > logits[eng]).sum()) + 1}


# -- report --------------------------------------------------------------------------------------------------
def tok_s(r: dict, key: str = "output_tokens") -> float:
    return r[key] / r["elapsed_s"]


def markdown(args, rc: RuntimeConfig, overrides: list[str], watch: LoadWatch, engs: list[dict], hfs: list[dict],
             work, matches: int, diverged: list[tuple[int, dict]], hf_load_s: float, hf_setting: tuple[int, int],
             hf_tried: dict[tuple[int, int], float], profile: str) -> str:
    hf_threads, hf_batch = hf_setting
    lay = rc.model.layout
    prompt_lens = [len(p) for p, _ in work]
    out_lens = [n for _, n in work]
    ratios = [tok_s(e) / tok_s(h) for e, h in zip(engs, hfs)]
    L = [f"### Engine vs transformers `generate` — {args.workload} workload{' (quick)' if args.quick else ''}", ""]
    L += ["```", f"python {shlex.join(sys.argv)}", "```", ""]
    L += [watch.header(args.runs),
          f"- torch threads: engine {engs[0]['loop_threads']} (as its loop thread sees it), transformers "
          f"{hf_threads} (one process)",
          f"- model: random Qwen3 (seed {WEIGHTS_SEED}, std {args.std}), hidden {lay.hidden_size}, {lay.num_layers} "
          f"layers, {lay.num_heads} heads / {lay.num_kv_heads} KV heads x {lay.head_dim}, intermediate "
          f"{lay.intermediate_size}, vocab {lay.vocab_size}, {lay.dtype}; one checkpoint loaded by both sides",
          f"- workload: {len(work)} requests, prompt {min(prompt_lens)}-{max(prompt_lens)} tokens "
          f"(mean {sum(prompt_lens) / len(work):.0f}), output {min(out_lens)}-{max(out_lens)} "
          f"(mean {sum(out_lens) / len(work):.0f}), seed {args.seed}, greedy, ignore_eos; all submitted at once",
          f"- engine: `{' '.join(overrides)}`; a fresh Appliance each run (no prefix-cache hits across runs)",
          f"- transformers: sorted by prompt length, batches of **{hf_batch}**, left padding + attention mask, "
          f"max_new_tokens = longest output in the batch, rows truncated to their own length; it computes "
          f"{hfs[0]['computed_tokens']:,} tokens to deliver {hfs[0]['output_tokens']:,}",
          "- transformers setting (threads x batch: output tok/s, one run each): "
          + (", ".join(f"{t} x {b}: {v:,.0f}" for (t, b), v in hf_tried.items())
             + f"; fastest {hf_threads} thread(s), batch {hf_batch}" if hf_tried
             else f"{hf_threads} thread(s), batch {hf_batch}, pinned"), ""]
    L += ["| system | output tokens | wall s | output tok/s | vs transformers |", "|---|---:|---:|---:|---:|"]
    L.append(f"| this engine | {engs[0]['output_tokens']:,} | {spread([e['elapsed_s'] for e in engs], '{:.2f}')} | "
             f"{spread([tok_s(e) for e in engs], '{:,.0f}')} | {spread(ratios, '{:.2f}')}x |")
    L.append(f"| transformers generate (batch {hf_batch}, {hf_threads} thread(s)) | {hfs[0]['output_tokens']:,} | "
             f"{spread([h['elapsed_s'] for h in hfs], '{:.2f}')} | {spread([tok_s(h) for h in hfs], '{:,.0f}')} | "
             "1.00x |")
    L.append(f"| transformers, counting the padded tokens it computed | {hfs[0]['computed_tokens']:,} | | "
             f"{spread([tok_s(h, 'computed_tokens') for h in hfs], '{:,.0f}')} | |")
    L += ["", f"- engine: time to ready {spread([e['startup_s'] for e in engs], '{:.2f}')} s; "
              f"{engs[0]['steps']} steps, {engs[0]['preemptions']} preemptions; transformers from_pretrained "
              f"{hf_load_s:.2f} s (once; first call includes its lazy imports)",
          f"- speed-up (per run, engine / transformers of the same round): **{spread(ratios, '{:.2f}')}x** "
          "output tokens/s",
          f"- greedy match: **{matches}/{len(work)}** requests token-identical", ""]
    if diverged:
        L += ["| request | prompt | output | first divergence | HF top-2 gap there | engine token: HF rank, "
              "logit below top |", "|---:|---:|---:|---:|---:|---|"]
        for i, d in diverged[:12]:
            L.append(f"| {i} | {len(work[i][0])} | {work[i][1]} | {d['pos']} | {d['gap']:.2e} | "
                     f"{d['rank']}, {d['deficit']:.2e} |")
        if len(diverged) > 12:
            L.append(f"| ... {len(diverged) - 12} more | | | | | |")
        L.append("")
    L += [f"Steady-state decode: batch B requests of {DECODE_PROMPT_LEN}-token prompts and {args.decode_len} "
          "output tokens started together; engine timed from the step where every request has its first token "
          "to the last token; transformers: B x (N - 1) / (T(N new tokens) - T(1 new token)); same interleaved "
          "runs.", "",
          "| batch | engine tok/s | engine ms/step | transformers tok/s | transformers ms/step | ratio |",
          "|---:|---:|---:|---:|---:|---:|"]
    for b in args.decode_batches:
        e = [r["decode"][b] for r in engs]
        h = [r["decode"][b] for r in hfs]
        ratio = [x["tok_s"] / y["tok_s"] for x, y in zip(e, h)]
        L.append(f"| {b} | {spread([x['tok_s'] for x in e], '{:,.0f}')} | {spread([x['ms_step'] for x in e], '{:.2f}')}"
                 f" | {spread([y['tok_s'] for y in h], '{:,.0f}')} | {spread([y['ms_step'] for y in h], '{:.2f}')} | "
                 f"{spread(ratio, '{:.2f}')}x |")
    L += ["", watch.footer()]
    if profile:
        L += ["", "<details><summary>cProfile of the engine loop thread</summary>", "", "```", profile.strip(),
              "```", "</details>"]
    return "\n".join(L) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("mixed", "scale"), default="mixed")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads for the whole process (default: torch's choice)")
    ap.add_argument("--requests", type=int, default=None, help="default 64 (16 with --quick)")
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer and shorter requests")
    add_runs_argument(ap)
    ap.add_argument("--hf-batch", type=int, default=None, help="pin the transformers batch size")
    ap.add_argument("--hf-batches", type=int, nargs="+", default=[8, 16, 32, 64],
                    help="transformers batch sizes tried in the quick pass; the fastest is used")
    ap.add_argument("--hf-threads", type=int, nargs="+", default=None,
                    help="torch thread counts tried for transformers in the quick pass (default: 1 and the "
                         "engine's)")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--decode-len", type=int, default=None, help="output tokens per decode request (256; quick 32)")
    ap.add_argument("--decode-batch", type=int, default=64, help="engine decode_batch")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="engine step token budget")
    ap.add_argument("--max-model-len", type=int, default=None, help="default 1024 mixed, 512 scale")
    ap.add_argument("--vocab", type=int, default=None, help="override model.layout.vocab_size")
    ap.add_argument("--std", type=float, default=0.1, help="std of the random weights")
    ap.add_argument("--seed", type=int, default=1234, help="workload seed (bench.seed)")
    ap.add_argument("--profile", action="store_true", help="also cProfile the engine loop over the workload")
    ap.add_argument("--profile-top", type=int, default=25)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.requests = args.requests or (16 if args.quick else 64)
    args.decode_len = args.decode_len or (32 if args.quick else 256)
    if args.decode_len < 2:
        ap.error("--decode-len must be >= 2")
    if args.runs < 1:
        ap.error("--runs must be >= 1")

    watch = LoadWatch()
    threads = torch.get_num_threads()
    base = workload_overrides(args)
    rc0 = load_runtime_config(base)
    work = seeded_workload(rc0)
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "ckpt", rc0.model, seed=WEIGHTS_SEED, std=args.std)
        overrides = base + engine_overrides(args, str(ckpt))
        rc = load_runtime_config(overrides)
        vocab = rc.model.layout.vocab_size
        profile = ""
        if args.profile:
            progress("[bench_engine] profiling the engine ...")
            profile = profile_engine(rc, work, args.profile_top)
        import transformers  # noqa: F401  (its import is not from_pretrained time)
        t0 = time.perf_counter()
        model = load_hf(ckpt, getattr(torch, rc.model.layout.dtype))
        hf_load_s = time.perf_counter() - t0
        pad_id = model.config.pad_token_id
        hf_generate(model, [p[:16] for p, _ in work[:4]], 4, pad_id)  # warm-up
        batches = [args.hf_batch] if args.hf_batch else args.hf_batches
        thread_counts = args.hf_threads or [1, threads]
        hf_tried: dict[tuple[int, int], float] = {}
        if len(set(batches)) * len(set(thread_counts)) > 1:
            hf_setting, hf_tried = best_hf_setting(model, work, batches, thread_counts, pad_id)
        else:
            hf_setting = (thread_counts[0], min(batches[0], len(work)))
        runs = interleave(args.runs, {
            "engine": lambda i: engine_side(rc, work, args),
            f"transformers ({hf_setting[0]} thread(s), batch {hf_setting[1]})":
                lambda i: hf_side(model, work, hf_setting, pad_id, args, vocab),
        }, "bench_engine")
        engs, hfs = runs.values()
        for side, results in (("engine", engs), ("transformers", hfs)):
            if any(r["tokens"] != results[0]["tokens"] for r in results):
                raise RuntimeError(f"{side}: greedy outputs differ between runs of the same workload")
        matches, diverged = 0, []
        for i, (prompt, _) in enumerate(work):
            if engs[0]["tokens"][i] == hfs[0]["tokens"][i]:
                matches += 1
            else:
                diverged.append((i, divergence(model, prompt, hfs[0]["tokens"][i], engs[0]["tokens"][i])))
    if torch.get_num_threads() != threads:
        raise RuntimeError(f"torch threads changed from {threads} to {torch.get_num_threads()} during the run "
                           "(device.cpu_threads?): the two sides would not be compared on equal terms")
    shown = [o if not o.startswith("model.weights=") else "model.weights=<checkpoint dir>" for o in overrides]
    print(markdown(args, rc, shown, watch, engs, hfs, work, matches, diverged, hf_load_s, hf_setting, hf_tried,
                   profile))


if __name__ == "__main__":
    main()
