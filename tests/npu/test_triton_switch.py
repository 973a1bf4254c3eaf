"""APPLIANCE_TRITON_KERNELS=0 (npu/triton_runtime.py): every Triton kernel off, the torch ops in their place, on a
fake-CUDA runner of each arch (a fresh process: the switch is read at import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

PROBE = """
import json, torch
from npu import triton_runtime
from npu.deepseek_v4.norms_triton import norm_kernel_applies
from npu.deepseek_v4.hyper_triton import hyper_kernels_apply
from npu.deepseek_v4.rope_triton import rotation_kernel_applies
from npu.deepseek_v4.activation_triton import activation_kernel_applies
from tests.npu.test_device_guard import DSV4, QWEN3, fake_runner, serving_steps, step
qwen3, _ = fake_runner(QWEN3)
dsv4, _ = fake_runner(DSV4)
for runner in (qwen3, dsv4):
    for batch in serving_steps(runner):
        step(runner, batch)                      # the torch ops' path runs on the device alone too
cuda = torch.device("cuda")
print(json.dumps({"triton": triton_runtime.triton is not None, "qwen3_decode": qwen3.paged_decode is not None,
                  "qwen3_cached_prefill": qwen3.cached_prefill is not None, "dsv4_in_place": dsv4.attention.in_place,
                  "norms": norm_kernel_applies(cuda), "hyper": hyper_kernels_apply(cuda, 4),
                  "rope": rotation_kernel_applies(cuda), "swiglu": activation_kernel_applies(cuda),
                  "sinkhorn": dsv4.sinkhorn.__name__}))
"""


@pytest.mark.parametrize("switch", ["0", "1"])
def test_the_switch_turns_every_kernel_off_and_only_then(switch):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "APPLIANCE_TRITON_KERNELS": switch, "PYTHONPATH": str(root)}
    env.pop("TRITON_INTERPRET", None)             # as on a GPU host: the kernels apply to CUDA tensors
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    on = switch == "1"
    assert seen.pop("sinkhorn") == ("triton_sinkhorn" if on else "sinkhorn")
    assert seen == dict.fromkeys(seen, on)
