"""The real engine on runners a test controls: a real model runner with step hooks (record, fail chosen
requests, hold the loop inside a step), and a scripted runner whose "model" continues fixed token scripts.

`runner_for_engine(runner)` makes the engine's startup use that runner (npu.launcher.launch takes it as an
argument); everything else (planning, pools, scheduler, sampler, stop rules, streaming) is the real code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator, Sequence

import torch

import appliance.engine.engine as engine_module
from appliance.core.config import ModelSpec, RuntimeConfig
from appliance.core.startup_report import StartupReport
from appliance.engine.engine import Engine
from npu.launcher import launch
from npu.registry import runner_class
from npu.runner import ModelRunner
from npu.step import StepBatch
from tests.support.fake_device import ShapeOnlyRunner

HOLD_TIMEOUT_S = 60      # a held step goes on by itself after this long, so a failing test cannot hang


@contextlib.contextmanager
def runner_for_engine(runner: ModelRunner) -> Iterator[None]:
    """While open, every Engine.start() launches on `runner` (instead of one it built or was given)."""
    original = engine_module.launch

    def launch_on_runner(rc: RuntimeConfig, backend=None, _runner=None):
        return launch(rc, backend, runner)

    engine_module.launch = launch_on_runner
    try:
        yield
    finally:
        engine_module.launch = original


class StepHooks:
    """Mixed in before a real ModelRunner class: records every step as (request_id, start_pos, tokens, sample)
    rows and its new pages (with whether the step raised); raises for steps holding a request in `fail_from`
    once it reaches the given position; and while `hold` is set, waits inside the step (after setting `held`)
    until `release` is set."""

    steps: list[list[tuple[str, int, int, bool]]]
    announced: list[tuple[dict[str, list[int]], bool]]
    fail_from: dict[str, int]
    hold: threading.Event
    held: threading.Event
    release: threading.Event

    def execute(self, batch: StepBatch) -> torch.Tensor:
        if self.hold.is_set():
            self.held.set()
            self.release.wait(HOLD_TIMEOUT_S)
        self.steps.append([(s.request_id, s.start_pos, len(s.token_ids), s.sample) for s in batch.seqs])
        failing = [s.request_id for s in batch.seqs if s.start_pos >= self.fail_from.get(s.request_id, 1 << 62)]
        self.announced.append((batch.new_pages, bool(failing)))
        if failing:
            raise RuntimeError(f"injected runner failure for {failing}")
        return super().execute(batch)


@contextlib.contextmanager
def loop_held(runner: StepHooks, then: Callable[[], Any] | None = None) -> Iterator[Any]:
    """Inside the block the engine loop waits inside its next step (entered before the block runs); nothing
    is computed, sampled or aborted until the block exits. Needs a request that makes the loop step: one already
    running, or `then`, called once the hold is armed (the block gets what it returns), so the held step is that
    request's first however long the caller took to get here."""
    runner.held.clear()
    runner.release.clear()
    runner.hold.set()
    try:
        started = then() if then is not None else None
        assert runner.held.wait(HOLD_TIMEOUT_S), "the engine loop never entered a step"
        yield started
    finally:
        runner.hold.clear()
        runner.release.set()


def hooked_runner(model: ModelSpec) -> ModelRunner:
    """model's real runner class on the CPU, with StepHooks."""
    base = runner_class(model.arch)
    runner = type(f"Hooked{base.__name__}", (StepHooks, base), {})(model, torch.device("cpu"))
    runner.steps, runner.announced, runner.fail_from = [], [], {}
    runner.hold, runner.held, runner.release = threading.Event(), threading.Event(), threading.Event()
    return runner


class ScriptedRunner(ShapeOnlyRunner):
    """No math: the logits of a sampled row put all mass on the next token of that request's script, so the
    engine's own sampler, stop rules and detokenizer decide what happens. Other rows (profiling, unknown
    requests) get `filler`. The tokens the engine feeds back are checked against the script."""

    def __init__(self, model: ModelSpec, filler: int = 0):
        super().__init__(model, "cpu")
        self.scripts: dict[str, list[int]] = {}
        self.filler = filler

    def script(self, request_id: str, prompt: Sequence[int], outputs: Sequence[int]) -> None:
        self.scripts[request_id] = [*prompt, *outputs]

    feeds_tokens = True      # async scheduling's fed rows are checked like the others (their token read here)

    def execute(self, batch: StepBatch) -> torch.Tensor:
        if batch.fed is not None:
            fed = dict(batch.fed.rows)
            batch.seqs = [dataclasses.replace(s, token_ids=[int(batch.fed.source[fed[i]])]) if i in fed else s
                          for i, s in enumerate(batch.seqs)]
        rows = [s for s in batch.seqs if s.sample]
        logits = torch.zeros(len(rows), self.model.layout.vocab_size)
        for i, s in enumerate(rows):
            script = self.scripts.get(s.request_id)
            end = s.start_pos + len(s.token_ids)
            if script is not None:
                fed = script[s.start_pos:end]
                if list(s.token_ids) != fed:
                    raise AssertionError(f"{s.request_id}: the engine fed {s.token_ids} at {s.start_pos}, "
                                         f"the script has {fed}")
            logits[i, script[end] if script is not None and end < len(script) else self.filler] = 100.0
        return logits


class HookedEngine(Engine):
    """The real Engine started on a given runner; `drained` is set once drain() has returned (by then it has
    aborted whatever was left after its grace)."""

    def __init__(self, rc: RuntimeConfig, runner: ModelRunner):
        super().__init__(rc)
        self.test_runner = runner
        self.drained = threading.Event()

    def start(self) -> StartupReport:
        with runner_for_engine(self.test_runner):
            return super().start()

    def drain(self, grace_s: float) -> None:
        super().drain(grace_s)
        self.drained.set()
