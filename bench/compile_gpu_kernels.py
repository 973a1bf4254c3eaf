"""Every Triton kernel of the GPU path compiled for a real GPU (sm_90: H100, H200), on a machine without one.

    python bench/compile_gpu_kernels.py                  # sm_90; the shipped models at real widths and the tiny ones
    python bench/compile_gpu_kernels.py --arch 100       # another target's limits
    python bench/compile_gpu_kernels.py --json out.json  # the builds, for tests/npu/test_gpu_kernels_compile.py

Why: the tests run the kernels in Triton's interpreter, which executes their Python bodies with numpy and accepts
what the compiler refuses: a module global that is not a `tl.constexpr` (the CSA indexer kernel read one, found
by this check: on a GPU its first launch would have failed), a tile past the shared memory of a block, a dtype the
target lacks. A GPU run is rare and short here (make device-check), so the kernels are compiled before it.

How: the runners' device halves run on fake CUDA (tests/support/fake_cuda, as the device guard's tests run them),
with the `appliance::` custom ops' fake implementations swapped for their real ones, so each op computes its
launch from the real shapes and strides. Each Triton launch is then compiled, not run: Triton's own JIT path (its
binder specializes every argument as on a GPU: dtype, 16-byte alignment, ints equal to 1 or divisible by 16)
against a driver that names the target; ptxas makes the cubin, and cuobjdump reads its registers, spilled bytes
(local memory) and stack. A launch with fake tensors gets stand-ins on the host with the same dtype and alignment
(nothing runs, so their size does not matter). Models: the Qwen3-8B layout and DeepSeek V4 at its real widths
(6 layers, FP8 linears and FP4 experts as released), as make device-check runs them, and the device guard's tiny
models (float32, and DeepSeek V4 with quantized weights at tiny widths). Steps: first those the startup profile runs
(npu/launcher.py: the worst and the least of appliance.core.step_limits), then serving steps of other sizes. It fails
(exit 1) on a kernel that does not compile, needs more shared memory than the target gives a block, or is first built
by a serving step (on a GPU, a compile that request waits for), and on a launch grid past CUDA's limits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_gpu_kernels: unset TRITON_INTERPRET (the interpreter runs kernels, this compiles them)")

import torch  # noqa: E402
import triton  # noqa: E402
from torch._library.custom_ops import OPDEFS  # noqa: E402
from torch._subclasses.fake_tensor import unset_fake_temporarily  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver as triton_driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from appliance.core.step_limits import least_steps, step_limits, worst_steps  # noqa: E402
from npu.step import SeqStep, StepBatch  # noqa: E402
from tests.npu.test_device_guard import (  # noqa: E402
    DSV4,
    DSV4_QUANTIZED,
    QWEN3,
    fake_runner,
    serving_steps,
    step,
    tables,
)

# Shared memory a block may use (the opt-in maximum, bytes), by compute capability.
SHARED_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 100: 232_448}
GPU_NAMES = {80: "A100", 86: "RTX 30xx / A10", 89: "L4 / L40 / RTX 40xx", 90: "H100 / H200", 100: "B200"}

REAL = {
    "qwen3 (8B layout)": ["+model=qwen3", "max_model_len=1024", "max_num_seqs=64", "decode_batch=64",
                          "max_num_batched_tokens=4096"],
    "dsv4 (6 layers, as released)": ["+model=dsv4", "model.layout.num_layers=6",
                                     "model.layout.compress_ratios=[0,0,4,128,4,128,0]", "max_model_len=1024",
                                     "max_num_seqs=64", "decode_batch=64", "max_num_batched_tokens=4096"],
}
TINY = {"qwen3_tiny": QWEN3, "dsv4_tiny": DSV4, "dsv4_tiny (fp8 linears, fp4 experts)": DSV4_QUANTIZED}


@dataclass(frozen=True)
class Build:
    """One compiled variant of a kernel (or the error that stopped it), with what the cubin needs per thread and
    block."""
    kernel: str
    model: str            # the first model that launched this variant, and when: "[startup]" or "[serving]"
    variant: str          # its specialization: argument types and alignment, constexpr values
    seconds: float        # compile time (0 when Triton's cache had it)
    warps: int = 0
    shared_bytes: int = 0
    registers: int = 0
    spilled_bytes: int = 0
    stack_bytes: int = 0
    error: str | None = None


class TargetDriver:
    """The part of a Triton driver its JIT path asks before it compiles: which device, stream and target."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cuda", 0)


def stand_in(arg: Any) -> Any:
    """A fake tensor as a host tensor of its dtype whose address has the same alignment mod 16 (what Triton
    specializes on); anything else as it is."""
    if not isinstance(arg, torch.Tensor):
        return arg
    with unset_fake_temporarily():
        offset = arg.storage_offset() * arg.element_size() % 16
        base = torch.empty(64 + 32, dtype=torch.uint8)
        skip = -base.data_ptr() % 64 + offset
        return base[skip:skip + 32].view(arg.dtype)


def resources(cubin: bytes) -> dict[str, int]:
    """REG, LOCAL (spilled bytes) and STACK of the cubin's one function, as cuobjdump reports them."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    line = next(x for x in text.splitlines() if "REG:" in x)
    fields = dict(part.split(":", 1) for part in line.split() if ":" in part)
    return {"registers": int(fields["REG"]), "spilled_bytes": int(fields["LOCAL"]), "stack_bytes": int(fields["STACK"])}


class Compiler:
    """Compiles every Triton launch made inside `active()` for `target` instead of running it."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)
        self.model = ""
        self.builds: dict[tuple[str, str], Build] = {}
        self.grid_errors: list[str] = []

    @contextmanager
    def active(self) -> Iterator[None]:
        launch = JITFunction.run
        compiler = self

        def compile_instead(kernel: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            compiler.check_grid(kernel.fn.__name__, grid)
            compiler.compile(launch, kernel, [stand_in(a) for a in args], {k: stand_in(v) for k, v in kwargs.items()})

        # the ops' real implementations under fake tensors: they size their launch from real shapes and strides
        # (torch's CustomOpDef keeps both as attributes: internals a bench tool may use, pinned by its test)
        ops = {name: op for name, op in OPDEFS.items() if name.startswith("appliance::") and op._abstract_fn}
        fakes = {name: op._abstract_fn for name, op in ops.items()}
        triton_driver.set_active(TargetDriver(self.target))
        JITFunction.run = compile_instead  # type: ignore[method-assign]
        for op in ops.values():
            op._abstract_fn = op._init_fn
        try:
            yield
        finally:
            JITFunction.run = launch  # type: ignore[method-assign]   (the target's driver stays: there is no other)
            for name, op in ops.items():
                op._abstract_fn = fakes[name]

    def check_grid(self, name: str, grid: Any) -> None:
        """A launch grid past CUDA's limits (x < 2^31, y and z <= 65,535) fails on the GPU, not in the interpreter."""
        dims = tuple(grid) if isinstance(grid, (tuple, list)) else ()
        if any(not isinstance(d, int) for d in dims):
            return                                  # a grid function of the launch's meta-parameters: not checked
        over = [f"axis {i}: {d:,}" for i, d in enumerate(dims) if d > (2**31 - 1 if i == 0 else 65_535)]
        if over:
            self.grid_errors.append(f"{name} ({self.model}): grid {dims} past CUDA's limit ({', '.join(over)})")

    def compile(self, launch: Any, kernel: JITFunction, args: list, kwargs: dict) -> None:
        name = kernel.fn.__name__
        _, _, _, _, binder = kernel.device_caches[0]
        _, specialization, _ = binder(*args, **kwargs)
        variant = ", ".join(describe(param.name, *spec) for param, spec in zip(kernel.params, specialization))
        if (name, variant) in self.builds:
            return
        started = time.perf_counter()
        try:
            compiled = launch(kernel, *args, grid=(1,), warmup=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - every compile error is a finding, reported with the kernel's name
            lines = [x for x in str(e).splitlines() if x.strip()]
            self.builds[name, variant] = Build(name, self.model, variant, 0.0,
                                               error=f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400])
            return
        self.builds[name, variant] = Build(name, self.model, variant, round(time.perf_counter() - started, 2),
                                           compiled.metadata.num_warps, compiled.metadata.shared,
                                           **resources(compiled.asm["cubin"]))


def describe(name: str, kind: str, value: Any) -> str:
    """One argument of a variant: NAME=value for a constexpr, else name:type and Triton's specialization of it
    (D: divisible by 16, the address or value)."""
    if kind == "constexpr":
        return f"{name}={value}"
    return f"{name}:{kind}{':' + value if isinstance(value, str) and value else ''}"


def more_serving_steps(runner: Any, decode_batch: int) -> list[StepBatch]:
    """Sizes the device guard's serving steps do not take: a 5-token prompt, a 7-token chunk after 16 cached tokens,
    and decode steps of 1, 3 and 17 rows (at most decode_batch)."""
    rows = [(f"r{i}", tables(runner, 2 * i, 128)) for i in range(17)]
    steps = [StepBatch([SeqStep("r0", list(range(3, 8)), 0, rows[0][1], prompt_len=5)]),
             StepBatch([SeqStep("r1", list(range(3, 10)), 16, rows[1][1], prompt_len=23)])]
    for n in sorted({min(n, decode_batch) for n in (1, 3, 17)}):
        steps.append(StepBatch([SeqStep(rid, [7 + i], 40 + i, t) for i, (rid, t) in enumerate(rows[:n])]))
    return steps


def run_models(compiler: Compiler, models: dict[str, list[str]]) -> None:
    """Each model on fake CUDA, compiling what it launches: first the startup profile's steps (the worst and the
    least, as npu.launcher runs them), then serving steps of other sizes, whose variants must all be built by then
    (a variant first met while serving is a compile in a request's path on a GPU)."""
    for label, overrides in models.items():
        started = time.perf_counter()
        with compiler.active():
            compiler.model = f"{label} [startup]"
            runner, rc = fake_runner(overrides)
            limits = step_limits(rc)
            for shape in (*worst_steps(limits), *least_steps(limits)):
                step(runner, runner.scratch_batch(shape))
            compiler.model = f"{label} [serving]"
            for batch in (*serving_steps(runner), *more_serving_steps(runner, limits.max_decode_rows)):
                step(runner, batch)
        print(f"{label}: {time.perf_counter() - started:.1f} s", file=sys.stderr)


def failures(builds: list[Build], arch: int, grid_errors: Sequence[str] = ()) -> list[str]:
    """The variants that did not compile, need more shared memory than a block of the target has or were first
    built by a serving step; and the launches whose grid is past CUDA's limits."""
    limit = SHARED_LIMIT[arch]
    found = list(grid_errors)
    for b in builds:
        if b.error:
            found.append(f"{b.kernel} ({b.model}): {b.error}\n    {b.variant}")
        elif b.shared_bytes > limit:
            found.append(f"{b.kernel} ({b.model}): {b.shared_bytes:,} bytes of shared memory, the block limit is "
                         f"{limit:,}\n    {b.variant}")
        elif b.model.endswith("[serving]"):
            found.append(f"{b.kernel} ({b.model}): first compiled while serving, not at startup\n    {b.variant}")
    return found


def report(builds: list[Build], arch: int, grid_errors: Sequence[str] = ()) -> list[str]:
    """A table per kernel (variants, the most shared memory, registers and spills of any) and the failures."""
    limit = SHARED_LIMIT[arch]
    lines = [f"Triton kernels compiled for sm_{arch} ({GPU_NAMES.get(arch, '?')}; shared memory per block at most "
             f"{limit:,} bytes), triton {triton.__version__}\n",
             "| kernel | variants | most shared bytes | most registers | spilled bytes | compile s | models |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name in sorted({b.kernel for b in builds}):
        ok = [b for b in builds if b.kernel == name and b.error is None]
        failed = [b for b in builds if b.kernel == name and b.error is not None]
        models = sorted({b.model for b in ok + failed})
        if ok:
            lines.append(f"| {name} | {len(ok)}{f' (+{len(failed)} failed)' if failed else ''} | "
                         f"{max(b.shared_bytes for b in ok):,} | {max(b.registers for b in ok)} | "
                         f"{max(b.spilled_bytes for b in ok)} | {sum(b.seconds for b in ok):.1f} | "
                         f"{'; '.join(models)} |")
        else:
            lines.append(f"| {name} | 0 (+{len(failed)} failed) | - | - | - | - | {'; '.join(models)} |")
    problems = failures(builds, arch, grid_errors)
    lines += ["", *(["Failures:", *problems] if problems else ["Every variant compiled and fits."])]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT),
                    help="compute capability of the target (90: H100, H200)")
    ap.add_argument("--tiny-only", action="store_true", help="only the tiny models (seconds, not a minute)")
    ap.add_argument("--json", type=Path, help="also write the builds here")
    a = ap.parse_args()
    torch.manual_seed(0)
    compiler = Compiler(a.arch)
    run_models(compiler, TINY if a.tiny_only else {**REAL, **TINY})
    builds = list(compiler.builds.values())
    print("\n".join(report(builds, a.arch, compiler.grid_errors)))
    if a.json:
        a.json.write_text(json.dumps({"arch": a.arch, "shared_limit": SHARED_LIMIT[a.arch],
                                      "grid_errors": compiler.grid_errors, "builds": [asdict(b) for b in builds]},
                                     indent=1))
    return 1 if failures(builds, a.arch, compiler.grid_errors) else 0


if __name__ == "__main__":
    sys.exit(main())
