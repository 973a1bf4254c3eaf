"""The engine: a loop thread that schedules, runs the device step, samples, streams, and frees.

Thread model: callers (gRPC handlers, the offline API) only touch the thread-safe inbox (`submit`,
`abort`); the loop thread owns the scheduler, the KvCacheManager and the device runner, and makes the
runner's device its current device first (the CUDA and NPU runtimes keep one per thread). It also launches the
device plane (see Engine.start), so every device op of a one-process deployment runs on this one thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterator, TypeVar

import torch

from appliance.core.archs import architecture
from appliance.core.config import RuntimeConfig
from appliance.core.constraint import library_reason
from appliance.core.parallel import world_size
from appliance.core.prefix_reuse import exact_prefix_from
from appliance.core.request import (
    EngineUnavailableError,
    FinishReason,
    QueueFullError,
    RequestError,
    RequestLimits,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    validate_request,
)
from appliance.core.startup_report import StartupReport
from appliance.core.tables import startup_report_table
from appliance.core.tokenizer import Tokenizer
from appliance.engine.grammar import GrammarCompiler, MaskFill
from appliance.engine.kv_cache_manager import KvCacheManager
from appliance.engine.logprobs import (
    VerifyRows,
    add_prompt_logprobs,
    logits_rows,
    sampled_logprobs,
    split_draft_rows,
    verify_rows,
    wants_prompt_logits,
)
from appliance.engine.preflight import Preflight, preflight
from appliance.engine.scheduler import ScheduledSeq, Scheduler
from appliance.engine.sequence import Sequence
from appliance.engine.stats import EngineStats, GroupUsage, StatsRecorder
from npu.backends import Backend
from npu.device_group import RanksLostError, start_ranks
from npu.launcher import RUNNER_DEVICE, launch
from npu.sampler import Sampler, apply_token_bitmask, greedy_ids, token_logprobs
from npu.speculative import rejection_sample, target_probs, verify_greedy
from npu.step import SeqStep, StepBatch, StepExecutor

log = logging.getLogger("appliance.engine.loop")
T = TypeVar("T")

# A failed step is retried one request at a time: serving goes on, but a broken batch can hide behind right
# tokens. Each one is counted (Stats, /metrics) and, when this variable names a file, also appended to it (one
# line: the error), from any engine of any process that inherits it: tests/conftest.py fails a test in which a step
# failed unless the test expects it.
FAILED_STEPS_FILE = "APPLIANCE_FAILED_STEPS_FILE"
FAILED_DRAIN_S = 1.0     # after the engine failed: how long drain waits for the loop to fail its requests


def started(part: T | None) -> T:
    """A part the engine builds in start() (the loop's scheduler, KV manager, runner, sampler): refused before."""
    if part is None:
        raise EngineUnavailableError("the engine is starting")
    return part


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
    def __init__(self, rc: RuntimeConfig):
        self.rc = rc
        self.backend: Backend | None = None        # opened by the preflight (prepare)
        self.report: StartupReport | None = None
        self.kv_cache_manager: KvCacheManager | None = None
        self.scheduler: Scheduler | None = None
        self._runner: StepExecutor | None = None
        self._sampler: Sampler | None = None
        # ("add" | "abort", a Sequence), ("flush", an Event set once the loop reaches it), or ("wake", None)
        self._inbox: queue.Queue[tuple[str, Sequence | threading.Event | None]] = queue.Queue()
        # request_id -> its live Sequence. An id leaves at once when its request finishes or is aborted (not
        # when the loop gets to the abort), so a client may reuse it the moment its call ends.
        self._in_flight: dict[str, Sequence] = {}
        self._lock = threading.Lock()
        self._draining = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.limits: RequestLimits | None = None
        self.grammars: GrammarCompiler | None = None   # structured output: matchers of constrained requests
        self.steps = 0
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
        the KV manager, and loop. Waits for the launch and re-raises its error.

        The loop thread does the launch itself so that one thread runs every device op of the process: on a
        CPU, OpenMP keeps a pool of worker threads per thread that has run a parallel op, and once two pools
        exist for two cores it lets idle workers sleep almost at once, so every op then waits to wake them
        (a qwen3 decode step at 64 rows, 2 threads: 12 ms with one pool, 20 ms with two)."""
        checked = self.prepare()
        self.limits = RequestLimits(self.rc.model.layout.vocab_size, self.rc.max_model_len,
                                    checked.tokenizer.max_token_bytes)
        self.grammars = GrammarCompiler(checked.tokenizer, self.rc.model.layout.vocab_size)
        self.backend = checked.backend
        launched: Future[StartupReport] = Future()
        self._thread = threading.Thread(target=self._launch_and_loop, args=(checked, launched), name="engine-loop",
                                        daemon=True)
        self._thread.start()
        report = launched.result()
        for line in startup_report_table(report).splitlines():
            log.info(line)
        self.report = report
        return report

    def _launch_and_loop(self, checked: Preflight, launched: Future[StartupReport]) -> None:
        try:
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
            self._runner, self.kv_cache_manager = runner, manager
            runner.watch(self._device_lost)            # spawned ranks: a dead one is noticed while idle too
            self._sampler = Sampler(runner.device, self.rc.seed)
            self.scheduler = Scheduler(self.rc, manager)
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which re-raises it on the caller's thread
            launched.set_exception(exc)
            return
        launched.set_result(report)
        self._loop()

    def _prefix_reuse(self) -> tuple[int | None, str | None]:
        """Where prefix hits need a prompt of the same length (prefix_caching_ties), and the startup note."""
        if not self.rc.enable_prefix_caching:
            return None, None
        model = self.rc.model
        return exact_prefix_from(self.rc.prefix_caching_ties, architecture(model.arch).length_dependent_kv(model.layout))

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
        # The inbox is in order: once the loop reaches this marker, every abort above has been streamed.
        flushed = threading.Event()
        self._inbox.put(("flush", flushed))
        flushed.wait(FAILED_DRAIN_S if self.failure is not None else 5)

    def _device_lost(self, message: str) -> None:
        """The ranks can step together no more (any thread): record it, tell on_failure once (before any request
        hears of it, so a front end already reports the engine failed), and wake the loop to fail every request."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure, self._failed_at = message, time.monotonic()
        log.error("the engine stops: %s", message)
        if self.on_failure is not None:
            self.on_failure(message)
        self._inbox.put(("wake", None))

    def shutdown(self) -> None:
        self._draining = True
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._runner is not None:
            self._runner.shutdown()
        self._runner = None
        if self.grammars is not None:
            self.grammars.close()

    # -- requests ------------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None] | None = None) -> RequestHandle:
        if self.failure is not None:
            raise EngineUnavailableError(f"the engine has stopped: {self.failure}")
        if self.report is None or self._draining:
            raise EngineUnavailableError("the engine is starting" if self.report is None else "the engine is draining")
        prompt_ids = validate_request(request_id, prompt, params, started(self.limits), self.tokenizer.encode)
        handle = RequestHandle(self, request_id)
        seq = Sequence(request_id, prompt_ids, params, on_output or handle.outputs.put)
        handle.seq = seq
        if params.constraint is not None:     # compiled here, on the caller's thread, never on the loop's
            seq.matcher = self.grammar_compiler().matcher(params.constraint)
        try:
            self._admit(seq)
        except BaseException:
            if seq.matcher is not None:
                seq.matcher.close()
            raise
        return handle

    def _admit(self, seq: Sequence) -> None:
        request_id = seq.request_id
        with self._lock:
            if self.failure is not None:       # checked under the lock that _device_lost sets it under
                raise EngineUnavailableError(f"the engine has stopped: {self.failure}")
            if request_id in self._in_flight:
                raise RequestError("request_id", f"{request_id!r} is already in flight")
            if len(self._in_flight) >= self.rc.max_waiting_requests + self.rc.max_num_seqs:
                raise QueueFullError(
                    f"{len(self._in_flight)} requests in flight; the wait queue holds {self.rc.max_waiting_requests}")
            self._in_flight[request_id] = seq
            self._inbox.put(("add", seq))     # under the lock: an abort of an earlier holder of this id comes first

    def grammar_compiler(self) -> GrammarCompiler:
        if self.grammars is None:
            raise EngineUnavailableError("the engine is starting")
        return self.grammars

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
            self._inbox.put(("abort", seq))

    # -- introspection (tests, metrics) --------------------------------------------------------------
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def stats(self) -> EngineStats:
        """Live figures for the front ends (thread-safe; published by the loop once per iteration)."""
        return self._stats.snapshot()

    def _publish_stats(self) -> None:
        sched, kv = started(self.scheduler), started(self.kv_cache_manager)
        self._stats.publish(
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_preemptions=sched.num_preemptions,
            prefix_cache_queries=kv.prefix_stats.query_tokens, prefix_cache_hits=kv.prefix_stats.hit_tokens,
            groups=[GroupUsage(s.name, kv.num_total_blocks(s.name), kv.num_free_blocks(s.name))
                    for s in self.rc.model.cache_groups])

    # -- the loop --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        started(self.backend).set_device(RUNNER_DEVICE)
        sched = started(self.scheduler)
        by_id: dict[str, Sequence] = {}
        while not self._stop.is_set() and self.failure is None:
            self._publish_stats()
            if sched.has_work():
                try:
                    kind, item = self._inbox.get_nowait()
                except queue.Empty:
                    kind = None
            else:
                kind, item = self._inbox.get()  # idle: block until a request (or shutdown) arrives
            while kind is not None:
                if kind == "add" and isinstance(item, Sequence):
                    by_id[item.request_id] = item
                    sched.add(item)
                elif kind == "abort" and isinstance(item, Sequence) and by_id.get(item.request_id) is item:
                    self._finish(by_id.pop(item.request_id), FinishReason.ABORTED)
                elif kind == "flush" and isinstance(item, threading.Event):
                    item.set()
                try:
                    kind, item = self._inbox.get_nowait()
                except queue.Empty:
                    kind = None
            if self._stop.is_set() or self.failure is not None:
                break
            scheduled = sched.schedule()
            if not scheduled:
                continue
            for seq in self._run_step(scheduled):
                by_id.pop(seq.request_id, None)
        if self.failure is not None:          # requests still in the inbox: none can be added after the failure
            while not self._inbox.empty():
                kind, item = self._inbox.get_nowait()
                if kind == "add" and isinstance(item, Sequence):
                    by_id[item.request_id] = item
                    sched.add(item)
                elif kind == "flush" and isinstance(item, threading.Event):
                    item.set()
        for seq in list(by_id.values()):
            seq.error = self.failure
            self._finish(seq, FinishReason.ABORTED)
        if self.failure is not None:
            self._publish_stats()

    def _run_step(self, scheduled: list[ScheduledSeq]) -> list[Sequence]:
        """Run one step; a failing step is retried one sequence at a time so a bad request fails alone.

        The step's new pages go to every retry until one runs: a runner zeroes new state pages before use, and
        pages announced only to a step that failed would otherwise keep another request's stale rows."""
        kv = started(self.kv_cache_manager)
        new_pages = [kv.take_new_pages(p) for p in range(kv.num_partitions)]
        try:
            return self._execute(scheduled, new_pages)
        except RanksLostError as exc:         # no retry can run: the loop fails every request and ends
            self._device_lost(str(exc))
            return []
        except Exception as exc:
            log.exception("engine step failed; retrying its %d sequences one by one", len(scheduled))
            self._step_failed(exc)
        finished: list[Sequence] = []
        for item in scheduled:
            try:
                finished += self._execute([item], new_pages)
                new_pages = [{} for _ in new_pages]
            except RanksLostError as exc:
                self._device_lost(str(exc))
                return finished
            except Exception as exc:  # noqa: BLE001 - isolate the failing request, keep serving the rest
                self._step_failed(exc)
                item.seq.error = f"{type(exc).__name__}: {exc}"
                self._finish(item.seq, FinishReason.ABORTED)
                finished.append(item.seq)
        return finished

    def _step_failed(self, exc: Exception) -> None:
        """Count a step that raised (FAILED_STEPS_FILE)."""
        self._stats.record_failed_step()
        path = os.environ.get(FAILED_STEPS_FILE)
        if path:
            with open(path, "a", encoding="utf-8") as out:
                out.write(f"{type(exc).__name__}: {exc}".replace("\n", " ")[:500] + "\n")

    def _execute(self, scheduled: list[ScheduledSeq], new_pages: list[dict[str, list[int]]]) -> list[Sequence]:
        """One step. Several data-parallel ranks (KV partitions) each get the batch of their own sequences; the
        logits come back in partition order, so the scheduled sequences are put in that order first."""
        kv, runner, sampler = started(self.kv_cache_manager), started(self._runner), started(self._sampler)
        if kv.num_partitions > 1:
            scheduled = sorted(scheduled, key=lambda s: kv.partition_of(s.seq.request_id))
        batches = [StepBatch(seqs=[], new_pages=pages) for pages in new_pages]
        steps = []
        for s in scheduled:
            start = s.seq.num_computed_tokens
            step = SeqStep(request_id=s.seq.request_id, token_ids=s.seq.token_ids[start:start + s.num_new_tokens],
                           start_pos=start, block_tables=kv.block_tables(s.seq.request_id), sample=s.samples,
                           all_logits=wants_prompt_logits(s.seq, start, s.num_new_tokens),
                           prompt_len=s.seq.num_prompt_tokens, num_draft=s.num_draft)
            batches[kv.partition_of(s.seq.request_id) if kv.num_partitions > 1 else 0].seqs.append(step)
            steps.append((s.seq, step))
        for batch in batches:
            batch.draft_passes = max((s.num_draft for s in scheduled), default=0)
        samplers = [s for s in scheduled if s.samples]
        plain = [i for i, s in enumerate(samplers) if not s.num_draft]      # verifying rows sampled in _verify
        drawn = [samplers[i] for i in plain]
        masks = self._start_masks([s.seq for s in drawn])                  # filled while the model step runs
        if kv.num_partitions > 1:
            logits = runner.execute_partitions(batches)
        else:
            logits = runner.execute(batches[0])
        rows = logits_rows(steps)
        verified = verify_rows(steps, rows)
        emitted: dict[int, tuple[list[int], list[TokenLogprob | None]]] = {}
        if verified:
            logits, drafted = split_draft_rows(logits, batches)
            emitted = self._verify(logits, drafted, verified)
        if not rows.only_sampled:
            add_prompt_logprobs(logits, rows)
            logits = logits.index_select(0, torch.tensor(rows.sample_rows, dtype=torch.long, device=logits.device))
        if len(plain) < len(samplers):
            logits = logits.index_select(0, torch.tensor(plain, dtype=torch.long, device=logits.device))
        refused = self._mask_constrained(logits, [s.seq for s in drawn], masks)
        tokens = sampler.sample(logits, [(s.seq.request_id, s.seq.params) for s in drawn]) if drawn else []
        logprobs = sampled_logprobs(logits, [s.seq.params for s in drawn], tokens)
        self.steps += 1
        sampled = {id(s): ([token], [logprob]) for s, token, logprob in zip(drawn, tokens, logprobs)}
        out: list[tuple[ScheduledSeq, list[int], list[TokenLogprob | None]]] = [
            (s, *(emitted[id(s.seq)] if s.num_draft else sampled[id(s)])) for s in samplers]
        for s in scheduled:
            accepted = emitted[id(s.seq)][0][:-1] if s.num_draft else []     # drafts kept: their KV is written
            s.seq.num_computed_tokens += s.num_new_tokens + len(accepted)
            kv.commit(s.seq.request_id, s.seq.num_computed_tokens, s.seq.token_ids + accepted if accepted else None)
        self._record_speculation(scheduled, out)
        first = {id(s.seq) for s in samplers if not s.seq.output_token_ids}
        finished, appended = [], 0
        for s, new, new_logprobs in out:
            if id(s.seq) in refused:
                self._refuse(s.seq, refused[id(s.seq)])
                finished.append(s.seq)
                continue
            for token, logprob in zip(new, new_logprobs):
                appended += 1
                if self._append(s.seq, token, logprob):      # a stop among accepted drafts ends the row there
                    finished.append(s.seq)
                    break
        self._record_tokens([s.seq for s in samplers], first, appended)
        return finished

    def _start_masks(self, seqs: list[Sequence]) -> tuple[list[int], MaskFill] | None:
        """Begin filling the masks of the constrained rows (seqs[i] is row i) off this thread; None without any."""
        rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        if not rows:
            return None
        return rows, self.grammar_compiler().start_fill([m for m in (seqs[i].matcher for i in rows) if m is not None])

    def _mask_constrained(self, logits: torch.Tensor, seqs: list[Sequence],
                          masks: tuple[list[int], MaskFill] | None) -> dict[int, str]:
        """Mask the logits of the constrained rows (seqs[i] is row i) to what their grammars allow next, before
        anything reads them: greedy, sampling and the sampled tokens' logprobs (which are therefore of the masked
        distribution, as vLLM's, whose grammar bitmask is applied before its sampler). A step without a
        constrained row builds nothing. The rows whose masks were refused (over the budget, or their grammar
        stopped with an error) are left unmasked and returned, by id of their sequence, with why."""
        if masks is None:
            return {}
        rows, fill = masks
        bitmask, refused = fill.result()
        kept = [k for k in range(len(rows)) if k not in refused]
        if kept:                              # (a copy of the kept rows: a refused row's fill may still write)
            kept_masks = bitmask[kept] if refused else bitmask
            apply_token_bitmask(logits, [rows[k] for k in kept], torch.from_numpy(kept_masks))
        return {id(seqs[rows[k]]): why for k, why in refused.items()}

    def _refuse(self, seq: Sequence, why: str) -> None:
        """End a constrained request whose grammar the library gave up on: the request's fault, not the engine's
        (the front ends answer 400 / INVALID_ARGUMENT naming its field)."""
        seq.error = why
        seq.error_field = seq.params.constraint.field if seq.params.constraint is not None else "constraint"
        self._finish(seq, FinishReason.ABORTED)

    def _verify(self, logits: torch.Tensor, drafted: torch.Tensor, verified: list[VerifyRows]
                ) -> dict[int, tuple[list[int], list[TokenLogprob | None]]]:
        """Each verifying row's emitted tokens (the accepted drafts and one more, npu/speculative.py) and their
        logprobs when asked, by id of its sequence. A draft is the argmax of its drafter row."""
        sampler = self._sampler
        if not isinstance(sampler, Sampler):
            raise RuntimeError("the engine has not started: no sampler")
        out: dict[int, tuple[list[int], list[TokenLogprob | None]]] = {}
        for v in verified:
            target = logits[v.first:v.first + v.num_draft + 1]
            drafts = greedy_ids(drafted[v.first_draft:v.first_draft + v.num_draft])
            params = v.seq.params
            if params.greedy:
                tokens = verify_greedy(greedy_ids(target), drafts)
            else:
                gen = sampler.generator(v.seq.request_id, params)
                tokens = rejection_sample(target_probs(target, params), drafts, None, gen)
            logprobs: list[TokenLogprob | None] = [None] * len(tokens)
            if params.logprobs is not None:
                logprobs = list(token_logprobs(target[:len(tokens)], tokens, [params.logprobs] * len(tokens)))
            out[id(v.seq)] = (tokens, logprobs)
        return out

    def _record_speculation(self, scheduled: list[ScheduledSeq],
                            out: list[tuple[ScheduledSeq, list[int], list[TokenLogprob | None]]]) -> None:
        """Drafts proposed and accepted (a prefix of them) by each verifying row this step, for Stats and /metrics."""
        proposed = [s.num_draft for s in scheduled if s.num_draft]
        if proposed:
            accepted = [len(new) - 1 for s, new, _ in out if s.num_draft]
            self._stats.record_speculation(proposed, accepted)

    def _record_tokens(self, seqs: list[Sequence], first: set[int], num_tokens: int) -> None:
        """Count the num_tokens this step appended for `seqs` (ids in `first`: their first tokens) and their
        latencies: one gap per sequence and step, however many tokens a verifying row emitted."""
        now = time.monotonic()
        starting = [seq for seq in seqs if id(seq) in first]
        self._stats.record_step(
            prompt_tokens=sum(seq.num_prompt_tokens for seq in starting),
            first_token_latencies=[now - seq.arrival_time for seq in starting],
            inter_token_latencies=[now - seq.last_token_time for seq in seqs
                                   if id(seq) not in first and seq.last_token_time is not None],
            generation_tokens=num_tokens)
        for seq in seqs:
            seq.last_token_time = now

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Append a sampled token, apply stop rules, stream the delta. True when the sequence finished."""
        p = seq.params
        seq.append_token(token, logprob)
        grammar_done = False
        if seq.matcher is not None:
            if not seq.matcher.accept(token):    # the mask allowed it: the library hit one of its limits
                self._refuse(seq, f"the grammar library stopped it at output token {len(seq.output_token_ids)}: "
                                  f"{library_reason(seq.matcher.error())}")
                return True
            grammar_done = seq.matcher.terminated
        if token == self.tokenizer.eos_token_id and not p.ignore_eos:
            seq.finish_reason = FinishReason.EOS
        elif token in p.stop_token_ids:
            seq.finish_reason = FinishReason.STOP
        elif grammar_done:                    # the grammar's last token is output: it keeps its text
            seq.finish_reason = FinishReason.STOP
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.rc.max_model_len:
            seq.finish_reason = FinishReason.LENGTH
        ends_without_text = seq.finish_reason is FinishReason.EOS or token in p.stop_token_ids
        if not ends_without_text:             # an EOS or stop token id adds no text
            detokenizer = seq.detokenizer
            if detokenizer is None:
                detokenizer = seq.detokenizer = self.tokenizer.detokenizer(seq.prompt_token_ids)
            delta = detokenizer.push(token)
            seq.text += delta
            if p.stop:
                # Only the new text, plus what a stop string could straddle, can hold a new match.
                longest = max(len(s) for s in p.stop)
                start = max(0, len(seq.text) - len(delta) - longest + 1)
                hits = [i for i in (seq.text.find(s, start) for s in p.stop) if i >= 0]
                if hits:
                    seq.text = seq.text[:min(hits)]
                    seq.finish_reason = FinishReason.STOP
        if seq.finish_reason is not None:
            self._finish(seq, seq.finish_reason, [token], seq.text[seq.num_text_emitted:])
            return True
        # Hold back a tail that may still become a stop string.
        visible = len(seq.text)
        if p.stop:
            visible -= max(len(s) for s in p.stop) - 1
        new_text = seq.text[seq.num_text_emitted:max(visible, seq.num_text_emitted)]
        seq.num_text_emitted += len(new_text)
        seq.emit([token], new_text)
        return False

    def _finish(self, seq: Sequence, reason: FinishReason, new_tokens: list[int] | None = None,
                new_text: str = "") -> None:
        seq.finish_reason = reason
        started(self.scheduler).remove(seq)
        started(self._sampler).release(seq.request_id)
        if seq.matcher is not None:
            seq.matcher.close()
            seq.matcher = None
        seq.num_text_emitted += len(new_text)
        with self._lock:
            if self._in_flight.get(seq.request_id) is seq:
                del self._in_flight[seq.request_id]
        self._stats.record_finished(reason.value, time.monotonic() - seq.arrival_time)
        seq.emit(new_tokens or [], new_text)
