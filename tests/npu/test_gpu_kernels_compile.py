"""bench/compile_gpu_kernels.py: every Triton kernel the GPU path launches compiles for an H100 / H200 (sm_90) and
fits its shared memory, in every variant the shipped models launch, on this machine without a GPU; and the startup
profile's steps launch every variant that serving steps of other sizes take (no compile in a request's path).

The other kernel tests run the kernels in Triton's interpreter, which accepts what the compiler refuses; these run
the compiler (ptxas included) in a subprocess without TRITON_INTERPRET, which the suite sets for itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("triton")


def without_interpreter() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    return env


def jitted_and_launched() -> tuple[set[str], set[str]]:
    """Names of the @triton.jit functions under npu/, and of those launched with a grid (kernel[grid](...)); the
    rest are helpers the kernels call."""
    jitted, launched = set(), set()
    sources = [p.read_text() for p in (ROOT / "npu").rglob("*.py")]
    for text in sources:
        jitted |= set(re.findall(r"@triton\.jit[^\n]*(?:\n[^\n]*\))?\n\s*def (\w+)", text))
    for text in sources:
        launched |= {name for name in jitted if re.search(rf"\b{name}\[", text)}
    return jitted, launched


def test_every_kernel_compiles_for_sm90_in_every_variant_the_models_launch(tmp_path):
    out = tmp_path / "builds.json"
    proc = subprocess.run([sys.executable, "bench/compile_gpu_kernels.py", "--json", str(out)], cwd=ROOT,
                          env=without_interpreter(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    builds = report["builds"]
    assert not [b for b in builds if b["error"]]
    # the startup profile's steps (worst and least) build every variant: serving steps of other sizes compile nothing
    assert not [b for b in builds if b["model"].endswith("[serving]")]
    assert max(b["shared_bytes"] for b in builds) <= report["shared_limit"] == 232_448
    jitted, launched = jitted_and_launched()
    compiled = {b["kernel"] for b in builds}
    assert launched and launched <= compiled <= jitted, (launched - compiled, compiled - jitted)
    real = {b["kernel"] for b in builds if "layout" in b["model"] or "as released" in b["model"]}
    assert real == compiled                 # every kernel at the real widths too, not only the tiny models'
    assert all(b["registers"] > 0 for b in builds)     # the cubins were read


BROKEN = '''
import triton
import triton.language as tl

FLAG = 1            # a plain module global: the interpreter reads it, the compiler refuses it


@triton.jit
def reads_a_global(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    if FLAG == 1:
        tl.store(x_ptr + i, i.to(tl.float32), mask=i < n)


@triton.jit
def too_much_shared(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + i[:, None] * BLOCK + i[None, :])
    b = tl.load(b_ptr + i[:, None] * BLOCK + i[None, :])
    tl.store(c_ptr + i[:, None] * BLOCK + i[None, :], tl.dot(a, b))
'''

PROBE = '''
import json, sys, torch
sys.path.insert(0, "bench")
import broken
from compile_gpu_kernels import Compiler, failures
x = torch.empty(256 * 256)
compiler = Compiler(90)
with compiler.active():
    broken.reads_a_global[(1,)](x, 8, BLOCK=8)
    broken.too_much_shared[(1, 70_000)](x, x, x, BLOCK=256)
print(json.dumps(failures(list(compiler.builds.values()), 90, compiler.grid_errors)))
'''


def test_the_check_fails_on_what_only_a_gpu_compile_finds(tmp_path):
    """A kernel reading a non-constexpr module global runs in the interpreter and fails to compile here; a dot over
    256 x 256 float32 tiles compiles and is refused for its shared memory, and its grid of 70,000 on axis 1 for
    CUDA's limit (a launch on the GPU would fail either way)."""
    (tmp_path / "broken.py").write_text(textwrap.dedent(BROKEN))
    env = {**without_interpreter(), "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    interpreted = subprocess.run([sys.executable, "-c", "import torch, broken; x = torch.zeros(8); "
                                  "broken.reads_a_global[(1,)](x, 8, BLOCK=8); assert x[7] == 7"],
                                 env={**env, "TRITON_INTERPRET": "1"}, cwd=ROOT, capture_output=True, text=True,
                                 timeout=600)
    assert interpreted.returncode == 0, interpreted.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(found) == 3, found
    assert "too_much_shared" in found[0] and "axis 1: 70,000" in found[0]
    assert "reads_a_global" in found[1] and "FLAG" in found[1]
    assert "too_much_shared" in found[2] and "shared memory" in found[2]


WATCH = '''
import sys, torch
sys.path.insert(0, "bench")
from compile_gpu_kernels import Compiler
from npu import triton_runtime
from npu.deepseek_v4.activation_triton import clamped_swiglu_op
x = torch.zeros(4, 64)
with Compiler(90).active():
    clamped_swiglu_op(x, x, None)          # built during startup: not reported
    assert triton_runtime.watch_compiles()
    clamped_swiglu_op(x, x, None)          # the same variant: already built, nothing to report
    clamped_swiglu_op(x, x, 7.0)           # a variant startup did not build (CLAMP=True)
print("COUNT", triton_runtime.COMPILES_AFTER_STARTUP)
'''


def test_a_kernel_built_after_startup_is_logged_as_a_warning(tmp_path):
    """npu.triton_runtime.watch_compiles (the launcher's last step on an accelerator) through Triton's own JIT hooks:
    one warning for the one variant built after it, naming the kernel; make device-check's summary counts it."""
    proc = subprocess.run([sys.executable, "-c", WATCH], env=without_interpreter(), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split()[-2:] == ["COUNT", "1"]
    warnings = [line for line in proc.stderr.splitlines() if "after startup" in line]
    assert len(warnings) == 1 and "_clamped_swiglu" in warnings[0], proc.stderr[-2000:]
    (tmp_path / "a_line.log").write_text(proc.stderr)
    sys.path.insert(0, str(ROOT / "bench"))
    import device_check
    assert device_check.late_compiles(tmp_path) == [f"a_line.log: {warnings[0].strip()}"]
