"""The engine as the front ends and the offline API use it: prepare, start, submit, drain, shutdown, stats.

States: created -> prepared (prepare(): the startup checks that need no device) -> started (start(): the core is
built and loops, core.py) -> draining (drain(): nothing admitted) -> shut down; failed once the device plane is lost
for good (a rank died): every request fails with `failure`, none is admitted.

Thread model: callers (gRPC handlers, the offline API) only touch the request table here (submit, abort: under one
lock) and the core's inbox; the core's thread owns the scheduler, the KvCacheManager and the device runner, and makes
the runner's device its current device first (the CUDA and NPU runtimes keep one per thread). It also launches the
device plane (see Engine.start), so every device op of a one-process deployment runs on this one thread.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Iterator

from appliance.core.archs import architecture
from appliance.core.config import RuntimeConfig
from appliance.core.parallel import world_size
from appliance.core.prefix_reuse import exact_prefix_from
from appliance.core.request import (
    EngineUnavailableError,
    QueueFullError,
    RequestError,
    RequestLimits,
    RequestOutput,
    SamplingParams,
    validate_request,
)
from appliance.core.startup_report import StartupReport
from appliance.core.tables import startup_report_table
from appliance.core.tokenizer import Tokenizer
from appliance.engine.core import EngineCore
from appliance.engine.grammar import GrammarCompiler
from appliance.engine.kv_cache_manager import KvCacheManager
from appliance.engine.output import OutputProcessor, OutputSink
from appliance.engine.preflight import Preflight, preflight
from appliance.engine.scheduler import Scheduler
from appliance.engine.sequence import Sequence
from appliance.engine.stats import EngineStats, StatsRecorder
from npu.device_group import start_ranks
from npu.launcher import RUNNER_DEVICE, launch
from npu.sampler import Sampler
from npu.step import StepExecutor

log = logging.getLogger(__name__)

FAILED_DRAIN_S = 1.0     # after the engine failed: how long drain waits for the loop to fail its requests


class RequestHandle:
    """Iterate to receive a request's deltas (blocking); the last one carries finish_reason and usage."""

    def __init__(self, engine: "Engine", request_id: str):
        self.engine = engine
        self.request_id = request_id
        self.outputs: queue.Queue[RequestOutput] = queue.Queue()
        self.seq: Sequence | None = None

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self.outputs.get()
            yield out
            if out.finished:
                return

    def abort(self) -> None:
        """Abort this request (never a later one that reuses its id)."""
        self.engine.abort_sequence(self.seq)


class Engine:
    def __init__(self, rc: RuntimeConfig, output_sink: Callable[[Tokenizer], OutputSink] = OutputProcessor):
        """output_sink: makes where the core's CoreOutputs go (default: text and RequestOutputs here; the core
        process sends them to its front end instead)."""
        self.rc = rc
        self._output_sink = output_sink
        self.report: StartupReport | None = None        # set by start()
        self.limits: RequestLimits | None = None        # set by start()
        self._core: EngineCore | None = None             # set by start(): the only part that waits for it
        # request_id -> its live Sequence. An id leaves at once when its request finishes or is aborted (not
        # when the loop gets to the abort), so a client may reuse it the moment its call ends.
        self._in_flight: dict[str, Sequence] = {}
        self._lock = threading.Lock()
        self._draining = False
        self._preflight: Preflight | None = None
        self._stats = StatsRecorder()
        # Set once the device plane is lost for good (a rank died): every request fails with it, none is admitted.
        self.failure: str | None = None
        self._failed_at = 0.0
        self.on_failure: Callable[[str], None] | None = None   # told once, first (a server: health NOT_SERVING, exit)

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.report is not None and not self._draining

    @property
    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer, which the preflight loads (run now if it has not run yet)."""
        return self.prepare().tokenizer

    def prepare(self) -> Preflight:
        """Run the startup checks that need no device work (appliance.engine.preflight), once; a server calls
        this before binding its port, start() otherwise."""
        if self._preflight is None:
            self._preflight = preflight(self.rc)
        return self._preflight

    def start(self) -> StartupReport:
        """Preflight, then on the loop thread: launch the device plane (weights, profile, plan, allocate), size
        the KV manager, build the core, and loop. Waits for the launch and re-raises its error.

        The loop thread does the launch itself so that one thread runs every device op of the process: on a
        CPU, OpenMP keeps a pool of worker threads per thread that has run a parallel op, and once two pools
        exist for two cores it lets idle workers sleep almost at once, so every op then waits to wake them
        (a qwen3 decode step at 64 rows, 2 threads: 12 ms with one pool, 20 ms with two)."""
        checked = self.prepare()
        self.limits = RequestLimits(self.rc.model.layout.vocab_size, self.rc.max_model_len,
                                    checked.tokenizer.max_token_bytes)
        grammars = GrammarCompiler(checked.tokenizer, self.rc.model.layout.vocab_size)
        try:
            core, report = EngineCore.launch(lambda: self._build_core(checked, grammars))
        except BaseException:
            grammars.close()
            raise
        for line in startup_report_table(report).splitlines():
            log.info(line)
        self._core, self.report = core, report
        return report

    def _build_core(self, checked: Preflight, grammars: GrammarCompiler) -> tuple[EngineCore, StartupReport]:
        """On the loop thread: the device plane, the KV manager sized by its plan, and the core over them."""
        runner: StepExecutor
        if world_size(self.rc.parallel) > 1:       # one process per device: this one owns the others' steps
            runner, report = start_ranks(self.rc, checked.backend, checked.runner)
        else:
            runner, report = launch(self.rc, checked.backend, checked.runner)
        keyed_from, note = self._prefix_reuse()
        manager = KvCacheManager(self.rc.model.cache_groups, self.rc.block_size,
                                 enable_prefix_caching=self.rc.enable_prefix_caching,
                                 num_partitions=self.rc.parallel.data_parallel_size or 1,
                                 length_keyed_from=keyed_from)
        manager.initialize(report.plan.num_blocks)
        if note is not None:
            report = dataclasses.replace(report, notes=(*report.notes, note))
        core = EngineCore(self.rc, runner, manager, Scheduler(self.rc, manager, checked.tokenizer.eos_token_id),
                          Sampler(runner.device, self.rc.seed), grammars, self._output_sink(checked.tokenizer),
                          self._stats, self)
        if core.overlap:
            report = dataclasses.replace(report, notes=(
                *report.notes, "async scheduling: on (the next step is scheduled while one runs; async_scheduling)"))
        runner.watch(core.device_lost)             # spawned ranks: a dead one is noticed while idle too
        checked.backend.set_device(RUNNER_DEVICE)
        return core, report

    def _prefix_reuse(self) -> tuple[int | None, str | None]:
        """Where prefix hits need a prompt of the same length (prefix_caching_ties), and the startup note."""
        if not self.rc.enable_prefix_caching:
            return None, None
        model = self.rc.model
        return exact_prefix_from(self.rc.prefix_caching_ties, architecture(model.arch).length_dependent_kv(model.layout))

    def _started(self) -> EngineCore:
        if self._core is None:
            raise EngineUnavailableError("the engine is starting")
        return self._core

    def drain(self, grace_s: float) -> None:
        """Stop admitting; let in-flight requests finish for up to grace_s, then abort the rest. After a failure
        (a rank lost) nothing finishes: the loop fails what it holds at once, or cannot (its step waits for a hung
        rank it could not kill), so the wait is FAILED_DRAIN_S."""
        self._draining = True
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._in_flight:
                    return
                if self.failure is not None:
                    deadline = min(deadline, self._failed_at + FAILED_DRAIN_S)
            time.sleep(0.01)
        with self._lock:
            remaining = list(self._in_flight.values())
        for seq in remaining:
            self.abort_sequence(seq)
        if self._core is not None:   # the inbox is in order: once the loop reaches this, every abort was streamed
            self._core.flush().wait(FAILED_DRAIN_S if self.failure is not None else 5)

    def device_lost(self, message: str) -> None:
        """The ranks can step together no more (any thread; the core then fails every request): record it, and
        tell on_failure once, before any request hears of it, so a front end already reports the engine failed."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure, self._failed_at = message, time.monotonic()
        log.error("the engine stops: %s", message)
        if self.on_failure is not None:
            self.on_failure(message)

    def shutdown(self) -> None:
        self._draining = True
        if self._core is not None:
            self._core.shutdown()

    # -- requests ------------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None] | None = None) -> RequestHandle:
        if self.failure is not None:
            raise EngineUnavailableError(f"the engine has stopped: {self.failure}")
        if self._core is None or self.limits is None or self._draining:
            raise EngineUnavailableError("the engine is starting" if self._core is None else "the engine is draining")
        prompt_ids = validate_request(request_id, prompt, params, self.limits, self.tokenizer.encode)
        handle = RequestHandle(self, request_id)
        seq = Sequence(request_id, prompt_ids, params, on_output or handle.outputs.put)
        handle.seq = seq
        if params.constraint is not None:     # compiled here, on the caller's thread, never on the loop's
            seq.matcher = self._core.grammars.matcher(params.constraint)
        try:
            self._admit(self._core, seq)
        except BaseException:
            if seq.matcher is not None:
                seq.matcher.close()
            raise
        return handle

    def _admit(self, core: EngineCore, seq: Sequence) -> None:
        request_id = seq.request_id
        with self._lock:
            if self.failure is not None:       # checked under the lock that device_lost sets it under
                raise EngineUnavailableError(f"the engine has stopped: {self.failure}")
            if request_id in self._in_flight:
                raise RequestError("request_id", f"{request_id!r} is already in flight")
            if len(self._in_flight) >= self.rc.max_waiting_requests + self.rc.max_num_seqs:
                raise QueueFullError(
                    f"{len(self._in_flight)} requests in flight; the wait queue holds {self.rc.max_waiting_requests}")
            self._in_flight[request_id] = seq
            core.add(seq)                     # under the lock: an abort of an earlier holder of this id comes first

    def abort(self, request_id: str) -> None:
        """Abort the request now holding request_id, if any."""
        with self._lock:
            seq = self._in_flight.get(request_id)
        self.abort_sequence(seq)

    def abort_sequence(self, seq: Sequence | None) -> None:
        """Free seq's request_id at once; the loop finishes the sequence (frees its blocks) at its next step."""
        with self._lock:
            if seq is None or self._in_flight.get(seq.request_id) is not seq:
                return                        # finished already, or the id now belongs to a newer request
            del self._in_flight[seq.request_id]
            self._started().abort(seq)

    def stop(self, request_id: str, kept_tokens: int | None = None) -> None:
        """Finish the request holding request_id as STOP (a front end's processor found a stop string and ended its
        stream): its id is free at once, the loop frees its blocks and counts it stopped at its next step.
        kept_tokens: the output tokens the front end delivered (generated tokens beyond them are not counted)."""
        with self._lock:
            seq = self._in_flight.pop(request_id, None)
            if seq is not None:
                self._started().stop(seq, kept_tokens)

    def release(self, seq: Sequence) -> None:
        """The core finished seq: its request_id is free (unless an abort freed it already)."""
        with self._lock:
            if self._in_flight.get(seq.request_id) is seq:
                del self._in_flight[seq.request_id]

    # -- introspection (tests, metrics, benchmarks) ----------------------------------------------------
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def stats(self) -> EngineStats:
        """Live figures for the front ends (thread-safe; published by the loop once per iteration)."""
        return self._stats.snapshot()

    @property
    def steps(self) -> int:
        """Steps run (a retried step's sequences count one each)."""
        return self._core.steps if self._core is not None else 0

    @property
    def steps_ahead(self) -> int:
        """Steps scheduled while the step before them ran (async scheduling; 0 without it)."""
        return self._core.steps_ahead if self._core is not None else 0

    @property
    def grammars(self) -> GrammarCompiler:
        return self._started().grammars

    def grammar_compiler(self) -> GrammarCompiler:
        return self._started().grammars

    @property
    def scheduler(self) -> Scheduler:
        """The core's scheduler (read it only while the loop is idle, or for figures a race cannot hurt)."""
        return self._started().scheduler

    @property
    def kv_cache_manager(self) -> KvCacheManager:
        return self._started().kv
