"""bench/ab_decode_attention.py on a tiny Qwen3 checkpoint: two builds of kernel sources, run in turn inside the same
runner's decode steps, each reported with its step, its attention per step and per call and how many calls its steps
made (one per layer), and (--repeat) the call repeated over cached rows; a build given without its source is refused
with the form it takes. No figure is compared with another: they are times on a machine that may be busy."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from appliance.config.compose import load_runtime_config
from tests.conftest import REPO
from tests.support.checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler: no kernel builds to compare")


def test_each_build_gets_its_steps_and_its_calls(tmp_path):
    model = load_runtime_config(["+model=qwen3_tiny"]).model
    write_tiny_checkpoint(tmp_path / "ckpt", model, seed=0)
    source = REPO / "npu" / "kernels" / "paged_attention.cpp"
    steps = 3
    run = subprocess.run([sys.executable, "bench/ab_decode_attention.py", "--model", str(tmp_path / "ckpt"),
                          "--batch", "4", "--context", "20", "--steps", str(steps), "--threads", "1", "--repeat",
                          f"one={source}", f"two={source}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    for label in ("one", "two"):
        step = re.search(rf"^{label}: step median ([\d.]+) ms; attention ([\d.]+) ms per step, ([\d.]+) ms per layer "
                         rf"call \(median of (\d+) calls in (\d+) steps\)", run.stdout, re.M)
        assert step is not None, run.stdout
        assert float(step.group(1)) > 0 and float(step.group(2)) > 0 and float(step.group(3)) > 0
        assert (int(step.group(4)), int(step.group(5))) == (steps * model.layout.num_layers, steps)   # one per layer
        assert re.search(rf"^{label}: one layer call repeated, rows in cache: [\d.]+ ms", run.stdout, re.M)
    assert f"batch 4 x 20-{20 + 2 * steps} tokens" in run.stdout        # one token more per step, builds in turn


def test_a_build_without_its_source_is_refused():
    run = subprocess.run([sys.executable, "bench/ab_decode_attention.py", "--model", "unused", "only-a-label"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "LABEL=SOURCE" in run.stderr
