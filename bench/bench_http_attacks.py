"""Health-check latency while HTTP clients attack the server: big bodies, trickled bodies, slow headers, idle sockets.

    python bench/bench_http_attacks.py                       # default model (dsv4_tiny) on this machine
    python bench/bench_http_attacks.py --seconds 10 --runs 3

Starts `python -m appliance` (as users do, with its default server.http_* limits) on 127.0.0.1 and, for
--seconds per phase, probes GET /health (a new connection per probe, as a load balancer does) and
grpc.health.v1 Check (one channel) from this process, while a separate attacker process runs one attack:
  idle           nothing else arrives;
  big-body       --senders connections each declare a 160 MB Content-Length and send the body as fast as the
                 server takes it, again and again (the limit answers 413 before reading);
  big-chunked    the same with a chunked body of 160 MB (no Content-Length: the limit counts while reading);
  trickle-body   100 connections declare 1,000 bytes and send one byte each 0.5 s;
  slow-headers   100 connections send their request line and headers one byte each 0.5 s;
  idle-sockets   1,000 connections opened and never written to (each one closed is opened again).
Prints p50 / p99 / max per phase and probe, the server's RSS growth during the phase, and what the attacker
saw (413s, connections closed or reset by the server, MB it managed to send).
--runs N (default 3) rounds of the phases, interleaved, on one server; every figure is the median [min-max].
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import os
import select
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from report import LoadWatch, add_runs_argument, interleave, spread  # noqa: E402

from appliance.client import ApplianceClient  # noqa: E402
from appliance.modes.bench import percentile  # noqa: E402

BIG = 160 * 1024 * 1024
CHUNK = b"x" * (1 << 20)


def start_server(overrides: list[str], run_dir: str) -> tuple[subprocess.Popen, str, int]:
    proc = subprocess.Popen([sys.executable, "-m", "appliance", *overrides, "server.port=0", "server.http_port=0",
                             f"hydra.run.dir={run_dir}"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    address, http_port = None, None
    for line in proc.stdout:
        if line.startswith("listening on "):
            address = line.split()[2]
        if line.startswith("http listening on "):
            http_port = int(line.split()[3].rsplit(":", 1)[1])
        if line.startswith("SERVING on "):
            break
    if address is None or http_port is None:
        raise SystemExit(f"the server did not start (exit {proc.poll()})")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()   # keep the pipe drained
    return proc, address, http_port


# -- attacks (in a separate process, so that they do not share this process's GIL with the probes) ------------

def headers(length: int | None) -> bytes:
    framing = "transfer-encoding: chunked" if length is None else f"content-length: {length}"
    return (f"POST /v1/completions HTTP/1.1\r\nhost: attacker\r\ncontent-type: application/json\r\n"
            f"{framing}\r\n\r\n").encode()


def big_body(port: int, stop, counts, chunked: bool) -> None:
    """Send 160 MB bodies until the server answers or closes; count the answers."""
    while not stop.is_set():
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.settimeout(60)
            sent, status = 0, "closed"
            try:
                sock.sendall(headers(None if chunked else BIG))
                while sent < BIG and not stop.is_set():
                    if readable(sock):
                        break
                    sock.sendall(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK) if chunked else CHUNK)
                    sent += len(CHUNK)
                reply = sock.recv(64)
                status = reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/") else "closed"
            except OSError as exc:
                status = f"closed ({type(exc).__name__})"
            counts[status] = counts.get(status, 0) + 1
            counts["MB sent"] = counts.get("MB sent", 0) + sent // (1 << 20)


def readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def slow_writers(port: int, stop, counts, n: int, payload: bytes, interval_s: float, ready) -> None:
    """n connections, each writing `payload` one byte per interval (reopened when the server closes one)."""
    sel = selectors.DefaultSelector()
    conns: dict[socket.socket, int] = {}

    def open_one() -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        conns[sock] = 0
        sel.register(sock, selectors.EVENT_READ)

    for _ in range(n):
        open_one()
    ready.set()
    while not stop.is_set():
        next_write = time.monotonic() + (interval_s or 0.5)      # idle sockets (no payload): only watch for closes
        for sock in list(conns):
            try:
                if conns[sock] < len(payload):
                    sock.send(payload[conns[sock]:conns[sock] + 1])
                    conns[sock] += 1
            except OSError:
                pass
        while time.monotonic() < next_write and not stop.is_set():
            for key, _ in sel.select(max(0.0, next_write - time.monotonic())):
                sock = key.fileobj
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if not data:                      # closed by the server: count it, open another
                    sel.unregister(sock)
                    sock.close()
                    del conns[sock]
                    counts["closed by server"] = counts.get("closed by server", 0) + 1
                    try:
                        open_one()
                    except OSError:
                        counts["connect failed"] = counts.get("connect failed", 0) + 1
    for sock in conns:
        sock.close()


def attacker(name: str, port: int, senders: int, stop, ready, results) -> None:
    """One attack until `stop`; `ready` once it is under way (the probes wait for it: this process starts slowly)."""
    counts: dict[str, int] = {}
    if name in ("big-body", "big-chunked"):
        threads = [threading.Thread(target=big_body, args=(port, stop, counts, name == "big-chunked"))
                   for _ in range(senders)]
        for t in threads:
            t.start()
        ready.set()
        for t in threads:
            t.join()
    elif name == "trickle-body":
        slow_writers(port, stop, counts, 100, headers(1000) + b"{" * 1000, 0.5, ready)
    elif name == "slow-headers":
        slow_writers(port, stop, counts, 100, b"GET /health HTTP/1.1\r\nhost: attacker\r\n" + b"x-pad: y\r\n" * 100, 0.5, ready)
    elif name == "idle-sockets":
        slow_writers(port, stop, counts, 1000, b"", 0.0, ready)
    results.put(counts)


# -- probes -----------------------------------------------------------------------------------------------------

def probe_http(port: int) -> float:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/health")
    status = conn.getresponse().status
    conn.close()
    assert status == 200, status
    return time.perf_counter() - t0


def rss_mib(pid: int) -> float:
    """Resident memory of the server process (Linux /proc), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def phase(name: str, address: str, port: int, seconds: float, senders: int, server_pid: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    stop, ready, results = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = None
    if name != "idle":
        proc = ctx.Process(target=attacker, args=(name, port, senders, stop, ready, results), daemon=True)
        proc.start()
        assert ready.wait(120), f"the {name} attacker did not start"
        time.sleep(1.0)                      # let the attack take hold before probing
    http_lat, grpc_lat, failures, rss = [], [], 0, [rss_mib(server_pid)]
    with ApplianceClient(address) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                http_lat.append(probe_http(port))
            except (OSError, AssertionError, http.client.HTTPException):
                failures += 1
            t0 = time.perf_counter()
            assert c.health(timeout=60) == "SERVING"
            grpc_lat.append(time.perf_counter() - t0)
            rss.append(rss_mib(server_pid))
            time.sleep(0.01)
    counts: dict[str, int] = {}
    if proc is not None:
        stop.set()
        counts = results.get(timeout=120)
        proc.join(60)
    ms = lambda xs, q: 1e3 * percentile(xs, q) if xs else float("nan")   # noqa: E731
    return {"probes": len(grpc_lat), "http_failures": failures,
            "http_p50": ms(http_lat, 50), "http_p99": ms(http_lat, 99), "http_max": 1e3 * max(http_lat or [0]),
            "grpc_p50": ms(grpc_lat, 50), "grpc_p99": ms(grpc_lat, 99), "grpc_max": 1e3 * max(grpc_lat),
            "rss_growth_mib": max(rss) - rss[0], "attacker": counts}


PHASES = ("idle", "big-body", "big-chunked", "trickle-body", "slow-headers", "idle-sockets")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", default=["device=cpu", "kv_cache.num_slots_override=16"])
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    ap.add_argument("--senders", type=int, default=2, help="connections sending big bodies back to back")
    ap.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of " + ", ".join(PHASES))
    add_runs_argument(ap)
    args = ap.parse_args()
    watch = LoadWatch()
    with tempfile.TemporaryDirectory() as run_dir:
        proc, address, port = start_server(args.overrides, run_dir)
        try:
            results = interleave(args.runs, {
                name: (lambda i, name=name: phase(name, address, port, args.seconds, args.senders, proc.pid))
                for name in args.phases.split(",")}, "bench_http_attacks")
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"{args.seconds:g} s per phase, {args.senders} big-body sender(s); server defaults for server.http_*")
    print(watch.header(args.runs))
    print("\n| attack | probes | /health p50 ms | /health p99 ms | /health max ms | gRPC health p50 ms | "
          "gRPC health p99 ms | gRPC max ms | /health failed | server RSS growth MiB | attacker saw (all rounds) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, rounds in results.items():
        seen: dict[str, int] = {}
        for r in rounds:
            for key, n in r["attacker"].items():
                seen[key] = seen.get(key, 0) + n
        cells = [spread([r[k] for r in rounds]) for k in ("http_p50", "http_p99", "http_max",
                                                         "grpc_p50", "grpc_p99", "grpc_max")]
        print(f"| {name} | {spread([r['probes'] for r in rounds], '{:,.0f}')} | " + " | ".join(cells) +
              f" | {sum(r['http_failures'] for r in rounds)} | {spread([r['rss_growth_mib'] for r in rounds])} | "
              f"{', '.join(f'{n:,} {k}' for k, n in sorted(seen.items())) or '-'} |")
    print(watch.footer())


if __name__ == "__main__":
    main()
