"""Decode steps as replayed device graphs: one graph per batch-size bucket over static input buffers.

A decode step launches the same few hundred kernels every time, only on other data; launching them one by one from
Python costs more host time than the GPU spends running them (BENCHMARKS.md "On an NVIDIA H200": ~10 ms of kernels
in a 117 ms step of the Qwen3-8B layout). A graph records the launches once and replays them with one call.

    graphs = DecodeGraphs(device, buckets=(1, 2, 4, 8, ...), run=runner's forward over static buffers)
    graphs.capture(static_inputs_of)        # at start, after the KV pools exist (graphs keep their addresses)
    logits = graphs.replay(batch_size, fill)    # fill(static inputs) copies the step's inputs in; returns logits rows

What must hold for a replay to be right: every tensor the recorded launches read or write keeps its address (the
pools, weights, rope table and the static inputs: a runner allocates them before capture and never re-allocates
them while the graphs live), and the step's shapes are the bucket's (padding rows read and write scratch pages).
Where the device has no graphs (a CPU, or device.graphs=false) `replay` runs the same function eagerly on the same
static buffers, so the CPU tests cover everything but the recording itself.

Backends: torch.cuda.CUDAGraph on CUDA; torch_npu's torch.npu.NPUGraph where it exists (same API); none elsewhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger("npu.graphs")


def graph_module(device: torch.device) -> Any | None:
    """The torch device module whose graph API records this device's work (torch.cuda, torch.npu), or None."""
    mod = getattr(torch, device.type, None) if device.type in ("cuda", "npu") else None
    graph_class = "CUDAGraph" if device.type == "cuda" else "NPUGraph"
    if mod is None or not hasattr(mod, graph_class) or not hasattr(mod, "graph"):
        return None
    return mod


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes that get a graph: powers of two up to max_batch, and max_batch itself. A step of n rows replays
    the smallest bucket >= n (at most 2x the rows; padding rows cost little in a decode step, which reads weights)."""
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= 2
    return (*sizes, max_batch)


@dataclass
class StaticStep:
    """One bucket: its static inputs (whatever the runner's fill writes), the logits its function returns, and the
    recorded graph (None: replayed eagerly)."""

    batch: int
    inputs: Any
    logits: torch.Tensor | None = None
    graph: Any = None


class DecodeGraphs:
    """Graphs of `run(inputs) -> logits` for each batch bucket, over inputs made by `make_inputs(batch)`."""

    def __init__(self, device: torch.device, buckets: Sequence[int], make_inputs: Callable[[int], Any],
                 run: Callable[[Any], torch.Tensor], record: bool):
        self.device = device
        self.buckets = tuple(sorted(buckets))
        self.run = run
        self.mod = graph_module(device) if record else None
        self.steps = {b: StaticStep(b, make_inputs(b)) for b in self.buckets}
        self.pool: Any = None

    @property
    def recorded(self) -> bool:
        return self.mod is not None

    def capture(self) -> None:
        """Record every bucket, largest first (they share one memory pool, sized by the largest). Each is run twice
        eagerly first on a side stream (libraries allocate their workspaces on a first call, which a graph cannot)."""
        if self.mod is None:
            return
        self.pool = self.mod.graph_pool_handle()
        side = self.mod.Stream()
        side.wait_stream(self.mod.current_stream())
        with self.mod.stream(side):
            for step in sorted(self.steps.values(), key=lambda s: -s.batch):
                for _ in range(2):
                    self.run(step.inputs)
        self.mod.current_stream().wait_stream(side)
        graph_class = getattr(self.mod, "CUDAGraph" if self.device.type == "cuda" else "NPUGraph")
        for step in sorted(self.steps.values(), key=lambda s: -s.batch):
            step.graph = graph_class()
            with self.mod.graph(step.graph, pool=self.pool):
                step.logits = self.run(step.inputs)
        self.mod.synchronize()

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket that holds `rows` rows, or None (more rows than the largest: run eagerly)."""
        return next((b for b in self.buckets if b >= rows), None)

    def replay(self, rows: int, fill: Callable[[Any], None]) -> torch.Tensor:
        """Fill the bucket's static inputs (fill) and replay it; the first `rows` rows of its logits (a view of the
        graph's output: read it before the next replay)."""
        batch = self.bucket(rows)
        if batch is None:
            raise ValueError(f"{rows} decode rows exceed the largest graph bucket {self.buckets[-1]}")
        step = self.steps[batch]
        fill(step.inputs)
        if step.graph is None:
            step.logits = self.run(step.inputs)
        else:
            step.graph.replay()
        assert step.logits is not None
        return step.logits[:rows]

    def release(self) -> None:
        """Drop the graphs and their memory pool (before the pools they read are freed)."""
        for step in self.steps.values():
            step.graph, step.logits = None, None
        self.pool = None
