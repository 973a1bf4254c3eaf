"""Fake CUDA: run a device step on a CPU-only machine with its tensors on a fake `cuda` device, so that the bug
classes an accelerator meets first fail here too:

- an op whose operands sit on different devices (a host tensor indexed by a device mask, a host index into a device
  tensor): FakeTensorMode checks devices as the CUDA kernels do, and `_check_indices` names the indexing cases;
- a host sync inside the step (`.tolist()`, `.item()`, `bool(t)`, `.cpu()`, `.numpy()`, a data-dependent shape
  such as `nonzero` or a boolean-mask index): a fake tensor has no values, so these raise (HostSyncError, or
  FakeTensorMode's DataDependentOutputException / DynamicOutputShapeException); so does a blocking upload
  (`host.to(device)` without non_blocking=True, `torch.tensor(data, device=...)`), which waits for the device's
  queue to drain;
- a `.view` of a result whose memory layout a kernel chooses: CUDA's fused SDPA kernels return [B, L, H, D] memory
  viewed as [B, H, L, D], the CPU kernel a contiguous [B, H, L, D]; under this guard SDPA returns the CUDA layout,
  so a `.view` that only the CPU layout allows fails as it does on a GPU.

Host tensors stay real: a tensor made on the CPU from plain data (a step's metadata) is computed for real, so the
host half of a step (`ModelRunner.prepare`) may read values freely; what it hands the device half is uploaded with
`.to(device)` / `copy_`, which become fake device tensors. Everything made on `cuda` (weights, pools, activations) is
fake: shapes, dtypes and devices only, no memory.

    with fake_cuda():
        runner = build_runner(model, torch.device("cuda")); runner.load_weights(); runner.allocate_pools(...)
    inputs = runner.prepare(batch)          # host: real
    with fake_cuda():
        logits = runner.forward(inputs)     # device: fake; raises on a cross-device op or a host sync

Two pieces make a CPU-only build of torch accept `cuda` at all: device_guard.cpp registers a no-op CUDA device guard
(torch's Python bindings set one up before dispatch; a CPU build has none: "PyTorch is not linked with support for
cuda devices"), compiled once into a cache like npu/cpu_kernels.py's; and torch.Generator(device="cuda"), which
needs the CUDA library, is made on the host inside the block (fake random ops never read a generator).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
import torch.utils.cpp_extension
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from npu.cpu_kernels import cache_dir

FAKE_DEVICE = torch.device("cuda", 0)
GUARD_SOURCE = Path(__file__).with_name("device_guard.cpp")


class HostSyncError(AssertionError):
    """The device half of a step read a device tensor's values on the host, copied it there, or mixed devices."""


def on_device(t: Any) -> bool:
    return isinstance(t, FakeTensor) and t.fake_device.type == FAKE_DEVICE.type


def _wants_device(device: Any) -> bool:
    return device is not None and torch.device(device).type == FAKE_DEVICE.type


def _load_device_guard() -> None:
    """Build (once per torch and source) and load the library registering a no-op CUDA device guard."""
    if torch.cuda.is_available() or torch.version.cuda is not None:
        raise RuntimeError("fake_cuda is for CPU-only builds of torch; on a CUDA build run the step on the GPU")
    torch_lib = Path(torch.__file__).parent / "lib"
    key = hashlib.sha256((GUARD_SOURCE.read_text() + torch.__version__).encode()).hexdigest()[:16]
    lib = cache_dir() / f"fake_cuda_guard-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        includes = [f"-I{p}" for p in torch.utils.cpp_extension.include_paths()]
        subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", *includes, str(GUARD_SOURCE),
                        f"-L{torch_lib}", "-lc10", f"-Wl,-rpath,{torch_lib}", "-o", str(tmp)], check=True,
                       capture_output=True)
        tmp.replace(lib)
    ctypes.CDLL(str(lib))


class _DeviceFakeHostReal(FakeTensorMode):
    """Fake for every op that touches a device tensor or makes one; real for the rest (the host's own work)."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if any(isinstance(t, FakeTensor) for t in flat):
            if func is torch.ops.aten._to_copy.default and on_device(args[0]) and "device" in kwargs \
                    and not _wants_device(kwargs["device"]):
                raise HostSyncError(f"a device tensor {tuple(args[0].shape)} is copied to the host inside the step")
            if func is torch.ops.aten.copy_.default and on_device(args[1]) and not on_device(args[0]):
                raise HostSyncError(f"a device tensor {tuple(args[1].shape)} is copied into a host tensor inside "
                                    f"the step")
            return super().__torch_dispatch__(func, types, args, kwargs)
        if _wants_device(kwargs.get("device")):
            return super().__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **kwargs)


# Ops whose output shape depends on the values: a host sync on a GPU (the size must come back before allocating).
_DATA_DEPENDENT = {torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select,
                   torch.unique, torch.Tensor.unique, torch.unique_consecutive, torch.Tensor.unique_consecutive,
                   torch.argwhere, torch.Tensor.argwhere}
# Reads of a device tensor's values on the host.
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.numpy,
               torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.index_put}


def _check_indices(tensor: Any, index: Any) -> None:
    """Indexing rules of a device step: no host tensor indexed by a device tensor (an error on a GPU), no host
    index tensor into a device tensor (an implicit upload at every call), no boolean mask into a device tensor
    (its result's size depends on the values: a host sync)."""
    tensors = [t for t in tree_flatten(index)[0] if isinstance(t, torch.Tensor)]
    if not on_device(tensor):
        if any(on_device(t) for t in tensors):
            raise HostSyncError(f"a host tensor {tuple(tensor.shape)} is indexed by a device tensor inside the step "
                                f"(on a GPU: 'indices should be either on cpu or on the same device'): move the indexed "
                                f"tensor to the device with the step's inputs")
        return
    for t in tensors:
        if not on_device(t) and t.dim() > 0:
            raise HostSyncError(f"a device tensor {tuple(tensor.shape)} is indexed by a host tensor {tuple(t.shape)} "
                                f"inside the step: an implicit upload at every call; upload the index with the step's "
                                f"inputs")
        if t.dtype in (torch.bool, torch.uint8):
            raise HostSyncError(f"a device tensor {tuple(tensor.shape)} is indexed by a boolean mask inside the step: "
                                f"the result's size depends on the values (a host sync); use torch.where or "
                                f"masked_fill")


class _DeviceRules(TorchFunctionMode):
    """Names host syncs and indexing mistakes as they happen; gives SDPA the output layout of CUDA's fused kernels.
    While loading (`loading`), a host read of a device tensor (a load-time value check) reads zeros instead."""

    def __init__(self, loading: bool = False) -> None:
        super().__init__()
        self.loading = loading

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        first = args[0] if args else None
        if self.loading and (func in _HOST_READS or func in _DATA_DEPENDENT) and on_device(first):
            return func(torch.zeros(first.shape, dtype=first.dtype), *args[1:], **kwargs)
        if func in _HOST_READS and on_device(first):
            raise HostSyncError(f"{func.__name__} of a device tensor {tuple(first.shape)} inside the step: a host sync")
        if func in _DATA_DEPENDENT and on_device(first):
            raise HostSyncError(f"{func.__name__} of a device tensor inside the step: its output shape depends on the "
                                f"values, so the host waits for the device")
        if func in _INDEXING:
            _check_indices(first, args[1])
        if func in (torch.Tensor.to, torch.Tensor.cuda) and isinstance(first, torch.Tensor) and not on_device(first):
            upload = _upload(func, args, kwargs)       # a host tensor to the device: the step's inputs
            if upload is not None:
                if not self.loading and not kwargs.get("non_blocking", False):
                    raise HostSyncError(f"a blocking upload of a host tensor {tuple(first.shape)} inside the step: the "
                                        f"host waits for the device's queue to drain; pass non_blocking=True")
                return upload
        if func in (torch.tensor, torch.as_tensor) and _wants_device(kwargs.get("device")) and not self.loading:
            raise HostSyncError("torch.tensor(data, device=...) inside the step is a blocking upload: make the "
                                "tensor on the host and .to(device, non_blocking=True), or keep it on the device")
        if func is torch.Tensor.copy_ and on_device(first) and not on_device(args[1]):
            return first.copy_(torch.ops.aten._to_copy(args[1], device=FAKE_DEVICE), **kwargs)
        if kwargs.get("generator") is not None and (on_device(first) or _wants_device(kwargs.get("device"))):
            kwargs = {k: v for k, v in kwargs.items() if k != "generator"}   # a host generator: fake ops ignore it
        out = func(*args, **kwargs)
        if func is F.scaled_dot_product_attention and on_device(out) and out.dim() == 4:
            return out.transpose(1, 2).contiguous().transpose(1, 2)         # [B, L, H, D] memory as [B, H, L, D]
        return out


def _upload(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """`host.to("cuda", ...)` / `host.cuda()` as aten's _to_copy, which the fake mode turns into a fake device
    tensor (Tensor.to's own path allocates on the real CUDA backend under inference_mode); None: not an upload."""
    device, dtype = (FAKE_DEVICE if func is torch.Tensor.cuda else kwargs.get("device")), kwargs.get("dtype")
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            device = a
        elif isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, torch.Tensor):
            device, dtype = a.device, a.dtype
    if not _wants_device(device):
        return None
    return torch.ops.aten._to_copy(args[0], device=FAKE_DEVICE, dtype=dtype or args[0].dtype)


class _HostGenerator:
    """torch.Generator that accepts device="cuda" (made on the host: fake random ops never read its state)."""

    def __new__(cls, device: Any = "cpu") -> torch.Generator:  # type: ignore[misc]
        return _REAL_GENERATOR()


_REAL_GENERATOR = torch.Generator
_MODE: _DeviceFakeHostReal | None = None


@contextlib.contextmanager
def fake_cuda(loading: bool = False) -> Iterator[None]:
    """Tensors made on `cuda` inside are fake; see the module docstring. Re-enter it for each device half: fake
    tensors made in one block are used in the next (one FakeTensorMode serves the whole process). `loading`: for
    building a runner, whose load-time checks read weight values (they read zeros: a fake tensor has none)."""
    global _MODE
    if _MODE is None:
        _load_device_guard()
        _MODE = _DeviceFakeHostReal()
    torch.Generator = _HostGenerator  # type: ignore[misc,assignment]
    try:
        with _DeviceRules(loading), _MODE:
            yield
    finally:
        torch.Generator = _REAL_GENERATOR  # type: ignore[misc]
