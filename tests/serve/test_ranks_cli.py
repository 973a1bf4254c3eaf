"""`python -m appliance` over two ranks, as users run it: spawned by the appliance (device.count=2) or started by
torchrun across two "hosts" on loopback; a rank that fails at startup ends the launch with exit 2 naming it;
SIGTERM stops every rank (their PIDs are gone afterwards). The spawned ranks are found among the server's
descendants: its children with the engine in its process, the engine core process's (server.engine_process=true)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from appliance.client import ApplianceClient
from appliance.config.compose import load_runtime_config
from tests.conftest import REPO
from tests.support.checkpoints import write_tiny_checkpoint

SERVE = ["+model=qwen3_tiny", "device=cpu", "device.count=2", "parallel.tensor_parallel_size=2", "max_model_len=128",
         "device.cpu_threads=1", "server.port=0", "server.http_port=null", "server.grace_period_s=5",
         "parallel.startup_timeout_s=120"]
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 61)), [300, 2, 77]]
MAX_TOKENS = 10


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:                    # a thread that ended meanwhile
            pass
    return found


def descendants(pid: int) -> list[int]:
    """Its children, their children, and so on (a process that ended meanwhile has none)."""
    found, todo = [], [pid]
    while todo:
        try:
            kids = children(todo.pop())
        except FileNotFoundError:
            continue
        found += kids
        todo += kids
    return found


def spawned_ranks(server: int) -> list[int]:
    """The rank processes a server spawned, wherever they are below it."""
    ranks = []
    for pid in descendants(server):
        try:
            if "npu.worker" in Path(f"/proc/{pid}/cmdline").read_text():
                ranks.append(pid)
        except FileNotFoundError:
            pass
    return ranks


def gone(pid: int) -> bool:
    """Exited (reaped, or a zombie no one waits for any more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


class Output:
    """A process's merged output, collected by a thread (so the pipe never fills)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        threading.Thread(target=lambda: self.lines.extend(proc.stdout), daemon=True).start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def address(self) -> str:
        wait_for(lambda: "SERVING on" in self.text or self.proc.poll() is not None, 300, "SERVING")
        assert self.proc.poll() is None, self.text[-3000:]
        return next(ln.split()[2] for ln in self.lines if ln.startswith("SERVING on"))


def greedy_tokens(address: str) -> list[list[int]]:
    with ApplianceClient(address) as client:
        return [client.complete(p, max_tokens=MAX_TOKENS, ignore_eos=True)[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """A device.count=2 server: its tokens, its rank processes while serving, then SIGTERM: exit status, output."""
    run = tmp_path_factory.mktemp("spawned")
    proc = subprocess.Popen([sys.executable, "-m", "appliance", *SERVE, f"hydra.run.dir={run}"], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Output(proc)
    try:
        tokens = greedy_tokens(out.address())
        ranks = spawned_ranks(proc.pid)
        below = descendants(proc.pid)            # the engine core process too, when it has one
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return {"tokens": tokens, "ranks": ranks, "below": below, "status": status, "output": out.text}


def test_sigterm_stops_every_rank(spawned):
    assert len(spawned["ranks"]) == 1, spawned["output"][-3000:]          # rank 1, spawned by the owner
    assert spawned["status"] == 0 and "stopped" in spawned["output"]
    wait_for(lambda: all(gone(pid) for pid in spawned["below"]), 30, "rank and core processes to exit")


def test_torchrun_across_two_nodes_serves_the_tokens_of_device_count_2(spawned, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
         str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "appliance", *SERVE,
         f"hydra.run.dir={tmp_path / f'node{node}'}"], cwd=REPO, env=env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = [Output(a) for a in agents]
    try:
        assert greedy_tokens(outputs[0].address()) == spawned["tokens"]
        ranks = [pid for agent in agents for pid in descendants(agent.pid)]
        owner = children(agents[0].pid)[0]
        os.kill(owner, signal.SIGTERM)                  # the owner drains, then stops rank 1
        assert [a.wait(120) for a in agents] == [0, 0], "\n".join(o.text[-2000:] for o in outputs)
        assert all(gone(pid) for pid in ranks)
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()


def test_a_rank_with_a_bad_shard_ends_the_launch_with_exit_2_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    rc = load_runtime_config(["+model=dsv4_tiny"])
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", rc.model, seed=5)
    state = load_file(ckpt / "model.safetensors")
    state["layers.1.ffn.experts.6.w1.weight"][0, 0] = float("nan")     # rank 1 holds experts 4-7 (EP 2)
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    proc = subprocess.run([sys.executable, "-m", "appliance", "+model=dsv4_tiny", f"model.weights={ckpt}", "device=cpu",
                           "device.count=2", "device.cpu_threads=1", "mode=bench", "parallel.startup_timeout_s=120",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = next(ln for ln in proc.stderr.splitlines() if ln.startswith("error:"))
    assert "rank 1 failed at startup (loading weights)" in error
    assert "layers.1.ffn.experts.6.w1.weight" in error and "NaN" in error
    assert "Traceback" not in proc.stderr
    spawned_pids = re.search(r"spawned ranks 1\.\.1: pids \[(\d+)\]", proc.stdout + proc.stderr)
    assert spawned_pids and gone(int(spawned_pids.group(1)))
