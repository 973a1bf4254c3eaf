"""Structured output in the engine: one llguidance matcher per constrained sequence, and the token bitmask of a step.

A matcher follows the tokens a sequence has committed (appliance.engine.loop advances it as each sampled token is
appended), never the tokens a step computes: a preempted sequence re-prefills its prompt and outputs without
touching its matcher, so its grammar state survives recompute. Each of n choices is its own sequence with its own
matcher. The bitmask is built on the host (one bit per vocabulary id, 32 ids per int32 word, llguidance's layout)
only for the rows that have a matcher; the sampler (npu.sampler.apply_token_bitmask) masks those rows' logits.
With several data-parallel ranks the owner already holds every rank's sampled logits (npu.worker.run_step gathers
them before sampling), so no mask travels with a step.
"""

from __future__ import annotations

import threading

import llguidance
import llguidance.numpy
import numpy
from numpy.typing import NDArray

from appliance.core.constraint import ConstraintError, OutputConstraint, constraint_grammar
from appliance.core.request import RequestError
from appliance.core.tokenizer import Tokenizer

# Constrained rows of a step up to which their bitmasks are filled one after another on the loop thread.
SERIAL_FILL_ROWS = 4


class GrammarMatcher:
    """A constrained sequence's grammar state: advanced by each committed token, closed when the sequence ends."""

    def __init__(self, matcher: llguidance.LLMatcher, compiler: "GrammarCompiler"):
        self.matcher: llguidance.LLMatcher | None = matcher
        self.compiler = compiler

    def accept(self, token_id: int) -> bool:
        """Advance by a committed token; False when the grammar forbids it (the matcher is then in error)."""
        return self.live().consume_token(token_id)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and nothing more may follow: the sequence is finished."""
        return self.live().is_stopped()

    @property
    def accepting(self) -> bool:
        return self.live().is_accepting()

    def error(self) -> str:
        return self.live().get_error()

    def live(self) -> llguidance.LLMatcher:
        if self.matcher is None:
            raise RuntimeError("the grammar matcher was closed (its sequence finished)")
        return self.matcher

    def close(self) -> None:
        """Free the matcher (once): its sequence finished, was aborted or failed."""
        if self.matcher is not None:
            self.matcher = None
            self.compiler.closed()


class GrammarCompiler:
    """Compiles constraints into matchers against the model's vocabulary (the logits' width: ids the tokenizer
    lacks are never allowed). The tokenizer's llguidance form is built on the first constrained request (about a
    second for a 150k vocabulary), so a deployment that never constrains pays nothing. Thread-safe: the front
    ends' submit threads compile, the loop thread advances and closes."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.num_live = 0                      # matchers not yet closed (every one is closed when its seq ends)

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.tk.to_str(), n_vocab=self.vocab_size,
                                                            eos_token=self.tokenizer.eos_token_id)
            return self._ll_tokenizer

    def executor(self) -> llguidance.LLExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            return self._executor

    def matcher(self, constraint: OutputConstraint) -> GrammarMatcher:
        """A fresh matcher at the start of the output; RequestError naming the constraint's field when the
        grammar does not compile against this vocabulary (validate_request has checked it without one)."""
        try:
            grammar = constraint_grammar(constraint)
        except ConstraintError as exc:
            raise RequestError(exc.field, str(exc)) from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(constraint.field, f"is refused by the grammar compiler: {matcher.get_error()}")
        with self._lock:
            self.num_live += 1
        return GrammarMatcher(matcher, self)

    def closed(self) -> None:
        with self._lock:
            self.num_live -= 1

    def fill_bitmask(self, matchers: list[GrammarMatcher]) -> NDArray[numpy.int32]:
        """Row i: the tokens matchers[i] allows next, one bit per id ([len(matchers), ceil(vocab / 32)] int32).
        A few rows are filled on this thread (microseconds each); more in llguidance's thread pool, whose
        threads sleep between steps and cost more to wake than a few rows take."""
        bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), self.vocab_size)
        if len(matchers) <= SERIAL_FILL_ROWS:
            for i, m in enumerate(matchers):
                llguidance.numpy.fill_next_token_bitmask(m.live(), bitmask, i)
        else:
            llguidance.numpy.fill_next_token_bitmask_par(
                self.executor(), [(m.live(), i) for i, m in enumerate(matchers)], bitmask)
        return bitmask
