"""Continuous batching: which sequences compute how many tokens in the next step.

With data parallel the KvCacheManager has one partition per data-parallel rank (it places each new request on
the least loaded one); every limit below then holds per partition, as each rank steps its own sequences.

Every sequence computes its pending tokens (prompt chunks, or the one token sampled last step), bounded by
appliance.core.step_limits.step_limits(rc), the description the startup profile measures the worst steps
of: the step's token budget (max_num_batched_tokens), the per-step chunk cap (layout.tokens_in_flight for
ring caches), max_num_seqs running at once, and decode_batch one-token rows per step (round robin).
A request is admitted only when the KvCacheManager gives every cache group its pages atomically; when pages
run out while running, the newest running request is preempted (blocks freed, recomputed later) and
waiting requests are readmitted in arrival order, so none starves.

After the step, update_from_output commits what it computed and sampled, and applies the stop rules the core
owns (EOS, stop token ids, a grammar's end or refusal, the length limits); stop strings are output processing's.
It is two halves, which async scheduling calls apart (core.py): commit, once the step is launched (what it computes
is known then), and resolve, once its sampled tokens are read. Between them each sampling row holds one unresolved
token (Sequence.num_unresolved): it counts as the row's pending token, so the next step can be scheduled before it
is known. Such a row is a decode row whose pages are reserved as lookahead (its token is not in token_ids yet), it
drafts nothing, and it is not scheduled at all when its length limits end it with that token. A preempted row waits
for its token before it is readmitted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Mapping
from typing import Sequence as Seq

from appliance.core.config import RuntimeConfig
from appliance.core.constraint import library_reason
from appliance.core.request import FinishReason
from appliance.core.step_limits import step_limits
from appliance.engine.kv_cache_manager import KvCacheManager, KvCapacityError
from appliance.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    num_draft: int = 0          # speculative decoding: tokens drafted after this decode row's and verified with it

    @property
    def samples(self) -> bool:
        """The step reaches the sequence's last known token, so its logits give the next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SeqUpdate:
    """A sampling row after update_from_output: the first num_new of its sampled tokens were appended to it (a stop
    rule ends the row at its token), and finish_reason says why it finished (None: it goes on). ABORTED: its
    grammar refused it (seq.error and seq.error_field say why)."""

    seq: Sequence
    num_new: int
    finish_reason: FinishReason | None = None


class Scheduler:
    def __init__(self, rc: RuntimeConfig, kv_cache_manager: KvCacheManager, eos_token_id: int | None = None):
        """eos_token_id: the token that ends a request (unless it asked ignore_eos); None: none does."""
        self.kv = kv_cache_manager
        self.eos_token_id = eos_token_id
        self.limits = step_limits(rc)
        self.block_size = rc.block_size
        self.max_model_len = rc.max_model_len
        self.enable_prefix_caching = rc.enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and give all its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.request_id)
        seq.status = SeqStatus.FINISHED

    def _chunk(self, start: int, pending: int, budget: int) -> int:
        """Tokens to compute now. A partial prefill chunk ends on a block boundary, so that every chunk
        starts page-aligned and a ring group never needs more than its max_blocks_per_seq slots."""
        n = min(pending, budget, self.limits.max_chunk)
        if n < pending:
            n = (start + n) // self.block_size * self.block_size - start
        return max(n, 0)

    def _logits_rows_cap(self, seq: Sequence, budget: int) -> int:
        """A request that asked for prompt logprobs gets logits for every token it computes: its chunks are held to
        the logits rows the startup profile sized (max_sampled_rows; at least one block, so that it progresses)."""
        if seq.params.prompt_logprobs is None:
            return budget
        return min(budget, max(self.limits.max_sampled_rows, self.block_size))

    def _drafts(self, seq: Sequence, budget: int) -> int:
        """Tokens a decode row drafts: speculative.num_tokens, fewer where the sequence's length or max_tokens
        would end first or the step's budget is short (a draft past them could never be kept). A constrained row
        (structured output) drafts nothing: its drafts would have to pass its grammar too."""
        if seq.matcher is not None or seq.num_unresolved:
            return 0
        left = min(self.max_model_len - seq.num_tokens, seq.params.max_tokens - len(seq.output_token_ids)) - 1
        return max(0, min(self.limits.draft_tokens, left, budget - 1))

    def _allocate(self, seq: Sequence, num_new_tokens: int, num_draft: int = 0) -> bool:
        """Pages for the next tokens (and drafts) in every group at once, or nothing. An unresolved token's page is
        reserved as lookahead, as a draft's: the KV manager learns the token at commit."""
        unknown = seq.num_unresolved
        try:
            self.kv.allocate(seq.request_id, seq.token_ids, num_new_tokens - unknown, num_draft + unknown,
                             seq.num_prompt_tokens)
            return True
        except KvCapacityError:
            return False

    def _ends_by_length(self, seq: Sequence) -> bool:
        """The row's unresolved token reaches max_tokens or max_model_len: it ends with it, whatever it is, so no
        step computes past it (the LENGTH rule of _append, known before the token)."""
        return bool(seq.num_unresolved) and (len(seq.output_token_ids) + seq.num_unresolved >= seq.params.max_tokens
                                             or seq.num_tokens >= self.max_model_len)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Running sequences all arrived before every waiting one, so the front keeps arrival order.
        self.waiting.appendleft(seq)

    def schedule(self) -> list[ScheduledSeq]:
        """The next step. Limits hold per KV partition (a data-parallel rank steps its own sequences), so with
        one partition they hold for the step."""
        self.step += 1
        parts = self.kv.num_partitions
        where = self.kv.partition_of if parts > 1 else (lambda request_id: 0)
        budget = [self.limits.max_tokens] * parts
        decode_rows = [self.limits.max_decode_rows] * parts
        scheduled: list[ScheduledSeq] = []

        # Running sequences, oldest first; decode rows go to those that waited longest for one.
        self.running.sort(key=lambda s: s.arrival)
        decoders = sorted((s for s in self.running if s.num_pending_tokens == 1 and not self._ends_by_length(s)),
                          key=lambda s: (s.last_scheduled_step, s.arrival))
        allowed_decoders: set[int] = set()
        for p in range(parts):
            allowed_decoders.update(id(s) for s in [d for d in decoders if where(d.request_id) == p][:decode_rows[p]])
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or self._ends_by_length(seq):
                continue
            p = where(seq.request_id)
            if budget[p] == 0:
                continue
            n = self._chunk(seq.num_computed_tokens, seq.num_pending_tokens, self._logits_rows_cap(seq, budget[p]))
            if n == 0 or (seq.num_pending_tokens == 1 and id(seq) not in allowed_decoders):
                continue
            if n == 1 and decode_rows[p] == 0:      # a 1-token chunk is a decode row to the runner too
                continue
            draft = self._drafts(seq, budget[p]) if n == 1 else 0
            while not self._allocate(seq, n, draft):
                victim = next(s for s in reversed(self.running) if where(s.request_id) == p)  # newest on its partition
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, n, draft))
                budget[p] -= n + draft
                if n == 1:
                    decode_rows[p] -= 1

        # Waiting sequences, strictly in order: the head is never overtaken.
        running = [0] * parts
        for seq in self.running:
            running[where(seq.request_id)] += 1
        while self.waiting and any(running[p] < self.limits.max_seqs and budget[p] > 0 for p in range(parts)):
            seq = self.waiting[0]
            if seq.num_unresolved:                  # preempted while its token is being sampled: it waits for it
                break
            # A request that asked for prompt logprobs computes every prompt position (a cache hit would skip them).
            if self.enable_prefix_caching and seq.params.prompt_logprobs is None:
                cached = self.kv.match_prefix(seq.request_id, seq.token_ids, seq.num_prompt_tokens)   # places it too
            else:
                cached = 0
                if parts > 1:
                    self.kv.place(seq.request_id, seq.num_prompt_tokens)
            p = where(seq.request_id)
            n = self._chunk(cached, seq.num_tokens - cached, self._logits_rows_cap(seq, budget[p]))
            if running[p] >= self.limits.max_seqs or n == 0 or (n == 1 and decode_rows[p] == 0):
                self.kv.free(seq.request_id)
                break
            if not self._allocate(seq, n):
                self.kv.free(seq.request_id)
                break
            self.waiting.popleft()
            seq.num_computed_tokens = cached
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            running[p] += 1
            scheduled.append(ScheduledSeq(seq, n))
            budget[p] -= n
            if n == 1:
                decode_rows[p] -= 1

        for item in scheduled:
            item.seq.last_scheduled_step = self.step
        return scheduled

    def update_from_output(self, scheduled: list[ScheduledSeq], sampled: Mapping[str, Seq[int]],
                           refused: Mapping[str, str]) -> list[SeqUpdate]:
        """Commit a step, then apply the core's stop rules to each sampling row, in `scheduled` order: commit, then
        resolve (see those)."""
        samplers = [s for s in scheduled if s.samples]     # (before the commit, which moves what samples reads)
        self.commit(scheduled, sampled)
        return self.resolve(samplers, sampled, refused)

    def commit(self, scheduled: list[ScheduledSeq], sampled: Mapping[str, Seq[int]] | None = None) -> None:
        """Record a launched step: every scheduled sequence gets its computed tokens committed, here and in the KV
        manager (which also learns tokens that were unresolved when they were allocated), and a verifying row its
        kept drafts, whose KV is written (so `sampled` is needed for a step with drafts). Each sampling row then holds
        its sampled token as unresolved until resolve."""
        for s in scheduled:
            seq = s.seq
            samples = s.samples
            accepted = list(sampled[seq.request_id][:-1]) if s.num_draft and sampled is not None else []
            if s.num_draft and sampled is None:
                raise ValueError(f"request {seq.request_id!r} verified drafts: its commit needs the sampled tokens")
            seq.num_computed_tokens += s.num_new_tokens + len(accepted)
            self.kv.commit(seq.request_id, seq.num_computed_tokens, seq.token_ids + accepted if accepted else
                           seq.token_ids)
            if samples:
                seq.num_unresolved = 1

    def resolve(self, samplers: list[ScheduledSeq], sampled: Mapping[str, Seq[int]],
                refused: Mapping[str, str]) -> list[SeqUpdate]:
        """Apply the core's stop rules to each committed sampling row, in order. sampled: the new tokens of every
        sampling row by request id (a verifying row: its accepted drafts and one more); refused: the rows whose
        grammar mask could not be computed, with why (their token is dropped). A row that finished while its step
        ran (an abort, a stop string) is in neither and is skipped. Each row's tokens are appended in order until
        one ends it: its grammar refuses it (ABORTED), EOS (unless ignore_eos), a stop token id, the grammar's end
        (STOP: the token is output), max_tokens or max_model_len (LENGTH). Finished sequences stay scheduled until
        the engine removes them (remove)."""
        updates = []
        for s in samplers:
            seq = s.seq
            if seq.request_id in refused:
                seq.num_unresolved = 0
                self._refuse(seq, refused[seq.request_id])
                updates.append(SeqUpdate(seq, 0, FinishReason.ABORTED))
                continue
            if seq.request_id not in sampled:
                continue
            seq.num_unresolved = 0
            new = sampled[seq.request_id]
            for i, token in enumerate(new):
                reason = self._append(seq, token)
                if reason is not None:
                    updates.append(SeqUpdate(seq, i + 1, reason))
                    break
            else:
                updates.append(SeqUpdate(seq, len(new)))
        return updates

    def _append(self, seq: Sequence, token: int) -> FinishReason | None:
        """Append one sampled token; why it ends the sequence, if it does."""
        p = seq.params
        seq.append_token(token)
        grammar_done = False
        if seq.matcher is not None:
            if not seq.matcher.accept(token):    # the mask allowed it: the library hit one of its limits
                self._refuse(seq, f"the grammar library stopped it at output token {len(seq.output_token_ids)}: "
                                  f"{library_reason(seq.matcher.error())}")
                return FinishReason.ABORTED
            grammar_done = seq.matcher.terminated
        if token == self.eos_token_id and not p.ignore_eos:
            return FinishReason.EOS
        if token in p.stop_token_ids:
            return FinishReason.STOP
        if grammar_done:                      # the grammar's last token is output: it keeps its text
            return FinishReason.STOP
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _refuse(seq: Sequence, why: str) -> None:
        """A constrained request whose grammar the library gave up on: the request's fault, not the engine's (the
        front ends answer 400 / INVALID_ARGUMENT naming its field)."""
        seq.error = why
        seq.error_field = seq.params.constraint.field if seq.params.constraint is not None else "constraint"
