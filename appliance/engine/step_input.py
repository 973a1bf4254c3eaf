"""A step's input: the scheduler's decision turned into what the runner executes, and where its logits rows are.

Several data-parallel ranks (KV partitions) each get the batch of their own sequences; the runner returns the logits
in partition order, so the scheduled sequences are put in that order first. Every rank gets a batch every step
(possibly empty), with the new pages of its partition, the step's draft passes and the most rows any rank
computes (the bound of an expert-parallel exchange's fixed shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.engine.kv_cache_manager import KvCacheManager
from appliance.engine.logprobs import wants_prompt_logits
from appliance.engine.scheduler import ScheduledSeq
from appliance.engine.sequence import Sequence
from npu.step import FedTokens, SeqStep, StepBatch, step_rows

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StepInput:
    """One step, built by build_step.

    - scheduled: the scheduler's rows, in partition order (the order of the logits);
    - batches: one StepBatch per KV partition (the runner's input);
    - steps: each scheduled sequence with its SeqStep, in that order (where its logits rows are: logprobs.py);
    - samplers: the rows whose logits give a next token, in that order;
    - plain: the indices in samplers of rows sampled as is (the others verify drafts: speculation.py);
    - drawn: those rows (samplers[i] for i in plain)."""

    scheduled: list[ScheduledSeq]
    batches: list[StepBatch]
    steps: list[tuple[Sequence, SeqStep]]
    samplers: list[ScheduledSeq]
    plain: list[int]
    drawn: list[ScheduledSeq]

    @property
    def partitioned(self) -> bool:
        return len(self.batches) > 1


# The token a fed row's SeqStep holds until the runner writes the real one on the device (FedTokens).
FED_PLACEHOLDER = 0


def build_step(scheduled: list[ScheduledSeq], kv: KvCacheManager, new_pages: list[dict[str, list[int]]],
               fed_from: tuple[torch.Tensor, list[ScheduledSeq]] | None = None) -> StepInput:
    """The step of `scheduled`; new_pages[p]: the pages first used by partition p's batch (the runner zeroes those
    it must before use). Reads the sequences and their block tables, changes nothing.

    fed_from (async scheduling, one partition): the previous step's sampled ids on the device and the rows they were
    drawn for; a row whose token is one of them, not read yet (Sequence.num_unresolved), gets a placeholder and is
    fed that id on the device (StepBatch.fed)."""
    parts = kv.num_partitions
    if parts > 1:
        scheduled = sorted(scheduled, key=lambda s: kv.partition_of(s.seq.request_id))
    batches = [StepBatch(seqs=[], new_pages=pages) for pages in new_pages]
    steps = []
    source = {id(d.seq): k for k, d in enumerate(fed_from[1])} if fed_from is not None else {}
    fed: list[tuple[int, int]] = []
    for s in scheduled:
        start = s.seq.num_computed_tokens
        tokens = s.seq.token_ids[start:start + s.num_new_tokens]
        if s.seq.num_unresolved:
            if id(s.seq) not in source or parts > 1 or s.num_new_tokens != 1:
                raise ValueError(f"request {s.seq.request_id!r}: its token is not read yet and no step feeds it")
            fed.append((len(batches[0].seqs), source[id(s.seq)]))
            tokens = [FED_PLACEHOLDER]
        step = SeqStep(request_id=s.seq.request_id, token_ids=tokens,
                       start_pos=start, block_tables=kv.block_tables(s.seq.request_id), sample=s.samples,
                       all_logits=wants_prompt_logits(s.seq, start, s.num_new_tokens),
                       prompt_len=s.seq.num_prompt_tokens, num_draft=s.num_draft)
        batches[kv.partition_of(s.seq.request_id) if parts > 1 else 0].seqs.append(step)
        steps.append((s.seq, step))
    expert_rows = max(step_rows(b.seqs) for b in batches)
    for batch in batches:
        batch.draft_passes = max((s.num_draft for s in scheduled), default=0)
        batch.expert_rows = expert_rows
    if fed:
        assert fed_from is not None
        batches[0].fed = FedTokens(fed_from[0], fed)
    samplers = [s for s in scheduled if s.samples]
    plain = [i for i, s in enumerate(samplers) if not s.num_draft]
    return StepInput(scheduled, batches, steps, samplers, plain, [samplers[i] for i in plain])
