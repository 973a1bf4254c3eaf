"""Triton for the device kernels: the one import every kernel module shares, and the switch that turns them off.

The GPU's own kernels (paged decode and prefill attention, the grouped GEMM, DeepSeek V4's RoPE, Sinkhorn, norms,
hyper-connection and attention kernels) are Triton programs. Each module imports `triton` from here and checks it
before it applies: `triton` is None where Triton is not installed, or where APPLIANCE_TRITON_KERNELS=0 asks for the
torch ops instead (gather + SDPA, dequantize + torch._grouped_mm, the torch ops a CPU runs; Qwen3's decode graphs
need the paged kernel, so they are off too): a way to tell a kernel's fault from the rest when a device run
disagrees, as APPLIANCE_CPU_KERNELS=0 is for the CPU kernels.

INTERPRETED: Triton's CPU interpreter is on (TRITON_INTERPRET=1; the tests set it where there is no GPU), so the
kernels run on CPU tensors with numpy's semantics.

watch_compiles: from the end of startup on, each kernel variant Triton builds is logged as a warning with its compile
time: the startup profile launches every step size (npu/launcher.py), so a later build is one a request waited for.

rounded_as: the kernels' one rounding helper, float32 rounded as torch stores a tensor of the compute dtype (bfloat16:
to nearest even by the bits, which torch's cast does and the interpreter's own cast does not) and read back;
e4m3_values: float8 e4m3 bytes decoded by integer ops, so the FP8 readers compile for GPUs without float8 (sm_80).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

log = logging.getLogger("npu.triton_runtime")

SWITCH = "APPLIANCE_TRITON_KERNELS"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

try:
    import triton
except ImportError:  # pragma: no cover - a host without Triton runs the torch ops
    triton = None

if triton is not None and os.environ.get(SWITCH, "1") == "0":
    log.info("%s=0: the Triton kernels are off; the torch ops run in their place", SWITCH)
    triton = None

COMPILES_AFTER_STARTUP = 0      # variants built since watch_compiles(); the tests read it


def watch_compiles() -> bool:
    """Log a warning for each kernel variant Triton builds from now on, with its name and compile time (Triton's
    JIT hooks, which run where a variant is not yet in this process's cache). False where Triton is off or too old
    to have the hooks (before 3.4)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return False
    started: dict[str, float] = {}

    # Triton calls its hooks with keywords (key, fn, ...; the set varies by version): read what is there, never raise
    # (a hook's error would fail the compile, and with it the step)
    def before(*_: Any, **info: Any) -> None:      # None: Triton compiles as usual (True would skip it)
        started[str(info.get("key"))] = time.perf_counter()

    def after(*_: Any, **info: Any) -> None:
        global COMPILES_AFTER_STARTUP
        COMPILES_AFTER_STARTUP += 1
        seconds = time.perf_counter() - started.pop(str(info.get("key")), time.perf_counter())
        fn = info.get("fn")
        log.warning("Triton built a variant of %s after startup (%.2f s, a step waited for it): the startup "
                    "profile's steps did not launch this one (bench/compile_gpu_kernels.py lists them)",
                    getattr(fn, "name", fn), seconds)

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after
    return True


e4m3_values: Any = None
rounded_as: Any = None    # defined below where Triton is on; kernel modules call it only inside their `triton` guard

if triton is not None:
    import triton.language as tl

    @triton.jit  # type: ignore[no-redef]
    def rounded_as(y, BF16: tl.constexpr):
        """float32 y as torch would store it in the compute dtype, read back as float32: bfloat16 rounded to nearest
        even by the bits (NaN is not expected here); float32 unchanged."""
        if BF16:
            bits = y.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        return y

    @triton.jit
    def e4m3_values(bits):
        """float8 e4m3fn codes (int32, 0..255) as float32 by integer ops: the hardware's float8 type needs sm_89, and
        an A100 (sm_80) has none. NaN codes decode as +-480 (quantized weights and index rows hold none)."""
        exponent = (bits >> 3) & 15
        mantissa = (bits & 7).to(tl.float32)
        power = ((exponent + 117) << 23).to(tl.float32, bitcast=True)          # 2 ** (exponent - 10), exactly
        magnitude = tl.where(exponent == 0, mantissa * 0.001953125, (8.0 + mantissa) * power)   # subnormal: m 2^-9
        # the sign as float32's sign bit, not by negation: -0.0 for code 0x80 (Triton 3.6 negates as 0 - x, +0.0)
        sign = (bits & 128) << 24
        return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
