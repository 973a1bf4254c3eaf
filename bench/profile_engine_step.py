"""Where an engine step's time goes outside the model: per-step breakdown of the offline API on a checkpoint.

    python bench/profile_engine_step.py --model DIR [--requests 64 --prompt-len 128 --gen-len 128 --threads 2]

Runs the issue-16 workload (N requests x P random prompt ids -> G generated, greedy, ignore_eos) through
`Appliance.generate` once to warm up and once measured, with timers wrapped around the engine's parts (the
code itself is unchanged). Each loop iteration of the engine thread is one row; the table gives the median
over the decode steps (every scheduled sequence computes one token) and the mean over all steps, in ms of
wall time, split into exclusive categories:

    model            the runner's execute minus its step metadata (the forward pass and the logits)
    step metadata    the runner's per-step index tensors (npu.qwen3.step_layout.StepLayout.build), when the runner has it
    schedule         Scheduler.schedule (admission, chunking, page allocation)
    block tables     KvCacheManager.block_tables for every sequence of the step
    batch build      the rest of step_input.build_step and EngineCore._execute: SeqStep / StepBatch objects
    sampling         EngineCore._sample: the logits rows, grammar masks, Sampler.sample, logprobs
    kv commit        KvCacheManager.commit (prefix-cache registration, ring releases)
    update           the rest of Scheduler.update_from_output (appending tokens, the core's stop rules) and the
                     draft figures (EngineCore._update)
    detokenize       IncrementalDetokenizer.push
    output           the rest of OutputProcessor.process_outputs (stop strings, hold-back, RequestOutputs)
    deliver          ProcessedOutputs.deliver (the consumers' callbacks / queues)
    stats            EngineCore._record_tokens and EngineCore._publish_stats
    loop rest        everything else in the iteration (inbox, bookkeeping, finishing sequences)

The parts are the engine core's (appliance/engine/core.py), reached through the Engine's `_core`: the engine has no
public handle on its core, and this script needs one, because it times the core's own step methods (instance
attributes, patched on that one core) and a few class attributes.

The wall time of the whole run is printed too, with the load average before and after (the machine may be
shared: compare figures taken back to back). `--cprofile N` adds the N functions with the most own time.
`--cold --rounds N` leaves out the warm-up and runs the workload N times (fresh prompts each), with one line per
round: where the first requests after start-up pay (prefill or decode steps), the tables then over every round.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peer_workers import appliance_overrides  # noqa: E402 (bench/: the script directory)

from appliance.core.request import SamplingParams  # noqa: E402
from appliance.core.tokenizer import IncrementalDetokenizer  # noqa: E402
from appliance.engine import core as core_module  # noqa: E402
from appliance.engine.core import EngineCore  # noqa: E402
from appliance.engine.engine import Engine  # noqa: E402
from appliance.engine.output import ProcessedOutputs  # noqa: E402
from appliance.offline import Appliance  # noqa: E402

CATEGORIES = ("model", "step metadata", "schedule", "block tables", "batch build", "sampling", "kv commit",
              "update", "detokenize", "output", "deliver", "stats", "loop rest")


def engine_core(engine: Engine) -> EngineCore:
    """The started engine's core: the Engine keeps it private (`_core`), and this script times its parts."""
    core = getattr(engine, "_core", None)
    if not isinstance(core, EngineCore):
        raise RuntimeError("the engine has no started EngineCore at engine._core (appliance/engine/engine.py moved "
                           "it?): bench/profile_engine_step.py times the core's parts")
    return core


class StepTimer:
    """Exclusive wall time per category of the engine thread, one row per loop iteration."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.kinds: list[str] = []
        self._row: dict[str, float] | None = None
        self._kind = "idle"
        self._start = 0.0
        self._stack: list[list] = []          # [category, start, child time]
        self.enabled = False

    def wrap(self, category: str, fn):
        def timed(*args, **kwargs):
            if not self.enabled or threading.current_thread().name != "engine-loop":
                return fn(*args, **kwargs)
            frame = [category, time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                elapsed = time.perf_counter() - frame[1]
                if self._row is not None:
                    self._row[category] = self._row.get(category, 0.0) + elapsed - frame[2]
                if self._stack:
                    self._stack[-1][2] += elapsed
        return timed

    def iteration(self) -> None:
        """A loop iteration starts (the engine publishes its stats first thing)."""
        now = time.perf_counter()
        if self._row is not None and self._kind != "idle":
            self._row["total"] = now - self._start
            named = sum(v for k, v in self._row.items() if k not in ("total", "loop rest"))
            self._row["loop rest"] = self._row["total"] - named
            self.rows.append(self._row)
            self.kinds.append(self._kind)
        self._row, self._kind, self._start = {}, "idle", now

    def scheduled(self, items) -> None:
        if items:
            self._kind = "decode" if all(s.num_new_tokens == 1 for s in items) else "prefill"


def instrument(app: Appliance, timer: StepTimer) -> None:
    """Wrap the engine core's parts with the timer (instance attributes of the one core and its parts, and a few
    class or module attributes: StepLayout.build, IncrementalDetokenizer.push, ProcessedOutputs.deliver, build_step)."""
    core = engine_core(app.engine)
    runner, sched, kv = core.runner, core.scheduler, core.kv
    runner.execute = timer.wrap("model", runner.execute)
    runner.execute_partitions = timer.wrap("model", runner.execute_partitions)
    layout_module = sys.modules.get(type(runner).__module__.rpartition(".")[0] + ".step_layout")
    step_layout = getattr(layout_module, "StepLayout", None)
    if step_layout is not None:
        step_layout.build = staticmethod(timer.wrap("step metadata", step_layout.build))
    schedule = timer.wrap("schedule", sched.schedule)

    def schedule_and_mark():
        items = schedule()
        timer.scheduled(items)
        return items
    sched.schedule = schedule_and_mark
    kv.block_tables = timer.wrap("block tables", kv.block_tables)
    kv.commit = timer.wrap("kv commit", kv.commit)
    core_module.build_step = timer.wrap("batch build", core_module.build_step)   # (core.py calls it by this name)
    core._execute = timer.wrap("batch build", core._execute)
    core._sample = timer.wrap("sampling", core._sample)
    core._update = timer.wrap("update", core._update)
    core.outputs.process_outputs = timer.wrap("output", core.outputs.process_outputs)
    ProcessedOutputs.deliver = timer.wrap("deliver", ProcessedOutputs.deliver)
    core._record_tokens = timer.wrap("stats", core._record_tokens)
    publish = timer.wrap("stats", core._publish_stats)

    def publish_and_mark():
        timer.iteration()
        publish()
    core._publish_stats = publish_and_mark
    core._run_step = timer.wrap("loop rest", core._run_step)
    IncrementalDetokenizer.push = timer.wrap("detokenize", IncrementalDetokenizer.push)


class LoopProfiler:
    """cProfile of the engine thread (a profiler follows only the thread that enables it): enabled by the
    loop at its next step, disabled by the loop at the iteration after stop() wakes it."""

    def __init__(self, engine: Engine):
        import cProfile
        self.profile = cProfile.Profile()
        self.core = core = engine_core(engine)
        self.done = threading.Event()
        self._on = False
        self._stopping = False
        run_step, publish = core._run_step, core._publish_stats

        def run_step_profiled(*args):
            if not self._on and not self._stopping:
                self._on = True
                self.profile.enable()
            return run_step(*args)

        def publish_then_stop():
            if self._stopping and self._on:
                self.profile.disable()
                self._on = False
                self.done.set()
            publish()
        core._run_step, core._publish_stats = run_step_profiled, publish_then_stop

    def stop(self) -> None:
        self._stopping = True
        self.core.wake()
        self.done.wait(10)


def summarize(timer: StepTimer, kind: str, reduce) -> dict[str, float]:
    rows = [r for r, k in zip(timer.rows, timer.kinds) if kind in ("all", k)]
    if not rows:
        return {}
    out = {}
    for cat in CATEGORIES + ("total",):
        out[cat] = 1000 * reduce([r.get(cat, 0.0) for r in rows])
    out["steps"] = len(rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json, safetensors, tokenizer.json)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cprofile", type=int, default=0, help="also print the N functions with the most own time")
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides")
    ap.add_argument("--rounds", type=int, default=1, help="measured runs of the workload, fresh prompts each")
    ap.add_argument("--cold", action="store_true", help="no warm-up call before the first measured round")
    a = ap.parse_args()

    load_before = os.getloadavg()
    app = Appliance.from_config(appliance_overrides(a.model, a.threads, a.requests) + a.extra)
    rng = random.Random(0)
    vocab = app.rc.model.layout.vocab_size
    params = SamplingParams(max_tokens=a.gen_len, ignore_eos=True)
    if not a.cold:
        app.generate([[rng.randrange(1, vocab) for _ in range(a.prompt_len)] for _ in range(2)],
                     SamplingParams(max_tokens=4, ignore_eos=True))
    timer = StepTimer()
    instrument(app, timer)
    profiler = LoopProfiler(app.engine) if a.cprofile else None
    timer.enabled = True
    wall, results, rounds = 0.0, [], []
    for _ in range(a.rounds):
        prompts = [[rng.randrange(1, vocab) for _ in range(a.prompt_len)] for _ in range(a.requests)]
        timer.iteration()              # the engine thread waits for requests: its next step starts a row
        first = len(timer.rows)
        t0 = time.perf_counter()
        results = app.generate(prompts, params)
        took = time.perf_counter() - t0
        wall += took
        timer.iteration()
        rounds.append((took, first, len(timer.rows)))
    timer.enabled = False
    if profiler is not None:
        profiler.stop()
    timer.iteration()
    app.close()
    for i, (took, first, last) in enumerate(rounds):
        steps = list(zip(timer.rows[first:last], timer.kinds[first:last]))
        prefill = [r["total"] for r, k in steps if k == "prefill"]
        decode = [r["total"] for r, k in steps if k == "decode"]
        model = [r.get("model", 0.0) for r, k in steps if k == "decode"]
        print(f"round {i + 1}: {a.requests * a.gen_len / took:.0f} out tok/s in {took:.2f} s; prefill steps "
              f"{len(prefill)}, {1000 * sum(prefill):.0f} ms; decode steps {len(decode)}, "
              f"{1000 * sum(decode):.0f} ms (median {1000 * statistics.median(decode or [0]):.2f}, model "
              f"{1000 * statistics.median(model or [0]):.2f})")
    n_out = sum(len(r.token_ids) for r in results) * a.rounds
    load_after = os.getloadavg()

    print(f"model {a.model} ({app.rc.model.layout.dtype}), {a.requests} x {a.prompt_len} -> {a.gen_len}, "
          f"{a.threads} threads")
    print(f"load average before {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} / {load_after[1]:.2f} / {load_after[2]:.2f}")
    print(f"{n_out} tokens in {wall:.2f} s = {n_out / wall:.0f} out tok/s, {len(timer.rows)} steps\n")
    decode_med = summarize(timer, "decode", statistics.median)
    decode_mean = summarize(timer, "decode", statistics.mean)
    every = summarize(timer, "all", statistics.mean)
    print(f"| ms per step | decode median ({decode_med.get('steps', 0)}) | decode mean | all steps mean "
          f"({every.get('steps', 0)}) | share of all |")
    print("|---|---:|---:|---:|---:|")
    for cat in CATEGORIES + ("total",):
        share = 100 * every.get(cat, 0.0) / every["total"] if every.get("total") else 0.0
        print(f"| {cat} | {decode_med.get(cat, 0.0):.2f} | {decode_mean.get(cat, 0.0):.2f} | "
              f"{every.get(cat, 0.0):.2f} | {share:.1f}% |")
    if profiler is not None:
        import pstats
        pstats.Stats(profiler.profile).sort_stats("tottime").print_stats(a.cprofile)


if __name__ == "__main__":
    main()
