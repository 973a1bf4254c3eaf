"""The engine step over data-parallel ranks (appliance/engine/step_input.py, core.py `_execute`), without processes: the rank
group is replaced by a scripted runner whose execute_partitions runs each rank's batch and concatenates the
logits, as DeviceGroup does. Written against the mutants docs/TESTING.md lists.

- Each rank's batch holds exactly the requests whose pages live in that rank's pools (a request stepped on
  another rank would read and write that rank's pages), and every rank gets one batch every step.
- The logits come back in rank order, so the scheduled requests are put in that order first: with requests
  on both ranks every request still receives its own script's tokens (the scripted runner checks what it is
  fed), and every request ends with its whole script.
- Requests on both ranks are stepped together, and no step fails (a step that raises is retried one request
  at a time, which would hide a broken batch behind correct tokens, but logs the failure).
"""

from __future__ import annotations

import logging
import threading

import torch

import appliance.engine.core as engine_core
import appliance.engine.engine as engine_module
from appliance.config.compose import load_runtime_config
from appliance.core.request import FinishReason, SamplingParams
from npu.step import StepBatch
from tests.engine.instrumented import HookedEngine, ScriptedRunner, StepHooks
from tests.support.kv import free_blocks, total_blocks

NEW_TOKENS = 6


class PartitionedScriptedRunner(ScriptedRunner):
    """Records, per step, the request ids of each rank's batch and the rank the KV manager placed each on."""

    def __init__(self, model, filler: int = 0):
        super().__init__(model, filler)
        self.engine: HookedEngine | None = None
        self.rank_batches: list[list[list[tuple[str, int]]]] = []

    def execute_partitions(self, batches: list[StepBatch]) -> torch.Tensor:
        kv = self.engine.kv_cache_manager
        self.rank_batches.append([[(s.request_id, kv.partition_of(s.request_id)) for s in b.seqs] for b in batches])
        return torch.cat([self.execute(b) for b in batches])


class HookedPartitionedRunner(StepHooks, PartitionedScriptedRunner):
    """With StepHooks, so that a test can hold the loop while it submits requests that must share a step."""


def test_each_rank_steps_its_own_requests_and_each_request_gets_its_own_tokens(monkeypatch, caplog):
    rc = load_runtime_config(["+model=qwen3_tiny", "device=cpu", "device.count=2", "max_model_len=64",
                              "parallel.data_parallel_size=2", "kv_cache.num_slots_override=4", "max_num_seqs=8",
                              "enable_prefix_caching=false"])
    runner = HookedPartitionedRunner(rc.model)
    runner.steps, runner.announced, runner.fail_from = [], [], {}
    runner.hold, runner.held, runner.release = threading.Event(), threading.Event(), threading.Event()
    # One process stands for both ranks: start_ranks launches on the scripted runner (engine_module.launch is the
    # HookedEngine's, which uses it).
    monkeypatch.setattr(engine_module, "start_ranks", lambda rc, backend, _runner: engine_module.launch(rc, backend))
    engine = HookedEngine(rc, runner)
    runner.engine = engine
    engine.start()
    caplog.set_level(logging.ERROR, logger="appliance.engine")
    try:
        vocab = rc.model.layout.vocab_size
        scripts = {f"r{i}": ([3 + i, 40 + i, 90 + 2 * i][: 1 + i % 3],
                             [(100 + 17 * i + 5 * k) % (vocab - 3) + 3 for k in range(NEW_TOKENS)])
                   for i in range(6)}
        for rid, (prompt, outputs) in scripts.items():
            runner.script(rid, prompt, outputs)
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        runner.script("gate", [5, 6, 7], [8, 9, 10])
        runner.hold.set()                  # the loop waits inside the gate's first step ...
        gate = engine.submit("gate", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        while not runner.held.wait(0.1):    # or the gate ended before its step reached the runner
            assert gate.outputs.empty(), gate.outputs.get()
        handles = {rid: engine.submit(rid, prompt, params) for rid, (prompt, _) in scripts.items()}
        runner.hold.clear()                # ... so all six are admitted together in the next one
        runner.release.set()
        for rid, handle in handles.items():
            deltas = []
            while not deltas or not deltas[-1].finished:
                deltas.append(handle.outputs.get(timeout=60))
            assert deltas[-1].finish_reason is FinishReason.LENGTH and deltas[-1].error is None, deltas[-1]
            assert [t for d in deltas for t in d.new_token_ids] == scripts[rid][1], rid
        while not gate.outputs.get(timeout=60).finished:
            pass
        assert engine.num_in_flight() == 0 and free_blocks(engine) == total_blocks(engine)
    finally:
        engine.shutdown()
    assert not [r.getMessage() for r in caplog.records if r.name in (engine_core.__name__, engine_module.__name__)]
    steps = runner.rank_batches
    assert steps and all(len(step) == 2 for step in steps)
    assert any(len(step[0]) >= 3 and len(step[1]) >= 3 for step in steps)     # the six shared a step
    for step in steps:
        for rank, batch in enumerate(step):
            assert all(placed == rank for _, placed in batch), (rank, batch)
    ranks = [{rid for rid, _ in batch} for step in steps for batch in step]
    assert set().union(*ranks[0::2]) and set().union(*ranks[1::2])          # requests on both ranks
    assert not set().union(*ranks[0::2]) & set().union(*ranks[1::2])
