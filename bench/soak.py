"""Soak: a real server (`python -m appliance`, the embedded default) under concurrent mixed load for a while:
gRPC streams, client cancels mid-stream and bad requests, and over HTTP completions with `n` > 1, JSON output
(`response_format: json_object`), logprobs, chat and refused bodies, with a KV cache small enough that sequences
are preempted. At the end the engine must be idle with every cache group's used blocks back to 0 (Stats RPC),
the server's RSS flat (end vs after the warm-up; sampled every --sample seconds, the samples printed), no
unexpected error, and a clean SIGTERM exit 0.

    python bench/soak.py                       # 15 minutes (SOAK_SECONDS or --seconds to change)
    make soak SOAK_SECONDS=120                 # a short one
    python bench/soak.py --kv-slots 0          # the KV cache the planner sizes (the default server's: ~700k pages,
                                               # no preemption), where the prefix cache fills for a long time

Prints a summary table; exits 1 when a check fails (each failed check is named), 0 otherwise. Never part of
`make test`: it runs for minutes and loads the machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from appliance.client import ApplianceClient  # noqa: E402
from appliance.config.compose import load_runtime_config  # noqa: E402
from appliance.serve.api import appliance_pb2 as pb  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# By default a KV cache of 2 capacity slots (2 x 256 tokens, --kv-slots) under max_num_seqs=8 and prompts + outputs
# up to 256 tokens: growing sequences run out of blocks, so the scheduler preempts and readmits them all the time.
SERVER = ["device=cpu", "device.cpu_threads=1", "max_model_len=256", "max_num_seqs=8", "decode_batch=8",
          "max_waiting_requests=64", "server.port=0", "server.http_port=0", "server.grace_period_s=5"]
VOCAB_LOW = 3                       # ids below are special tokens
IDLE_WAIT_S = 60.0                  # after the load: how long the engine may take to come back to idle
UNEXPECTED = ("failed", "wrong", "bad accepted", "bad other", "client error")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Tally:
    """What the clients saw, counted across threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.tokens = 0
        self.unexpected: list[str] = []

    def add(self, kind: str, tokens: int = 0, unexpected: str | None = None) -> None:
        with self.lock:
            self.counts[kind] += 1
            self.tokens += tokens
            if unexpected is not None and len(self.unexpected) < 20:
                self.unexpected.append(unexpected)


def one_request(client: ApplianceClient, rng: random.Random, vocab: int, tally: Tally, cancel_p: float,
                bad_p: float) -> None:
    """A full stream (checked: exactly max_tokens tokens, finish length), a stream cancelled after a few tokens,
    or a bad request (checked: INVALID_ARGUMENT)."""
    roll = rng.random()
    prompt = [rng.randrange(VOCAB_LOW, vocab) for _ in range(rng.randint(8, 160))]
    max_tokens = rng.randint(8, 96)
    if roll < bad_p:
        bad = rng.choice([{"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 1.5}])
        prompt = [vocab + 1] if rng.random() < 0.3 else prompt
        try:
            list(client.generate(prompt, timeout=120, **({"max_tokens": 4} | bad)))
            tally.add("bad accepted", unexpected=f"bad request accepted: {bad}")
        except grpc.RpcError as exc:
            ok = exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            tally.add("bad refused" if ok else "bad other", unexpected=None if ok else f"bad -> {exc.code().name}")
        return
    sampling = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": rng.choice([0.0, 0.8]),
                "seed": rng.randrange(1 << 30)}
    cancel_after = rng.randint(1, max(1, max_tokens // 2)) if roll < bad_p + cancel_p else None
    got, last = 0, None
    stream = client.generate(prompt, timeout=600, **sampling)
    try:
        for last in stream:
            got += len(last.new_token_ids)
            if cancel_after is not None and got >= cancel_after:
                stream.close()                      # the client goes away mid-stream: the server aborts it
                tally.add("cancelled", got)
                return
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            tally.add("queue full")
        else:
            tally.add("failed", got, f"{exc.code().name}: {exc.details()[:200]}")
        return
    if last is None or last.finish_reason is None or last.finish_reason.value != "length" or got != max_tokens:
        tally.add("wrong", got, f"stream ended after {got}/{max_tokens} tokens, finish {last and last.finish_reason}")
    else:
        tally.add("completed", got)


def http_request(conn: http.client.HTTPConnection, path: str, body: dict) -> tuple[int, dict]:
    """One POST on a keep-alive connection; the status and the JSON body. Sent again once on a new connection
    when the server had closed the old one (an idle keep-alive connection closes after 5 s)."""
    for attempt in (1, 2):
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"{}")
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            conn.close()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def one_http_request(conn: http.client.HTTPConnection, rng: random.Random, vocab: int, tally: Tally,
                     bad_p: float) -> None:
    """A completion with n > 1 (checked: n choices), with logprobs (checked: one entry per token), JSON output
    (checked: a finish reason), a chat, or a refused body (checked: 400)."""
    prompt = [rng.randrange(VOCAB_LOW, vocab) for _ in range(rng.randint(8, 96))]
    max_tokens = rng.randint(4, 24)
    base = {"prompt": prompt, "max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]),
            "seed": rng.randrange(1 << 30)}
    kind = rng.choice(["n", "logprobs", "json_object", "chat"]) if rng.random() >= bad_p else "bad"
    if kind == "n":
        n = rng.randint(2, 4)
        status, body = http_request(conn, "/v1/completions", base | {"n": n, "ignore_eos": True})
        ok = status == 200 and len(body.get("choices", ())) == n
    elif kind == "logprobs":
        status, body = http_request(conn, "/v1/completions", base | {"logprobs": 3, "ignore_eos": True})
        ok = status == 200 and len(body["choices"][0]["logprobs"]["tokens"]) == max_tokens
    elif kind == "json_object":
        status, body = http_request(conn, "/v1/completions", base | {"response_format": {"type": "json_object"}})
        ok = status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
    elif kind == "chat":
        messages = [{"role": "user", "content": f"tell me about {rng.randrange(1 << 20)}"}]
        status, body = http_request(conn, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                                                   "logprobs": True, "top_logprobs": 2})
        ok = status == 200 and bool(body.get("choices"))
    else:
        status, body = http_request(conn, "/v1/completions", base | rng.choice(
            [{"n": 0}, {"max_tokens": -1}, {"top_p": 2.0}, {"min_p": 0.1}]))
        ok = status == 400
    if status == 429:
        tally.add("queue full")
    elif ok:
        tally.add(f"http {kind}", max_tokens if kind != "bad" else 0)
    else:
        tally.add(f"http {kind} wrong", unexpected=f"http {kind} -> {status}: {json.dumps(body)[:200]}")


def client_loop(address: str, http_address: str | None, seed: int, deadline: float, vocab: int, tally: Tally,
                cancel_p: float, bad_p: float, http_p: float) -> None:
    rng = random.Random(seed)
    conn = http.client.HTTPConnection(*http_address.rsplit(":", 1), timeout=600) if http_address else None
    with ApplianceClient(address) as client:
        while time.monotonic() < deadline:
            try:
                if conn is not None and rng.random() < http_p:
                    one_http_request(conn, rng, vocab, tally, bad_p)
                else:
                    one_request(client, rng, vocab, tally, cancel_p, bad_p)
            except Exception as exc:  # noqa: BLE001 - counted and reported, the soak goes on
                tally.add("client error", unexpected=f"{type(exc).__name__}: {exc}"[:200])
                if conn is not None:
                    conn.close()                    # reconnects on the next request
    if conn is not None:
        conn.close()


def wait_idle(client: ApplianceClient, timeout_s: float) -> pb.StatsResponse:
    """The Stats answer once nothing runs or waits and no group holds a block (or the last one at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stub.Stats(pb.StatsRequest(), timeout=10)
        idle = (stats.num_requests_running == 0 and stats.num_requests_waiting == 0
                and all(g.used_blocks == 0 for g in stats.cache_groups))
        if idle or time.monotonic() >= deadline:
            return stats
        time.sleep(0.5)


def start_server(extra: list[str], run_dir: str) -> tuple[subprocess.Popen, str, str | None, list[str]]:
    """The server process, its gRPC address, its HTTP address (None without HTTP) and its output so far."""
    proc = subprocess.Popen([sys.executable, "-m", "appliance", *SERVER, *extra, f"hydra.run.dir={run_dir}"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    http_address = None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("http listening on"):
            http_address = line.split()[3]
        if line.startswith("SERVING on"):
            threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
            return proc, line.split()[2], http_address, lines
    raise SystemExit("the server ended before SERVING:\n" + "".join(lines[-40:]))


def sample_rss(pid: int, every_s: float, until: threading.Event, start: float, samples: list) -> None:
    """(seconds since start, RSS bytes) every every_s until `until` is set."""
    while not until.wait(every_s):
        samples.append((time.monotonic() - start, rss_bytes(pid)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", 900)))
    ap.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    ap.add_argument("--cancel", type=float, default=0.25, help="share of requests cancelled mid-stream")
    ap.add_argument("--bad", type=float, default=0.05, help="share of bad requests")
    ap.add_argument("--http", type=float, default=0.4, help="share of requests sent over HTTP (0: gRPC only)")
    ap.add_argument("--sample", type=float, default=60.0, help="seconds between RSS samples")
    ap.add_argument("--kv-slots", type=int, default=2,
                    help="kv_cache.num_slots_override (0: the planner's size; then no preemption is expected)")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before the RSS baseline (default 20%%)")
    ap.add_argument("--rss-limit-mib", type=float, default=16.0,
                    help="RSS may grow at most this much from the warm-up's end to the end (and 10%%); "
                         "BENCHMARKS.md 'Soak' says why 16")
    ap.add_argument("overrides", nargs="*", help="extra server overrides, e.g. +model=qwen3_tiny")
    args = ap.parse_args()
    warmup = args.warmup if args.warmup is not None else 0.2 * args.seconds
    if args.kv_slots:
        args.overrides = [f"kv_cache.num_slots_override={args.kv_slots}", *args.overrides]

    with tempfile.TemporaryDirectory() as run_dir:
        proc, address, http_address, log = start_server(args.overrides, run_dir)
        failures: list[str] = []
        try:
            client = ApplianceClient(address)
            vocab = load_runtime_config([*SERVER, *args.overrides]).model.layout.vocab_size
            tally = Tally()
            start = time.monotonic()
            deadline = start + args.seconds
            rss_start = rss_bytes(proc.pid)
            samples: list[tuple[float, int]] = []
            load_done = threading.Event()
            sampler = threading.Thread(target=sample_rss, args=(proc.pid, args.sample, load_done, start, samples),
                                       daemon=True)
            sampler.start()
            threads = [threading.Thread(target=client_loop, args=(address, http_address, i, deadline, vocab, tally,
                                                                  args.cancel, args.bad, args.http), daemon=True)
                       for i in range(args.clients)]
            for t in threads:
                t.start()
            time.sleep(min(warmup, args.seconds))
            rss_warm = rss_bytes(proc.pid)
            for t in threads:
                t.join(args.seconds + 900)
            load_done.set()
            load_s = time.monotonic() - start
            stats = wait_idle(client, IDLE_WAIT_S)
            rss_end = rss_bytes(proc.pid)
            client.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                status = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                status = proc.wait()

    growth = rss_end - rss_warm
    limit = min(args.rss_limit_mib * 2**20, 0.10 * rss_warm)
    used = {g.name: g.used_blocks for g in stats.cache_groups}
    if stats.num_requests_running or stats.num_requests_waiting:
        failures.append(f"engine not idle {IDLE_WAIT_S:g} s after the load: {stats.num_requests_running} running, "
                        f"{stats.num_requests_waiting} waiting")
    if any(used.values()):
        failures.append(f"blocks still used: {used}")
    if growth > limit:
        failures.append(f"RSS grew {growth / 2**20:.1f} MiB after the warm-up (limit {limit / 2**20:.1f} MiB)")
    if tally.unexpected:
        failures.append(f"{sum(v for k, v in tally.counts.items() if k in UNEXPECTED or k.endswith(' wrong'))}"
                        f" unexpected outcomes, e.g. {tally.unexpected[:3]}")
    if stats.num_preemptions == 0 and args.kv_slots:
        failures.append("no preemption happened (the soak is meant to cover it: a smaller KV cache?)")
    if tally.counts["completed"] == 0 or tally.counts["cancelled"] == 0:
        failures.append(f"the load did not run as meant: {dict(tally.counts)}")
    if status != 0:
        failures.append(f"SIGTERM exit status {status}")

    rows = [("load", f"{load_s:.0f} s, {args.clients} clients"),
            ("requests", ", ".join(f"{k} {v}" for k, v in sorted(tally.counts.items()))),
            ("tokens streamed", f"{tally.tokens} ({tally.tokens / load_s:.1f} tok/s)"),
            ("preemptions", str(stats.num_preemptions)),
            ("finished by reason", ", ".join(f"{k} {v}" for k, v in sorted(stats.requests_finished.items()))),
            ("used blocks at end", ", ".join(f"{k} {v}" for k, v in used.items())),
            ("RSS at start", f"{rss_start / 2**20:.1f} MiB"),
            ("RSS after warm-up", f"{rss_warm / 2**20:.1f} MiB (at {min(warmup, args.seconds):.0f} s)"),
            ("RSS at end", f"{rss_end / 2**20:.1f} MiB ({growth / 2**20:+.1f} MiB; limit {limit / 2**20:.1f} MiB)"),
            ("SIGTERM exit status", str(status)),
            ("verdict", "PASS" if not failures else "FAIL")]
    width = max(len(k) for k, _ in rows)
    print(f"\nsoak of {address} ({' '.join(SERVER + args.overrides)})")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    print("  RSS samples (s: MiB): " + ", ".join(f"{t:.0f}: {b / 2**20:.1f}" for t, b in samples))
    for f in failures:
        print(f"FAIL: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
