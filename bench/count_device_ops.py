"""Device ops one decode step dispatches, counted on fake CUDA: a CPU-side proxy for a GPU's kernel launches.

    python bench/count_device_ops.py                      # the tiny DeepSeek V4, 2 decode rows
    python bench/count_device_ops.py --model dsv4_fp8     # ... with FP8 linears and FP4 experts, as released
    python bench/count_device_ops.py --model qwen3 --rows 4

Why: an eager DeepSeek V4 step on a GPU is launch-bound (hundreds of tiny ops per layer; issue 33), and no GPU is at
hand to time it. The runner's device half runs on fake CUDA tensors (tests/support/fake_cuda: the device guard the
tests use), under torch's profiler, after a prefill of each row; every top-level aten or custom op that is not a
view, an allocation or a metadata query is counted (each is at least one kernel on a GPU; a Triton custom op is
one). For DeepSeek V4 the count is taken twice: the hyper-connections' Sinkhorn normalization as torch ops
(hyper.sinkhorn, what a CPU runs) and as the one-launch kernel a CUDA runner holds
(npu/deepseek_v4/sinkhorn_triton.py).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from npu.deepseek_v4.hyper import sinkhorn  # noqa: E402
from npu.step import SeqStep, StepBatch  # noqa: E402
from tests.npu.test_device_guard import DSV4, DSV4_QUANTIZED, QWEN3, fake_runner, tables  # noqa: E402
from tests.support.fake_cuda import fake_cuda  # noqa: E402

# Ops that launch nothing: views, allocations, metadata, fake mode's own bookkeeping (set_ rebinds storage).
NOT_KERNELS = ("view", "as_strided", "slice", "select", "squeeze", "expand", "permute", "transpose", "aten::t",
               "reshape", "unflatten", "flatten", "split", "chunk", "unbind", "narrow", "detach", "alias", "empty",
               "lift_fresh", "resolve_", "result_type", "contiguous", "aten::to", "_to_copy", "is_", "size", "stride",
               "numel", "aten::dim", "sym_", "set_")


MODELS = {"dsv4": DSV4, "dsv4_fp8": DSV4_QUANTIZED, "qwen3": QWEN3}     # the device guard's tiny configurations


def count_step(runner, batch: StepBatch) -> Counter:
    """The top-level kernel-launching ops of one forward of `batch` on fake CUDA, by name."""
    inputs = runner.prepare(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof, fake_cuda():
        runner.forward(inputs)
    ops: Counter = Counter()
    for event in prof.events():
        parent = event.cpu_parent
        if parent is not None and str(parent.name).startswith(("aten::", "appliance::")):
            continue                                  # inside another op: part of its launch
        if event.name.startswith(("aten::", "appliance::")) and not any(n in event.name for n in NOT_KERNELS):
            ops[event.name] += 1
    return ops


def decode_ops(model: str, rows: int) -> dict[str, Counter]:
    """Per variant, the ops of one decode step of `rows` rows, each after a 32-token prefill: the second of two
    identical steps."""
    runner, _ = fake_runner(MODELS[model])
    seqs = [(f"r{i}", tables(runner, 4 * i, 128)) for i in range(rows)]
    prefill = StepBatch([SeqStep(rid, list(range(3 + i, 35 + i)), 0, t, sample=False, prompt_len=32)
                         for i, (rid, t) in enumerate(seqs)])
    inputs = runner.prepare(prefill)
    with fake_cuda():
        runner.forward(inputs)
    decode = StepBatch([SeqStep(rid, [7 + i], 32, t) for i, (rid, t) in enumerate(seqs)])

    def second_count() -> Counter:                    # a first step builds some tables once, and fake mode
        count_step(runner, decode)                    # dispatches a new op signature twice the first time
        return count_step(runner, decode)
    if not model.startswith("dsv4"):
        return {"as built": second_count()}
    kernel = runner.sinkhorn                          # type: ignore[attr-defined]
    runner.sinkhorn = sinkhorn                        # type: ignore[attr-defined]
    torch_ops = second_count()
    runner.sinkhorn = kernel                          # type: ignore[attr-defined]
    return {"Sinkhorn as torch ops": torch_ops, "Sinkhorn kernel (as built on CUDA)": second_count()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="dsv4",
                    help="the tiny model of that arch (dsv4_fp8: its linears FP8 and its experts FP4, read as stored)")
    ap.add_argument("--rows", type=int, default=2, help="decode rows in the step")
    a = ap.parse_args()
    print(f"tiny {a.model}, one decode step of {a.rows} rows on fake CUDA: ops that launch kernels\n")
    print("| variant | ops | most frequent |")
    print("|---|---:|---|")
    for variant, ops in decode_ops(a.model, a.rows).items():
        top = ", ".join(f"{name.split('::')[1]} {n}" for name, n in ops.most_common(5))
        print(f"| {variant} | {sum(ops.values()):,} | {top} |")


if __name__ == "__main__":
    main()
