"""The startup error contract, as an operator meets it on the command line: every startup fault is one message
naming the file, key or device and the fix, exit status 2, no traceback; the checks that need no device run
before the port is bound; and a model that cannot fit fails at once, before any weight exists."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.errors import CheckpointError, StartupError
from appliance.core.planner import InsufficientMemoryError
from appliance.engine.engine import Engine
from appliance.engine.preflight import preflight
from npu.backends import CpuBackend
from tests.conftest import REPO
from tests.support.checkpoints import write_tiny_checkpoint

HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None
GiB = 1 << 30
HANG_S = 300          # only catches a hang; the 3 s target is for a quiet machine and is not asserted


# Runs the command and reports its exit status and peak RSS from os.wait4. A separate small process, because
# Linux counts in a child's ru_maxrss the memory of the process it was forked from (here: pytest).
MEASURE = """
import os, subprocess, sys, threading
hang_s, report, *command = sys.argv[1:]
proc = subprocess.Popen(command)
killer = threading.Timer(float(hang_s), proc.kill)
killer.start()
_, status, usage = os.wait4(proc.pid, 0)
killer.cancel()
with open(report, "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss * 1024}")   # Linux reports kB
"""


def run_measured(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[int, str, str, int]:
    """`python -m appliance ARGS` as an operator runs it: (exit status, stdout, stderr, peak RSS in bytes of
    that process alone, from its own resource usage)."""
    full_env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | (env or {})
    report = tmp_path / "measured.txt"
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(HANG_S), str(report), sys.executable, "-m", "appliance",
                           *args, f"hydra.run.dir={tmp_path}/run"],
                          capture_output=True, text=True, cwd=REPO, env=full_env, timeout=HANG_S + 60, check=False)
    assert proc.returncode == 0, proc.stderr
    status, peak_rss = map(int, report.read_text().split())
    assert status != -9, f"killed after {HANG_S} s: a hang"
    return status, proc.stdout, proc.stderr, peak_rss


@pytest.fixture
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def assert_startup_fault(rc: int, stdout: str, stderr: str, *words: str) -> None:
    assert rc == 2, stdout + stderr
    assert "Traceback" not in stdout + stderr
    assert stderr.startswith("error: ") and "Fix:" in stderr, stderr
    assert "listening on" not in stdout, "the port was bound before the fault was found"
    for w in words:
        assert w in stderr, stderr


def test_the_headline_model_on_a_small_host_fails_at_once_without_loading(tmp_path):
    rc, stdout, stderr, peak_rss = run_measured(tmp_path, "+model=dsv4", "npu_memory_utilization=0.85")
    assert_startup_fault(rc, stdout, stderr, "deepseek-v4-flash does not fit on device ", "nothing was loaded",
                         "total x npu_memory_utilization", " x 0.85 = ", "estimated weights", "shortfall",
                         "Fix: serve it on devices with at least")
    assert "device=auto chose " in stdout                         # which device, and why, before loading
    assert peak_rss < GiB, f"peak RSS {peak_rss:,} B: weights were materialized"
    if not (HAS_TORCH_NPU or torch.cuda.is_available()):
        assert "device cpu:0 (device=auto found no NPU or GPU" in stderr and "1,073,741,824 B (1.00 GiB)" in stderr


def test_a_bad_checkpoint_is_found_before_the_port_is_bound(tmp_path, busy_port):
    model = load_runtime_config(["+model=qwen3_tiny"]).model
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", model, seed=0)
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    rc, stdout, stderr, _ = run_measured(tmp_path, "+model=qwen3_tiny", f"model.weights={ckpt}",
                                         f"server.port={busy_port}", "server.http_port=null")
    assert_startup_fault(rc, stdout, stderr, f"checkpoint file '{ckpt / 'model.safetensors'}'")


def test_an_eos_token_id_outside_the_vocabulary_is_found_before_the_port_is_bound(tmp_path, busy_port):
    """Issue 32 item 6: it was accepted, and every request then served empty text."""
    model = load_runtime_config(["+model=qwen3_tiny"]).model
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", model, seed=0)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "eos_token_id": 99999}))
    rc, stdout, stderr, _ = run_measured(tmp_path, "+model=qwen3_tiny", f"model.weights={ckpt}",
                                         f"server.port={busy_port}", "server.http_port=null")
    assert_startup_fault(rc, stdout, stderr, f"checkpoint file '{ckpt / 'config.json'}': eos_token_id=99999 is not "
                                             f"a token id in the vocabulary [0, 512)")


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_bench_runs_the_preflight_too_a_missing_backend_exits_2(tmp_path):
    rc, stdout, stderr, _ = run_measured(tmp_path, "mode=bench", "device=npu")
    assert_startup_fault(rc, stdout, stderr, "device.kind=npu needs torch_npu", "pip install '.[npu]'")


def test_a_busy_port_exits_2_suggesting_server_port(tmp_path, busy_port):
    rc, _, stderr, _ = run_measured(tmp_path, "device=cpu", f"server.port={busy_port}", "server.http_port=null")
    assert rc == 2 and "Traceback" not in stderr
    assert f"error: cannot listen on server.host=127.0.0.1 server.port={busy_port}: the port is in use" in stderr
    assert f"server.port={busy_port + 1}" in stderr
    assert "add_port" not in stderr                               # no raw gRPC C-core line


@pytest.mark.skipif(torch.cuda.is_available(), reason="cuda is available here")
def test_hydra_full_error_adds_the_traceback_and_keeps_exit_2(tmp_path, busy_port):
    rc, stdout, stderr, _ = run_measured(tmp_path, "device=cuda", f"server.port={busy_port}", "server.http_port=null",
                                         env={"HYDRA_FULL_ERROR": "1"})
    assert rc == 2
    assert "Traceback" in stderr and "BackendUnavailableError: device.kind=cuda but torch.cuda.is_available()" in stderr
    assert "listening on" not in stdout


# -- in process: what the preflight returns, and that the engine starts from it --------------------------

def test_preflight_opens_the_backend_once_and_the_engine_starts_from_it():
    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", f"device.memory_bytes_per_device={256 << 20}"])
    engine = Engine(rc)
    checked = engine.prepare()
    assert engine.prepare() is checked                            # run once (serve calls it before binding)
    assert isinstance(checked.backend, CpuBackend) and checked.tokenizer.vocab_size == rc.model.layout.vocab_size
    assert checked.runner.pools == {} and checked.runner.weight_tensors() == []   # built, nothing loaded yet
    try:
        report = engine.start()
        assert engine.tokenizer is checked.tokenizer and report.device_kind == "cpu"
        assert checked.runner.weight_tensors() and checked.runner.pools        # the engine started that runner
    finally:
        engine.shutdown()


def test_preflight_refuses_a_model_that_cannot_fit_and_a_bad_checkpoint(tmp_path):
    with pytest.raises(InsufficientMemoryError, match="nothing was loaded"):
        preflight(load_runtime_config(["+model=qwen3", "device=cpu"]))          # 15 GiB of weights, 1 GiB budget
    with pytest.raises(CheckpointError, match="does not exist"):
        Engine(load_runtime_config(["+model=qwen3_tiny", f"model.weights={tmp_path / 'nope'}"])).start()


def test_misshapen_tensors_are_found_from_the_headers_before_loading(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path, load_runtime_config(["+model=qwen3_tiny"]).model, seed=0)
    config = json.loads((ckpt / "config.json").read_text())
    del config["intermediate_size"]                                # the file no longer says what it holds
    (ckpt / "config.json").write_text(json.dumps(config))
    rc = load_runtime_config(["+model=qwen3_tiny", f"model.weights={ckpt}", "model.layout.intermediate_size=96"])
    with pytest.raises(CheckpointError) as err:
        preflight(rc)
    assert "0 missing, 0 unexpected, 6 misshapen" in str(err.value)
    assert "misshapen  model.layers.0.mlp.up_proj.weight: expected shape [96, 64], found [128, 64]" in str(err.value)


@pytest.mark.parametrize("file, change, words", [
    ("config.json", {"bos_token_id": -5}, "config.json': bos_token_id=-5 is not a token id in the vocabulary"),
    ("generation_config.json", {"eos_token_id": [1, 512]},
     "generation_config.json': eos_token_id=[1, 512] is not a token id in the vocabulary [0, 512)"),
    ("config.json", '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested more than 64 deep"),
    ("config.json", '{"x": ' + "7" * 5000 + "}", "a number of 5,000 digits in a row"),
], ids=["bos negative", "eos list past the vocabulary", "nested", "digits"])
def test_checkpoint_configs_are_read_within_bounds_and_their_token_ids_checked(tmp_path, file, change, words):
    """A model YAML serving a checkpoint reads its config files too: each fault is a startup error naming the file."""
    ckpt = write_tiny_checkpoint(tmp_path, load_runtime_config(["+model=qwen3_tiny"]).model, seed=0)
    path = ckpt / file
    if isinstance(change, dict):
        path.write_text(json.dumps({**(json.loads(path.read_text()) if path.is_file() else {}), **change}))
    else:
        path.write_text(change)
    with pytest.raises(StartupError) as info:
        preflight(load_runtime_config(["+model=qwen3_tiny", f"model.weights={ckpt}"]))
    assert words in str(info.value) and "Fix:" in str(info.value)
