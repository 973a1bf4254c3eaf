"""The engine core: one thread that owns the scheduler, the KV manager, the device runner and the sampler, and loops.

States: built (on its own thread: EngineCore.launch, which runs the device launch there too) -> looping -> stopped
(shutdown: after its current step; every request it still holds ends ABORTED), or failed (the device plane is lost
for good: every request it holds ends ABORTED naming the failure, none is added after). Callers never touch its parts: they put requests in its inbox (add, abort, flush, wake),
which the loop reads in order.

Each iteration publishes the live figures, takes the inbox (blocking while there is no work), then steps:

    schedule -> execute -> sample -> update -> output

the scheduler picks the rows (scheduler.py); the runner computes their logits from the step's input
(step_input.py); the sampler draws each sampling row's token (with the grammar masks of constrained rows, and the
verify of speculative rows: speculation.py); the scheduler commits the tokens and applies the core's stop rules
(Scheduler.update_from_output); the output sink takes the CoreOutputs (output.py: in one process the
OutputProcessor, which makes text and RequestOutputs; in split mode a sender to the front end's), and the core
finishes what ended before the outputs are delivered. A failing step is retried one sequence at a time.

Async scheduling (rc.async_scheduling; on for accelerators): a step is launched (its device work queued, its tokens
drawn on the device and their copy to the host started) and read one iteration later, so the host work between two
steps overlaps the device's. With one process (a runner that takes fed tokens, ModelRunner.feeds_tokens):

    iteration N+1:  inbox -> schedule N+1 -> launch N+1 -> read N's tokens (the stop rules) -> commit N+1 -> output N

Step N's sampling rows hold an unresolved token while step N+1 is scheduled (Scheduler.commit); N+1 is launched
before N is read, each such row fed N's sampled id on the device (StepBatch.fed), so the device goes from N to N+1
without waiting for the host. A row that N's token ends (EOS, a stop token id) is computed once in vain in N+1 and
skipped when N+1 is read; a length limit is known ahead, so no row is scheduled past it. With several ranks (the
batch is sent to them, not fed), or when N's logits are still needed (logprobs asked: a decode graph's logits are
overwritten by the next replay), N is read first:

    iteration N+1:  inbox -> schedule N+1 -> read N's tokens -> launch N+1 -> output N

and N's rows that ended leave N+1 before it is launched. Either way every greedy output is the synchronous loop's. A
row that ends while its step runs (an abort, a stop string found in the output) is skipped when the step is read. A
step with drafts or constrained rows runs synchronously (N's output first): its next step needs its tokens to be
scheduled (drafts) or masked (grammars).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from appliance.core.config import RuntimeConfig
from appliance.core.request import FinishReason, TokenLogprob
from appliance.core.startup_report import StartupReport
from appliance.engine.grammar import GrammarCompiler, MaskFill
from appliance.engine.kv_cache_manager import KvCacheManager
from appliance.engine.logprobs import (
    LogitsRows,
    add_prompt_logprobs,
    logits_rows,
    sampled_logprobs,
    split_draft_rows,
    verify_rows,
)
from appliance.engine.output import CoreOutput, OutputSink
from appliance.engine.scheduler import ScheduledSeq, Scheduler, SeqUpdate
from appliance.engine.sequence import SeqStatus, Sequence
from appliance.engine.speculation import Emitted, record_speculation, verify
from appliance.engine.stats import GroupUsage, StatsRecorder
from appliance.engine.step_input import StepInput, build_step
from npu.device_group import RanksLostError
from npu.sampler import HostCopy, Sampler, apply_token_bitmask
from npu.step import StepExecutor

log = logging.getLogger(__name__)

# A failed step is retried one request at a time: serving goes on, but a broken batch can hide behind right
# tokens. Each one is counted (Stats, /metrics) and, when this variable names a file, also appended to it (one
# line: the error), from any engine of any process that inherits it: tests/conftest.py fails a test in which a step
# failed unless the test expects it.
FAILED_STEPS_FILE = "APPLIANCE_FAILED_STEPS_FILE"

Masks = tuple[list[int], MaskFill] | None     # the constrained rows of a step and their masks being filled


@dataclass(frozen=True)
class LaunchedStep:
    """Async scheduling: a step whose device work is queued, its tokens drawn on the device and on their way to the
    host (copy), not read yet. ids: those tokens on the device, one per row of step.drawn (what the next step can be
    fed); rows / sampled: where its sampling rows are in logits, and their logits."""

    step: StepInput
    logits: torch.Tensor
    rows: LogitsRows
    sampled: torch.Tensor
    ids: torch.Tensor
    copy: HostCopy

    @property
    def reads_logits(self) -> bool:
        """Whether reading it needs its logits (logprobs asked): a decode graph's logits are overwritten by the next
        replay, so such a step is read before the next one launches."""
        return not self.rows.only_sampled or any(s.seq.params.logprobs is not None for s in self.step.drawn)


@dataclass(frozen=True)
class ReadStep:
    """A step whose tokens are read and committed to its sequences (resolve), its output not yet handed on."""

    updates: list[SeqUpdate]
    sampled: dict[str, Emitted]

    def ending(self) -> set[int]:
        """ids of the sequences its stop rules ended."""
        return {id(u.seq) for u in self.updates if u.finish_reason is not None}


def still_live(scheduled: list[ScheduledSeq], read: ReadStep | None) -> list[ScheduledSeq]:
    """The rows of a step scheduled before `read` was read that it did not end (nor anything else since)."""
    gone = read.ending() if read is not None else set()
    return [s for s in scheduled if id(s.seq) not in gone and s.seq.status is not SeqStatus.FINISHED]


def async_scheduling(rc: RuntimeConfig, device: torch.device) -> bool:
    """rc.async_scheduling, or when null: on off the CPU without speculative decoding. A CPU step runs on the loop's
    thread, so there is no device work to overlap; a verifying row's next step needs its drafts' tokens."""
    if rc.async_scheduling is not None:
        return rc.async_scheduling
    return device.type != "cpu" and rc.speculative.method is None


class RequestTable(Protocol):
    """Where the core's requests were admitted (the Engine): it is told of each request that finished (its id is
    free again) and of a device plane lost for good, which it records as `failure`."""

    failure: str | None

    def release(self, seq: Sequence) -> None: ...

    def device_lost(self, message: str) -> None: ...


class EngineCore:
    def __init__(self, rc: RuntimeConfig, runner: StepExecutor, kv: KvCacheManager, scheduler: Scheduler,
                 sampler: Sampler, grammars: GrammarCompiler, outputs: OutputSink, stats: StatsRecorder,
                 requests: RequestTable):
        """Built on the thread that will loop (launch): the one that runs every device op of the process."""
        self.rc = rc
        self.runner, self.kv, self.scheduler, self.sampler = runner, kv, scheduler, sampler
        self.grammars, self.outputs, self.stats, self.requests = grammars, outputs, stats, requests
        self.thread = threading.current_thread()
        self.steps = 0
        self.overlap = async_scheduling(rc, runner.device)     # launch a step, read it one iteration later
        # ... and launch the next before reading it, its rows fed the sampled ids on the device (one process)
        self.feeding = self.overlap and getattr(runner, "feeds_tokens", False) and kv.num_partitions == 1
        self.steps_ahead = 0        # steps scheduled while the step before them ran (async scheduling)
        # ("add" | "abort" | "stop", a Sequence), ("flush", an Event set once the loop reaches it), or ("wake", None)
        self._inbox: queue.Queue[tuple[str, Sequence | threading.Event | None]] = queue.Queue()
        self._live: dict[str, Sequence] = {}      # the loop's requests by id (added, not yet finished)
        self._stop = threading.Event()
        self._closed = False

    @staticmethod
    def launch(build: Callable[[], tuple[EngineCore, StartupReport]]) -> tuple[EngineCore, StartupReport]:
        """Start the loop thread, which calls build() (the device launch and the core) and then loops; wait for
        build and re-raise its error on the caller's thread."""
        launched: Future[tuple[EngineCore, StartupReport]] = Future()

        def build_and_loop() -> None:
            try:
                core, report = build()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which re-raises it
                launched.set_exception(exc)
                return
            launched.set_result((core, report))
            core.run()

        threading.Thread(target=build_and_loop, name="engine-loop", daemon=True).start()
        return launched.result()

    # -- the inbox (any thread) ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._inbox.put(("add", seq))

    def abort(self, seq: Sequence) -> None:
        """End seq ABORTED at the loop's next iteration, unless it has finished by then."""
        self._inbox.put(("abort", seq))

    def stop(self, seq: Sequence, kept_tokens: int | None = None) -> None:
        """End seq STOP at the loop's next iteration, unless it has finished by then: a front end's output processor
        found a stop string and has streamed its end already (split mode), so nothing more goes out for it.
        kept_tokens: the output tokens it delivered; the loop uncounts those it generated beyond them."""
        seq.stop_kept_tokens = kept_tokens
        self._inbox.put(("stop", seq))

    def flush(self) -> threading.Event:
        """An event set once the loop has handled everything put in the inbox before it."""
        flushed = threading.Event()
        self._inbox.put(("flush", flushed))
        return flushed

    def wake(self) -> None:
        self._inbox.put(("wake", None))

    def device_lost(self, message: str) -> None:
        """The ranks can step together no more (any thread): tell the request table, wake the loop to fail all."""
        self.requests.device_lost(message)
        self.wake()

    def shutdown(self) -> None:
        """Stop the loop after its current step and wait for it (30 s at most); then shut the runner down and close
        the grammar compiler (once)."""
        self._stop.set()
        self.wake()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=30)
        if not self._closed:
            self._closed = True
            self.runner.shutdown()
        self.grammars.close()

    # -- the loop (its thread) ------------------------------------------------------------------------
    def run(self) -> None:
        """Loop on the core's thread until shutdown or the failure: publish the figures, take the inbox, schedule,
        and step (execute -> sample -> update -> output; with async scheduling split over two iterations, see the
        module docstring); then end what is left (_end_all)."""
        launched: LaunchedStep | None = None
        while not self._stop.is_set() and self.requests.failure is None:
            self._publish_stats()
            # idle: block until a request (or shutdown)
            self._take_inbox(wait=launched is None and not self.scheduler.has_work())
            if self._stop.is_set() or self.requests.failure is not None:
                break
            scheduled = self.scheduler.schedule()
            if (launched is not None and self.feeding and not launched.reads_logits and scheduled
                    and self._can_overlap(scheduled)):
                launched = self._launch_fed(scheduled, launched)
                if self.requests.failure is not None:
                    break
                continue
            read, ahead = None, launched is not None      # (scheduled while the launched step ran)
            if launched is not None:            # the previous step's tokens: its rows that end leave this step
                read, launched = self._read(launched), None
                if self.requests.failure is not None:      # the ranks were lost while it ran
                    break
                scheduled = still_live(scheduled, read)
            if not (scheduled and self.overlap and self._can_overlap(scheduled)):
                if read is not None:            # (before the next step's outputs, which may be the same rows')
                    self._finish(self._output(read.updates, read.sampled))
                if scheduled:
                    self._finish(self._run_step(scheduled))
                continue
            new_pages = [self.kv.take_new_pages(p) for p in range(self.kv.num_partitions)]
            launched = self._launch(scheduled, new_pages)
            if ahead and launched is not None:
                self.steps_ahead += 1
            if read is not None:                # while the launched step runs
                self._finish(self._output(read.updates, read.sampled))
            if launched is None and self.requests.failure is None:    # it failed to launch: one by one, in turn
                self._finish(self._retry(scheduled, new_pages))
        if launched is not None and self.requests.failure is None:     # shutdown: the step it ran is delivered
            read = self._read(launched)
            if read is not None:
                self._finish(self._output(read.updates, read.sampled))
        self._end_all(self.requests.failure)

    def _finish(self, finished: list[Sequence]) -> None:
        for seq in finished:
            self._live.pop(seq.request_id, None)

    @staticmethod
    def _can_overlap(scheduled: list[ScheduledSeq]) -> bool:
        """A step whose next one can be scheduled before its tokens are known: no drafts to verify, no constrained
        row to mask (a grammar must accept its token before the next mask)."""
        return not any(s.num_draft or (s.samples and s.seq.matcher is not None) for s in scheduled)

    def _launch_fed(self, scheduled: list[ScheduledSeq], previous: LaunchedStep) -> LaunchedStep | None:
        """Launch the next step before reading `previous`, its rows that wait for previous's tokens fed them on the
        device; then read previous, commit the next step's rows still live, and make previous's output while the next
        step runs. A row that ended with previous's token is computed once in vain and skipped when read. The next
        step, or None if it failed to launch (then retried one sequence at a time, after previous's output)."""
        new_pages = [self.kv.take_new_pages(p) for p in range(self.kv.num_partitions)]
        launched = self._launch(scheduled, new_pages, (previous.ids, previous.step.drawn), commit=False)
        read = self._read(previous)
        if self.requests.failure is not None:
            return None
        live = still_live(scheduled, read)
        if launched is not None:
            still = {id(s) for s in live}
            self.scheduler.commit([s for s in launched.step.scheduled if id(s) in still])
            self.steps_ahead += 1
        if read is not None:
            self._finish(self._output(read.updates, read.sampled))
        if launched is None:
            self._finish(self._retry(live, new_pages))
        return launched

    def _launch(self, scheduled: list[ScheduledSeq], new_pages: list[dict[str, list[int]]],
                fed_from: tuple[torch.Tensor, list[ScheduledSeq]] | None = None, commit: bool = True
                ) -> LaunchedStep | None:
        """Queue a step's device work, its sampling and the copy of its tokens to the host, and (commit) record what
        it computes; its tokens are read next iteration (_read). fed_from: the ids of the launched step before it
        and their rows, for its rows still waiting for those (build_step). None when it failed to launch (counted;
        the caller retries it one sequence at a time) or the ranks are lost."""
        try:
            step = build_step(scheduled, self.kv, new_pages, fed_from)
            logits = self._execute(step)
            rows = logits_rows(step.steps)
            sampled = rows.sampled(logits)
            ids = self.sampler.sample_ids(sampled, [(s.seq.request_id, s.seq.params) for s in step.drawn])
        except RanksLostError as exc:
            self.device_lost(str(exc))
            return None
        except Exception as exc:  # noqa: BLE001 - retried by the caller, one request at a time
            log.exception("engine step failed; retrying its %d sequences one by one", len(scheduled))
            self._step_failed(exc)
            return None
        if commit:
            self.scheduler.commit(step.scheduled)
        return LaunchedStep(step, logits, rows, sampled, ids, HostCopy(ids))

    def _read(self, launched: LaunchedStep) -> ReadStep | None:
        """Wait for a launched step's tokens (their copy to the host), and apply the stop rules to its rows still
        live. A step that fails here fails its live rows (its tokens are committed: no retry can recompute them)."""
        step = launched.step
        try:
            sampled = self._collect(launched)
        except RanksLostError as exc:
            self.device_lost(str(exc))
            return None
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving the rest
            log.exception("reading an engine step failed; its %d sequences fail", len(step.scheduled))
            self._step_failed(exc)
            for s in step.scheduled:
                if s.seq.status is not SeqStatus.FINISHED:
                    s.seq.error = f"{type(exc).__name__}: {exc}"
                    self._finish_aborted(s.seq)
                    self._live.pop(s.seq.request_id, None)
            return None
        return ReadStep(self.scheduler.resolve(step.samplers, _tokens(sampled), {}), sampled)

    def _collect(self, launched: LaunchedStep) -> dict[str, Emitted]:
        """A launched step's tokens from the host copy (waiting for it), with the logprobs asked, by request id of
        its rows still live (one that ended while the step ran is left out); prompt logprobs are recorded."""
        tokens = launched.copy.tolist()
        add_prompt_logprobs(launched.logits, launched.rows)
        drawn = launched.step.drawn
        live = [i for i, s in enumerate(drawn) if s.seq.status is not SeqStatus.FINISHED]
        params = [drawn[i].seq.params for i in live]
        sampled = launched.sampled
        if any(p.logprobs is not None for p in params) and len(live) < len(drawn):
            sampled = sampled.index_select(0, torch.tensor(live, dtype=torch.long, device=sampled.device))
        logprobs = sampled_logprobs(sampled, params, [tokens[i] for i in live])
        self.steps += 1
        return {drawn[i].seq.request_id: ([tokens[i]], [logprob]) for i, logprob in zip(live, logprobs)}

    def _take_inbox(self, wait: bool) -> None:
        """Handle every item in the inbox, in order; first wait for one when `wait`."""
        try:
            kind, item = self._inbox.get(block=wait)
            while True:
                if kind == "add" and isinstance(item, Sequence):
                    self._add(item)
                elif kind == "abort" and isinstance(item, Sequence) and self._live.get(item.request_id) is item:
                    self._finish_aborted(self._live.pop(item.request_id))
                elif kind == "stop" and isinstance(item, Sequence) and self._live.get(item.request_id) is item:
                    if item.stop_kept_tokens is not None:       # (before it counts as finished: one snapshot)
                        self.stats.discount_tokens(max(len(item.output_token_ids) - item.stop_kept_tokens, 0))
                    self._free(self._live.pop(item.request_id), FinishReason.STOP)
                elif kind == "flush" and isinstance(item, threading.Event):
                    item.set()
                kind, item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _add(self, seq: Sequence) -> None:
        self._live[seq.request_id] = seq
        self.scheduler.add(seq)
        self.outputs.add_request(seq.request_id, seq.prompt_token_ids, seq.params, seq.on_output)

    def _end_all(self, failure: str | None) -> None:
        """After the loop (shutdown, or the failure): every request it holds ends ABORTED (with the failure, if
        any). After a failure the requests still in the inbox join them first: none can be added after it."""
        if failure is not None:
            while not self._inbox.empty():
                kind, item = self._inbox.get_nowait()
                if kind == "add" and isinstance(item, Sequence):
                    self._add(item)
                elif kind == "flush" and isinstance(item, threading.Event):
                    item.set()
        for seq in list(self._live.values()):
            seq.error = failure
            self._finish_aborted(seq)
        if failure is not None:
            self._publish_stats()

    def _run_step(self, scheduled: list[ScheduledSeq]) -> list[Sequence]:
        """Run one step; a failing step is retried one sequence at a time so a bad request fails alone. The
        sequences that finished.

        The step's new pages go to every retry until one runs: a runner zeroes new state pages before use, and
        pages announced only to a step that failed would otherwise keep another request's stale rows."""
        new_pages = [self.kv.take_new_pages(p) for p in range(self.kv.num_partitions)]
        try:
            return self._step(scheduled, new_pages)
        except RanksLostError as exc:         # no retry can run: the loop fails every request and ends
            self.device_lost(str(exc))
            return []
        except Exception as exc:
            log.exception("engine step failed; retrying its %d sequences one by one", len(scheduled))
            self._step_failed(exc)
        return self._retry(scheduled, new_pages)

    def _retry(self, scheduled: list[ScheduledSeq], new_pages: list[dict[str, list[int]]]) -> list[Sequence]:
        """A failed step's sequences, one step each (synchronous); one that fails alone ends ABORTED with its error.
        The sequences that finished."""
        finished: list[Sequence] = []
        for item in scheduled:
            try:
                finished += self._step([item], new_pages)
                new_pages = [{} for _ in new_pages]
            except RanksLostError as exc:
                self.device_lost(str(exc))
                return finished
            except Exception as exc:  # noqa: BLE001 - isolate the failing request, keep serving the rest
                self._step_failed(exc)
                item.seq.error = f"{type(exc).__name__}: {exc}"
                self._finish_aborted(item.seq)
                finished.append(item.seq)
        return finished

    def _step_failed(self, exc: Exception) -> None:
        """Count a step that raised (FAILED_STEPS_FILE)."""
        self.stats.record_failed_step()
        path = os.environ.get(FAILED_STEPS_FILE)
        if path:
            with open(path, "a", encoding="utf-8") as out:
                out.write(f"{type(exc).__name__}: {exc}".replace("\n", " ")[:500] + "\n")

    def _step(self, scheduled: list[ScheduledSeq], new_pages: list[dict[str, list[int]]]) -> list[Sequence]:
        """One step of the scheduled rows: execute -> sample -> update -> output; the sequences that finished."""
        step = build_step(scheduled, self.kv, new_pages)
        masks = self._start_masks([s.seq for s in step.drawn])         # filled while the model step runs
        logits = self._execute(step)
        sampled, refused = self._sample(step, logits, masks)
        updates = self._update(step, sampled, refused)
        return self._output(updates, sampled)

    def _execute(self, step: StepInput) -> torch.Tensor:
        """The step's logits: one batch per KV partition (data-parallel rank), returned in partition order."""
        if step.partitioned:
            return self.runner.execute_partitions(step.batches)
        return self.runner.execute(step.batches[0])

    def _sample(self, step: StepInput, logits: torch.Tensor, masks: Masks) -> tuple[dict[str, Emitted], dict[str, str]]:
        """Each sampling row's new tokens and their logprobs (a verifying row: its accepted drafts and one more), by
        request id; and the constrained rows whose masks were refused, with why. Prompt logprobs are recorded."""
        rows = logits_rows(step.steps)
        verified = verify_rows(step.steps, rows)
        emitted: dict[int, Emitted] = {}
        if verified:
            logits, drafted = split_draft_rows(logits, step.batches)
            emitted = verify(self.sampler, logits, drafted, verified)
        if not rows.only_sampled:
            add_prompt_logprobs(logits, rows)
            logits = rows.sampled(logits)
        if len(step.plain) < len(step.samplers):                       # verifying rows were drawn above
            logits = logits.index_select(0, torch.tensor(step.plain, dtype=torch.long, device=logits.device))
        drawn = step.drawn
        refused = self._mask_constrained(logits, [s.seq for s in drawn], masks)
        tokens = self.sampler.sample(logits, [(s.seq.request_id, s.seq.params) for s in drawn]) if drawn else []
        logprobs = sampled_logprobs(logits, [s.seq.params for s in drawn], tokens)
        self.steps += 1
        for s, token, logprob in zip(drawn, tokens, logprobs):
            emitted[id(s.seq)] = ([token], [logprob])
        return {s.seq.request_id: emitted[id(s.seq)] for s in step.samplers}, refused

    def _update(self, step: StepInput, sampled: dict[str, Emitted], refused: dict[str, str]) -> list[SeqUpdate]:
        """Commit the step and apply the core's stop rules (Scheduler.update_from_output); count the kept drafts."""
        updates = self.scheduler.update_from_output(step.scheduled, _tokens(sampled), refused)
        record_speculation(self.stats, step.scheduled, [(s, sampled[s.seq.request_id][0]) for s in step.samplers])
        return updates

    def _output(self, updates: list[SeqUpdate], sampled: dict[str, Emitted]) -> list[Sequence]:
        """Hand each sampling row's committed tokens to the output sink; finish the sequences that ended (a core
        rule, or a stop string found there); count the step; then deliver the outputs. The finished sequences."""
        core_outputs = []
        for u in updates:
            tokens, logprobs = sampled[u.seq.request_id]
            core_outputs.append(self._core_output(u.seq, tokens[:u.num_new], logprobs[:u.num_new], u.finish_reason))
        processed = self.outputs.process_outputs(core_outputs)
        first = {id(u.seq) for u in updates if len(u.seq.output_token_ids) == u.num_new}   # no token before this step
        finished, appended = [], 0
        for u in updates:
            kept = processed.stopped.get(u.seq.request_id)
            appended += u.num_new if kept is None else kept
            reason = u.finish_reason if kept is None else FinishReason.STOP
            if reason is not None:
                self._free(u.seq, reason)
                finished.append(u.seq)
        self._record_tokens([u.seq for u in updates], first, appended)
        if finished:                          # the figures a finished request's client may read next are current
            self._publish_stats()
        processed.deliver()
        return finished

    @staticmethod
    def _core_output(seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob | None],
                     reason: FinishReason | None) -> CoreOutput:
        return CoreOutput(seq.request_id, tokens, logprobs, reason, seq.num_cached_prompt_tokens,
                          seq.take_prompt_logprobs(), seq.error, seq.error_field)

    def _finish_aborted(self, seq: Sequence) -> None:
        """End seq ABORTED outside a step's output (an abort, a failed retry, the failure) and stream its end."""
        self._free(seq, FinishReason.ABORTED)
        self._publish_stats()
        self.outputs.process_outputs([self._core_output(seq, [], [], FinishReason.ABORTED)]).deliver()

    def _free(self, seq: Sequence, reason: FinishReason) -> None:
        """Take a finished sequence out of the scheduler (its blocks back), the sampler, its grammar and the request
        table, and count it: all before its final output is delivered."""
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self.sampler.release(seq.request_id)
        if seq.matcher is not None:
            seq.matcher.close()
            seq.matcher = None
        self.requests.release(seq)
        self.stats.record_finished(reason.value, time.monotonic() - seq.arrival_time)

    # -- structured output ---------------------------------------------------------------------------
    def _start_masks(self, seqs: list[Sequence]) -> Masks:
        """Begin filling the masks of the constrained rows (seqs[i] is row i) off this thread; None without any."""
        rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        if not rows:
            return None
        return rows, self.grammars.start_fill([m for m in (seqs[i].matcher for i in rows) if m is not None])

    @staticmethod
    def _mask_constrained(logits: torch.Tensor, seqs: list[Sequence], masks: Masks) -> dict[str, str]:
        """Mask the logits of the constrained rows (seqs[i] is row i) to what their grammars allow next, before
        anything reads them: greedy, sampling and the sampled tokens' logprobs (which are therefore of the masked
        distribution, as vLLM's, whose grammar bitmask is applied before its sampler). A step without a
        constrained row builds nothing. The rows whose masks were refused (over the budget, or their grammar
        stopped with an error) are left unmasked and returned, by request id, with why."""
        if masks is None:
            return {}
        rows, fill = masks
        bitmask, refused = fill.result()
        kept = [k for k in range(len(rows)) if k not in refused]
        if kept:                              # (a copy of the kept rows: a refused row's fill may still write)
            kept_masks = bitmask[kept] if refused else bitmask
            apply_token_bitmask(logits, [rows[k] for k in kept], torch.from_numpy(kept_masks))
        return {seqs[rows[k]].request_id: why for k, why in refused.items()}

    # -- figures -------------------------------------------------------------------------------------
    def _publish_stats(self) -> None:
        sched, kv = self.scheduler, self.kv
        self.stats.publish(
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_preemptions=sched.num_preemptions,
            prefix_cache_queries=kv.prefix_stats.query_tokens, prefix_cache_hits=kv.prefix_stats.hit_tokens,
            groups=[GroupUsage(s.name, kv.num_total_blocks(s.name), kv.num_free_blocks(s.name))
                    for s in self.rc.model.cache_groups])

    def _record_tokens(self, seqs: list[Sequence], first: set[int], num_tokens: int) -> None:
        """Count the num_tokens this step appended for `seqs` (ids in `first`: their first tokens) and their
        latencies: one gap per sequence and step, however many tokens a verifying row emitted."""
        now = time.monotonic()
        starting = [seq for seq in seqs if id(seq) in first]
        self.stats.record_step(
            prompt_tokens=sum(seq.num_prompt_tokens for seq in starting),
            first_token_latencies=[now - seq.arrival_time for seq in starting],
            inter_token_latencies=[now - seq.last_token_time for seq in seqs
                                   if id(seq) not in first and seq.last_token_time is not None],
            generation_tokens=num_tokens)
        for seq in seqs:
            seq.last_token_time = now


def _tokens(sampled: dict[str, Emitted]) -> dict[str, list[int]]:
    """The sampled tokens of each row, by request id (without their logprobs)."""
    return {request_id: tokens for request_id, (tokens, _) in sampled.items()}
