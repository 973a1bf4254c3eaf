"""The project's compiled CPU kernels (npu/kernels/*.cpp): built on the host, cached, loaded with ctypes.

What is in it: paged decode attention (npu.paged_attention_cpu), the fused elementwise parts of a layer
(npu.fused_norms) and DeepSeek V4's Sinkhorn normalization (npu.deepseek_v4.sinkhorn_cpu). They are plain C++
with OpenMP and no torch headers, so a build takes about 1 s (the sources compile side by side) and needs only a
C++ compiler, not a torch extension toolchain; tensors are passed as data pointers.

How it is built: every source with g++ -O3 -march=native -ffast-math -fopenmp (EXACT_SOURCES then with
-fno-fast-math: their results are torch's to the bit), then linked into one shared
library *without* -ffast-math: GCC before 13 links crtfastmath.o into a -ffast-math shared library, whose
constructor turns on flush-to-zero for the whole process as it loads (torch's float32 math would change).
Once per sources, compiler and CPU, into a cache directory (APPLIANCE_KERNEL_CACHE, else
$XDG_CACHE_HOME/appliance/kernels, else ~/.cache/appliance/kernels), written under a temporary name and
renamed, so concurrent starts are safe. `make install` builds it ahead (`python -m npu.cpu_kernels`), so a
start never waits for the compiler; without a cached build the first start compiles it.

Threads: the library links libgomp.so.1, which resolves to the copy torch has already loaded, so its
parallel loops run on torch's OpenMP pool (two pools on two cores slow every op, docs/ARCHITECTURE.md), with
torch.get_num_threads() threads. APPLIANCE_CPU_KERNELS=0 turns every kernel off (torch ops instead).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("npu.cpu_kernels")

KERNELS = Path(__file__).with_name("kernels")
SOURCES = tuple(sorted(KERNELS.glob("*.cpp")))
HEADERS = tuple(sorted(KERNELS.glob("*.h")))     # included by the sources: part of the cache key
COMPILE_FLAGS = ("-std=c++17", "-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp",
                 "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp")
EXACT_SOURCES = ("sinkhorn.cpp",)        # also -fno-fast-math: results to the bit of torch's ops (the file says why)
SWITCH = "APPLIANCE_CPU_KERNELS"        # "0": torch ops everywhere
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}   # the dtypes every kernel has an entry point for

_loaded: dict[str, ctypes.CDLL | str] = {}   # library path -> the loaded library, or why it could not load
_built: dict[tuple[str, Path], Path] = {}     # (compiler, cache dir) -> the library path, found once per process


def cache_dir() -> Path:
    if os.environ.get("APPLIANCE_KERNEL_CACHE"):
        return Path(os.environ["APPLIANCE_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "appliance" / "kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native builds for them), so a cache shared by two hosts stays right."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path(compiler: str) -> Path:
    """Where the build for these sources, this compiler and this CPU lives in the cache."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    parts = [s.read_text() for s in SOURCES + HEADERS]
    parts += [compiler, version, " ".join(COMPILE_FLAGS + LINK_FLAGS), " ".join(EXACT_SOURCES), _cpu_flags()]
    return cache_dir() / f"appliance_kernels-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}.so"


def _run_all(commands: dict[str, list[str]]) -> None:
    """Run the commands at once (one compiler per source: the build takes as long as the largest source),
    then raise RuntimeError with what the first failing one said."""
    running = {what: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for what, cmd in commands.items()}
    failed = []
    for what, proc in running.items():
        said = proc.communicate()[0]
        if proc.returncode != 0:
            failed.append(f"{commands[what][0]} failed on {what} (exit {proc.returncode}): {said.strip()[-2000:]}")
    if failed:
        raise RuntimeError(failed[0])


def find_compiler() -> str:
    """$CXX, else g++ or c++ on PATH; RuntimeError when there is none."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    return compiler


def build() -> Path:
    """The compiled library's path, compiling it first when the cache has none. Raises RuntimeError naming
    what is missing (the compiler, a writable cache directory) or what the compiler said."""
    compiler = find_compiler()
    key = (compiler, cache_dir())
    try:
        if key not in _built or not _built[key].exists():   # each runner asks twice (attention, norms)
            _built[key] = _build(compiler)
        return _built[key]
    except OSError as e:            # a compiler path that does not run, a cache directory not writable
        raise RuntimeError(f"cannot build the CPU kernels with {compiler} into {cache_dir()}: {e}") from e


def compile_flags(source: Path) -> tuple[str, ...]:
    """COMPILE_FLAGS, and -fno-fast-math after them for a source whose results must be exactly torch's."""
    return COMPILE_FLAGS + (("-fno-fast-math",) if source.name in EXACT_SOURCES else ())


def _build(compiler: str) -> Path:
    path = library_path(compiler)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        objects = {str(source): os.path.join(work, source.stem + ".o") for source in SOURCES}
        _run_all({source: [compiler, *compile_flags(Path(source)), "-o", obj, source]
                  for source, obj in objects.items()})
        linked = os.path.join(work, path.name)
        _run_all({"linking " + ", ".join(s.name for s in SOURCES): [compiler, *LINK_FLAGS, "-o", linked,
                                                                   *objects.values()]})
        os.replace(linked, path)
    log.info("built the CPU kernels: %s", path)
    return path


def load() -> ctypes.CDLL:
    """The kernel library, built if needed; raises RuntimeError with the reason when it cannot be had."""
    path = str(build())
    got = _loaded.get(path)
    if got is None:
        try:
            got = ctypes.CDLL(path)
        except OSError as e:
            got = f"cannot load {path}: {e}"
        _loaded[path] = got
    if isinstance(got, str):
        raise RuntimeError(got)
    return got


def kernels_for(device: torch.device, dtype: torch.dtype, what: str) -> ctypes.CDLL | None:
    """The library where its kernels apply (a CPU runner in float32 or bfloat16, built and loaded), else None
    and why, logged once per runner as `what` (e.g. "paged attention") falling back to torch."""
    if device.type != "cpu":
        return None
    if os.environ.get(SWITCH, "1") == "0":
        log.info("CPU kernels off (%s=0): %s runs on torch ops", SWITCH, what)
        return None
    if dtype not in SUFFIX:
        log.info("CPU kernels take float32 or bfloat16, not %s: %s runs on torch ops", dtype, what)
        return None
    try:
        return load()
    except RuntimeError as e:
        log.warning("CPU kernels unavailable, %s runs on torch ops (slower): %s", what, e)
        return None


def entry(lib: ctypes.CDLL, name: str, dtype: torch.dtype):
    """The C function `name`_<f32|bf16> (returns nothing; arguments are passed as ctypes values)."""
    fn = getattr(lib, f"{name}_{SUFFIX[dtype]}")
    fn.restype = None
    return fn


def amx_granted(lib: ctypes.CDLL) -> bool:
    """Whether the library was built for a CPU with AMX and Linux granted the tile state (asked once per process)."""
    lib.paged_decode_amx.restype = ctypes.c_int
    return bool(lib.paged_decode_amx())


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


if __name__ == "__main__":        # `make install` runs this: build the kernels ahead of the first start
    try:
        print(f"CPU kernels: {build()}")
    except RuntimeError as e:
        print(f"CPU kernels not built ({e}); CPU runners will use torch ops", file=sys.stderr)
