"""Device ops one decode step dispatches, counted on fake CUDA: a CPU-side proxy for a GPU's kernel launches.

    python bench/count_device_ops.py                      # the tiny DeepSeek V4, 2 decode rows
    python bench/count_device_ops.py --model dsv4_fp8     # ... with FP8 linears and FP4 experts, as released
    python bench/count_device_ops.py --model qwen3 --rows 4
    python bench/count_device_ops.py --by-function 20     # and which functions (under npu/) issue them

Why: an eager DeepSeek V4 step on a GPU is launch-bound (hundreds of tiny ops per layer; issue 33), and no GPU is at
hand to time it. The runner's device half runs on fake CUDA tensors (tests/support/fake_cuda: the device guard the
tests use) after a prefill of each row, and every aten or custom op that reaches the dispatcher with a device tensor
among its inputs or outputs is counted, unless it only makes a view or an allocation: each is a kernel launch (or
a host-to-device copy) on a GPU; a Triton custom op counts once. Ops on host tensors (DeepSeek V4 builds its step
plan on the host inside forward) are the host's work, not launches, and are left out. Composite ops are counted as
the dispatcher runs them (an einsum as its matmul and the copies it needs, a cast as _to_copy).

For DeepSeek V4 the count is taken twice: with its device-side kernels as a CUDA runner holds them (Triton:
Sinkhorn, RoPE, the RMS norms, the hyper-connections' mixing, the attention over its paged rows and the indexer's
scores, the clamped SwiGLU), and with the torch ops a CPU runs in their place.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from npu.deepseek_v4 import attention as dsv4_attention  # noqa: E402
from npu.deepseek_v4 import hyper, moe, rope  # noqa: E402
from npu.step import SeqStep, StepBatch  # noqa: E402
from tests.npu.test_device_guard import DSV4, DSV4_QUANTIZED, QWEN3, fake_runner, tables  # noqa: E402
from tests.support.fake_cuda import fake_cuda, on_device  # noqa: E402

# Dispatcher ops that launch nothing: allocations, metadata and fake mode's own bookkeeping (views are found by their
# schema, prim:: ops such as prim::device are metadata).
NOT_KERNELS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "set_",
               "detach", "alias", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size"}

MODELS = {"dsv4": DSV4, "dsv4_fp8": DSV4_QUANTIZED, "qwen3": QWEN3}     # the device guard's tiny configurations


class DeviceOps(TorchDispatchMode):
    """Counts the ops that touch a device tensor, by name, or by the innermost function under npu/ that issued them."""

    def __init__(self, by_function: bool):
        super().__init__()
        self.by_function = by_function
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.namespace != "prim" and not func.is_view and name not in NOT_KERNELS and any(
                on_device(t) for t in tree_flatten((args, kwargs, out))[0]):
            self.ops[issuer() if self.by_function else f"{func.namespace}::{name}"] += 1
        return out


def issuer() -> str:
    """`file: function` of the innermost frame under npu/ on the Python stack."""
    for frame in reversed(traceback.extract_stack()):
        if "/npu/" in frame.filename:
            return f"{frame.filename.split('/npu/', 1)[1]}: {frame.name}"
    return "(elsewhere)"


def count_step(runner, batch: StepBatch, by_function: bool = False) -> Counter:
    """The device ops of one forward of `batch` on fake CUDA."""
    inputs = runner.prepare(batch)
    counter = DeviceOps(by_function)
    with fake_cuda(), counter:
        runner.forward(inputs)
    return counter.ops


def torch_ops_only(runner) -> ExitStack:
    """A context in which a fake-CUDA DeepSeek V4 runner takes the torch ops a CPU runs instead of its Triton kernels
    (Sinkhorn, RoPE, the RMS norms, the hyper-connections' mixing, the attention over its paged rows and the
    indexer's scores, the clamped SwiGLU)."""
    stack = ExitStack()
    stack.enter_context(mock.patch.object(runner, "sinkhorn", hyper.sinkhorn))
    stack.enter_context(mock.patch.object(runner.attention, "in_place", False))
    stack.enter_context(mock.patch.object(rope, "rotation_kernel_applies", lambda device: False))
    stack.enter_context(mock.patch.object(hyper, "norm_kernel_applies", lambda device: False))
    stack.enter_context(mock.patch.object(hyper, "hyper_kernels_apply", lambda device, hc: False))
    stack.enter_context(mock.patch.object(moe, "activation_kernel_applies", lambda device: False))
    stack.enter_context(mock.patch.object(dsv4_attention, "norm_kernel_applies", lambda device: False))
    return stack


def decode_ops(model: str, rows: int, by_function: bool = False) -> dict[str, Counter]:
    """Per variant, the device ops of one decode step of `rows` rows, each after a 32-token prefill: the second of
    two identical steps."""
    runner, _ = fake_runner(MODELS[model])
    seqs = [(f"r{i}", tables(runner, 4 * i, 128)) for i in range(rows)]
    prefill = StepBatch([SeqStep(rid, list(range(3 + i, 35 + i)), 0, t, sample=False, prompt_len=32)
                         for i, (rid, t) in enumerate(seqs)])
    inputs = runner.prepare(prefill)
    with fake_cuda():
        runner.forward(inputs)
    decode = StepBatch([SeqStep(rid, [7 + i], 32, t) for i, (rid, t) in enumerate(seqs)])

    def second_count() -> Counter:                    # a first step builds some tables once
        count_step(runner, decode)
        return count_step(runner, decode, by_function)
    if not model.startswith("dsv4"):
        return {"as built": second_count()}
    with torch_ops_only(runner):
        torch_ops = second_count()
    return {"torch ops (as on a CPU)": torch_ops, "Triton kernels (as built on CUDA)": second_count()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="dsv4",
                    help="the tiny model of that arch (dsv4_fp8: its linears FP8 and its experts FP4, read as stored)")
    ap.add_argument("--rows", type=int, default=2, help="decode rows in the step")
    ap.add_argument("--by-function", type=int, default=0, metavar="N",
                    help="then the N functions (under npu/) that issue the most, for the step as built")
    a = ap.parse_args()
    torch.manual_seed(0)
    print(f"tiny {a.model}, one decode step of {a.rows} rows on fake CUDA: ops that touch a device tensor\n")
    print("| variant | ops | most frequent |")
    print("|---|---:|---|")
    for variant, ops in decode_ops(a.model, a.rows).items():
        top = ", ".join(f"{name.split('::')[1]} {n}" for name, n in ops.most_common(5))
        print(f"| {variant} | {sum(ops.values()):,} | {top} |")
    if a.by_function:
        by = list(decode_ops(a.model, a.rows, by_function=True).values())[-1]
        print("\n| issued by | ops |\n|---|---:|")
        for where, n in by.most_common(a.by_function):
            print(f"| {where} | {n} |")


if __name__ == "__main__":
    main()
