"""Structured output in the engine: one llguidance matcher per constrained sequence, and the token bitmask of a step.

A matcher follows the tokens a sequence has committed (Scheduler.update_from_output advances it as each sampled token
is appended), never the tokens a step computes: a preempted sequence re-prefills its prompt and outputs without
touching its matcher, so its grammar state survives recompute. Each of n choices is its own sequence with its own
matcher. The bitmask is built on the host (one bit per vocabulary id, 32 ids per int32 word, llguidance's layout)
only for the rows that have a matcher; the sampler (npu.sampler.apply_token_bitmask) masks those rows' logits.
With several data-parallel ranks the owner already holds every rank's sampled logits (npu.worker.run_step gathers
them before sampling), so no mask travels with a step.

No request's grammar may crash the process, hang the loop or stall the other streams:
- a constraint is first held to the complexity bounds (appliance/core/grammar_bounds.py), then compiled on one of a
  few threads with a large stack (llguidance recurses once per nested rule or schema: a default 8 MiB thread stack
  overflows at about 2,700, and the process dies of SIGSEGV), within COMPILE_TIMEOUT_S. Its first two masks are
  computed there too: the first builds the lexer (the costly part), the second must fit MASK_BUDGET_S of CPU;
- each step's masks are filled off the loop thread, one task per row, started before the model step so that they
  overlap it. A row is refused when its mask takes more than MASK_BUDGET_S of CPU (the loop reads the filling
  thread's CPU clock while it waits: it stops waiting for a row past the budget), is not done MASK_WAIT_S after the
  fills began, or its grammar stopped with an error (llguidance's own limits, PARSER_LIMITS): its request ends with
  a short error naming its field (the front ends answer 400 / INVALID_ARGUMENT), and the step goes on for the rest.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, TypeVar

import llguidance
import llguidance.numpy
from numpy.typing import NDArray

from appliance.core.constraint import ConstraintError, OutputConstraint, constraint_grammar, library_reason
from appliance.core.request import RequestError
from appliance.core.tokenizer import Tokenizer

log = logging.getLogger("appliance.engine.grammar")
T = TypeVar("T")

# The compile threads' stack: llguidance needs 3 to 9 KiB per nested rule or schema. The deepest constraint the
# size limit lets through (256 KiB of text) needs 64 to 128 MiB; the complexity bounds keep every accepted one below
# 10 MiB. Only the pages a compile touches are ever committed.
COMPILE_STACK_BYTES = 256 << 20
COMPILE_THREADS = 2
COMPILE_TIMEOUT_S = 10.0        # compile and first masks of one constraint (0.5 s for the largest one allowed)
# CPU time one row's mask may take. A mask takes microseconds (at most 1.3 ms measured with a 64k vocabulary, for
# JSON schemas, tool calls and free text); a 200,000-character literal takes 60 ms, every step.
MASK_BUDGET_S = 0.02
MASK_WAIT_S = 0.5               # how long after the fills began the loop waits for the last row's mask
MASK_POLL_S = 0.005             # while a mask is late, how often the loop looks at the CPU time it has taken
MASK_THREADS = 256              # rows whose masks fill at once (threads are made only as rows need them)
# llguidance's own limits on one mask (lexer fuel, Earley items, items in a row: its defaults); errors without the
# grammar and parser state they would otherwise carry (an error must stay short: it goes to the client).
PARSER_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class LargeStackThreads:
    """A few daemon threads with a large stack, running calls in order; started on the first call."""

    _stack_size_lock = threading.Lock()         # threading.stack_size is process-wide

    def __init__(self, count: int, stack_bytes: int, name: str):
        self.count, self.stack_bytes, self.name = count, stack_bytes, name
        self._calls: queue.SimpleQueue[tuple[Future, Callable[[], object]] | None] = queue.SimpleQueue()
        self._started = False

    def submit(self, call: Callable[[], T]) -> Future[T]:
        with self._stack_size_lock:
            if not self._started:
                previous = threading.stack_size(self.stack_bytes)
                try:
                    for i in range(self.count):
                        threading.Thread(target=self._run, name=f"{self.name}-{i}", daemon=True).start()
                finally:
                    threading.stack_size(previous)
                self._started = True
        future: Future[T] = Future()
        self._calls.put((future, call))
        return future

    def close(self) -> None:
        """Let the threads end once the calls queued before are done."""
        for _ in range(self.count):
            self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            future, call = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                    future.set_exception(exc)


class GrammarMatcher:
    """A constrained sequence's grammar state: advanced by each committed token, closed when the sequence ends.
    `lock` keeps a mask fill (on a mask thread) and the loop's calls apart."""

    def __init__(self, matcher: llguidance.LLMatcher, compiler: "GrammarCompiler"):
        self.matcher: llguidance.LLMatcher | None = matcher
        self.compiler = compiler
        self.lock = threading.Lock()

    def accept(self, token_id: int) -> bool:
        """Advance by a committed token; False when the grammar forbids it (the matcher is then in error)."""
        with self.lock:
            return self.live().consume_token(token_id)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and nothing more may follow: the sequence is finished."""
        with self.lock:
            return self.live().is_stopped()

    @property
    def accepting(self) -> bool:
        with self.lock:
            return self.live().is_accepting()

    def error(self) -> str:
        with self.lock:
            return self.live().get_error()

    def live(self) -> llguidance.LLMatcher:
        if self.matcher is None:
            raise RuntimeError("the grammar matcher was closed (its sequence finished)")
        return self.matcher

    def close(self) -> None:
        """Free the matcher (once): its sequence finished, was aborted or failed. Takes no lock: a fill that
        outlasted the step may still hold it, and ends on its own."""
        if self.matcher is not None:
            self.matcher = None
            self.compiler.closed()


def fill_row(matcher: GrammarMatcher, bitmask: NDArray, row: int, clocks: list) -> tuple[float, str]:
    """Fill bitmask[row] with what `matcher` allows next: (the CPU seconds it took, the grammar's error or ""). While
    it fills, clocks[row] holds this thread's CPU clock and its reading at the start (the loop reads it meanwhile)."""
    with matcher.lock:
        live = matcher.live()
        clock = time.pthread_getcpuclockid(threading.get_ident())
        start = time.clock_gettime(clock)
        clocks[row] = (clock, start)
        llguidance.numpy.fill_next_token_bitmask(live, bitmask, row)
        return time.clock_gettime(clock) - start, live.get_error() if live.is_error() else ""


class MaskFill:
    """The token masks of one step's constrained rows, filling on the mask threads (one task per row)."""

    def __init__(self, compiler: "GrammarCompiler", matchers: list[GrammarMatcher]):
        self.budget_s, self.wait_s = compiler.mask_budget_s, compiler.mask_wait_s
        self.bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), compiler.vocab_size)
        self.began = time.monotonic()
        self.clocks: list[tuple[int, float] | None] = [None] * len(matchers)
        self.tasks = [compiler.mask_threads.submit(fill_row, m, self.bitmask, i, self.clocks)
                      for i, m in enumerate(matchers)]

    def cpu_used(self, row: int) -> float:
        """CPU seconds the fill of `row` has taken so far (0 before it starts)."""
        clock = self.clocks[row]
        if clock is None:
            return 0.0
        try:
            return time.clock_gettime(clock[0]) - clock[1]
        except OSError:               # the thread has ended (the engine shut down)
            return 0.0

    def result(self) -> tuple[NDArray, dict[int, str]]:
        """The bitmask ([rows, ceil(vocab / 32)] int32), and the rows refused with why: a refused row's mask must
        not be used (a fill that outlasted the wait may still write it). Waits until every fill is done, or has
        used more CPU than the budget, or wait_s has passed since the fills began."""
        _, pending = wait(self.tasks, timeout=0)
        over: dict[int, float] = {}                # row -> CPU seconds its fill had taken when seen over the budget
        deadline = self.began + self.wait_s
        while pending and time.monotonic() < deadline:
            _, pending = wait(pending, timeout=min(MASK_POLL_S, max(0.0, deadline - time.monotonic())))
            running = {i for i, task in enumerate(self.tasks) if task in pending and i not in over}
            over |= {i: cpu_s for i in running if (cpu_s := self.cpu_used(i)) > self.budget_s}
            if running <= over.keys():
                break
        refused: dict[int, str] = {}
        for i, task in enumerate(self.tasks):
            if i in over:
                refused[i] = self.over_budget(over[i], "over ")
            elif task in pending:
                refused[i] = (f"its token mask was not computed within {self.wait_s:g} s (the grammar is too complex "
                              f"for the grammar library)")
            elif task.exception() is not None:
                refused[i] = f"its token mask failed: {library_reason(str(task.exception()))}"
            else:
                cpu_s, error = task.result()
                if error:
                    refused[i] = f"the grammar library stopped it: {library_reason(error)}"
                elif cpu_s > self.budget_s:
                    refused[i] = self.over_budget(cpu_s)
        return self.bitmask, refused

    def over_budget(self, cpu_s: float, over: str = "") -> str:
        return (f"its token mask took {over}{cpu_s * 1e3:.0f} ms of CPU; at most {self.budget_s * 1e3:g} ms (the "
                f"grammar is too complex: simplify it)")


class GrammarCompiler:
    """Compiles constraints into matchers against the model's vocabulary (the logits' width: ids the tokenizer
    lacks are never allowed), and fills the steps' masks. The tokenizer's llguidance form is built on the first
    constrained request (about a second for a 150k vocabulary), so a deployment that never constrains pays nothing.
    Thread-safe: the front ends' submit threads compile, the loop thread fills, advances and closes."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, compile_timeout_s: float = COMPILE_TIMEOUT_S,
                 mask_budget_s: float = MASK_BUDGET_S, mask_wait_s: float = MASK_WAIT_S):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.mask_budget_s = mask_budget_s
        self.mask_wait_s = mask_wait_s
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._unavailable: str | None = None          # why this tokenizer cannot constrain (said once, then refused)
        self.compile_threads = LargeStackThreads(COMPILE_THREADS, COMPILE_STACK_BYTES, "grammar-compile")
        self.mask_threads = ThreadPoolExecutor(MASK_THREADS, thread_name_prefix="grammar-mask")
        self.num_live = 0                      # matchers not yet closed (every one is closed when its seq ends)

    def ll_tokenizer(self, field: str) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance reads it; RequestError naming `field` when it cannot (a tokenizer.json
        without a decoder, such as a word-level one: structured output is then unavailable for this model)."""
        with self._lock:
            if self._ll_tokenizer is None and self._unavailable is None:
                try:
                    self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.tk.to_str(), n_vocab=self.vocab_size,
                                                                eos_token=self.tokenizer.eos_token_id)
                except ValueError as exc:
                    self._unavailable = (f"structured output is unavailable for this model: the grammar library "
                                         f"cannot read its tokenizer ({self.tokenizer.source}: "
                                         f"{library_reason(str(exc))})")
                    log.warning("%s", self._unavailable)
            if self._ll_tokenizer is None:
                raise RequestError(field, self._unavailable or "structured output is unavailable")
            return self._ll_tokenizer

    def matcher(self, constraint: OutputConstraint) -> GrammarMatcher:
        """A fresh matcher at the start of the output, compiled on a compile thread (the caller waits up to
        compile_timeout_s); RequestError naming the constraint's field when it is refused."""
        ll_tokenizer = self.ll_tokenizer(constraint.field)
        task = self.compile_threads.submit(lambda: self._compile(constraint, ll_tokenizer))
        try:
            matcher = task.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise RequestError(constraint.field, f"did not compile within {self.compile_timeout_s:g} s (the grammar "
                                                 f"is too complex, or the server is compiling many others)") from None
        with self._lock:
            self.num_live += 1
        return GrammarMatcher(matcher, self)

    def _compile(self, constraint: OutputConstraint, ll_tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
        """On a compile thread: the matcher with its first masks computed; RequestError naming the field when the
        library refuses the grammar, when no output can match it, or when one mask takes over the budget."""
        field = constraint.field
        try:
            grammar = constraint_grammar(constraint)
        except ConstraintError as exc:
            raise RequestError(exc.field, str(exc)) from None
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
        if matcher.is_error():
            raise RequestError(field, f"is refused by the grammar compiler: {library_reason(matcher.get_error())}")
        bitmask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)        # builds the lexer: the costly part
        if matcher.is_error() or not bitmask.any():
            raise RequestError(field, f"matches no output: the grammar library stops before the first token "
                                      f"({library_reason(matcher.get_error())}), as for a schema that only refers "
                                      f"to itself")
        start = time.thread_time()
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        cpu_s = time.thread_time() - start
        if cpu_s > self.mask_budget_s:
            raise RequestError(field, f"takes {cpu_s * 1e3:.0f} ms of CPU to compute one token mask; at most "
                                      f"{self.mask_budget_s * 1e3:g} ms (simplify it: long literals and large "
                                      f"counted repetitions cost the most)")
        return matcher

    def closed(self) -> None:
        with self._lock:
            self.num_live -= 1

    def start_fill(self, matchers: list[GrammarMatcher]) -> MaskFill:
        """Begin filling the masks of a step's rows (row i: matchers[i]) off the caller's thread."""
        return MaskFill(self, matchers)

    def fill_bitmask(self, matchers: list[GrammarMatcher]) -> NDArray:
        """Row i: the tokens matchers[i] allows next, filled at once (the callers that need no budget: benches)."""
        bitmask, refused = self.start_fill(matchers).result()
        if refused:
            raise RequestError("constraint", "; ".join(refused.values()))
        return bitmask

    def close(self) -> None:
        """Let the compile and mask threads end (the engine shut down)."""
        self.compile_threads.close()
        self.mask_threads.shutdown(wait=False)
