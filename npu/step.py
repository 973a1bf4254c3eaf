"""What the engine hands the model runner for one step (plain data; no torch at run time), and the interface of
what runs it (StepExecutor)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

if TYPE_CHECKING:
    import torch


@dataclass
class SeqStep:
    """One sequence's share of a step."""

    request_id: str
    token_ids: list[int]               # tokens computed in this step (a prefill chunk, or 1 decode token)
    start_pos: int                     # tokens already in the cache = position of token_ids[0]
    # Per cache group, physical page ids. Full-history groups: one entry per logical page (page i holds
    # tokens [i * tokens_per_page, (i + 1) * tokens_per_page)). Ring groups: exactly max_blocks_per_seq
    # entries indexed by slot = logical_page % max_blocks_per_seq; -1 where no page is held.
    block_tables: dict[str, list[int]]
    sample: bool = True                # logits of the last token are needed (False for a non-final prefill chunk)
    # The request's prompt length (0: not known, taken as the end of this step). DeepSeek V4's indexer ranks a
    # prompt token's candidates over the rows the whole prompt makes, as a one-step prefill does (top-k ties).
    prompt_len: int = 0
    # Logits of every token of this step, not only the last (a request that asked for prompt logprobs).
    all_logits: bool = False
    # Speculative decoding (a decode row): the runner drafts this many tokens after token_ids (its MTP layer) and
    # computes them too; its logits rows are then every position's, and the drafts' own logits come after the
    # batch's rows (see logits_offsets, draft_rows).
    num_draft: int = 0


def logits_offsets(seq: SeqStep) -> range:
    """Which of seq's tokens in this step the runner returns logits for, in order: all of them (all_logits), the
    last (sample), or none. A runner's logits are these rows of every sequence, in batch order."""
    n = len(seq.token_ids) + seq.num_draft
    if seq.all_logits or seq.num_draft:
        return range(n)
    return range(n - 1, n) if seq.sample else range(0)


def draft_rows(seqs: list[SeqStep]) -> int:
    """Logits rows a runner appends after the batch's logits_offsets rows: the drafter's logits of each drafted
    token (num_draft per verifying row, in batch order); a drafted token is the argmax of its row."""
    return sum(s.num_draft for s in seqs)


@dataclass
class FedTokens:
    """Async scheduling: decode rows whose token the previous step sampled and the host has not read yet. Row
    `rows[k][0]` of the batch (its SeqStep holds a placeholder token) takes `source[rows[k][1]]`, the previous step's
    sampled ids on the runner's device, written there before the model reads it (ModelRunner.feed_rows)."""

    source: torch.Tensor
    rows: list[tuple[int, int]]        # (index in StepBatch.seqs, index in source)


@dataclass
class StepBatch:
    seqs: list[SeqStep]
    # Pages (per group) that received a new logical page since the previous step. The runner zeroes those of
    # state groups before use, and those of the groups it zeroes on first use the first time (pools start
    # uninitialized: ModelRunner.zero_new_pages), clearing contiguous runs of page ids in one copy each. Every
    # page must be announced before a step reads it (the engine announces each one it hands out).
    new_pages: dict[str, list[int]] = field(default_factory=dict)
    # A startup profiling step (ModelRunner.scratch_batch): the runner takes the heaviest branch of every
    # data-dependent choice (an MoE routes every token to the same experts), so its peak bounds real steps.
    worst_case: bool = False
    # Speculative decoding: drafting passes of the MTP layer this step, the most drafts any row of ANY data-parallel
    # rank verifies (expert-parallel ranks join each pass's expert exchange in lockstep, with or without rows).
    draft_passes: int = 0
    # Expert parallel: the most rows any data-parallel rank computes this step (step_rows of its batch), the bound of
    # every expert exchange's fixed shapes, known to every rank without a collective (0: not given; the exchange
    # then reads its counts on the host).
    expert_rows: int = 0
    # Async scheduling (one process only: a device tensor): rows whose token is still on the device (FedTokens).
    fed: FedTokens | None = None


def step_rows(seqs: list[SeqStep]) -> int:
    """The rows a batch computes in its main pass (its tokens and the drafts it verifies), which bounds every pass of
    the step: an MTP pass computes at most as many, a drafting pass one per drafting row."""
    return sum(len(s.token_ids) + s.num_draft for s in seqs)


class StepExecutor(Protocol):
    """What the engine steps: a ModelRunner (every rank in this process) or a DeviceGroup (the owner driving every
    rank). One interface, so the engine never asks which it holds."""

    @property
    def device(self) -> torch.device: ...

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """One step of one data-parallel rank: the logits its sequences sample from (npu.step.logits_offsets)."""
        ...

    def execute_partitions(self, batches: Sequence[StepBatch]) -> torch.Tensor:
        """One step of every data-parallel rank, batches[d] on rank d; the logits of every batch, in batch order."""
        ...

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call on_lost(message) once if a rank this executor steps dies or hangs (idle or not)."""
        ...

    def shutdown(self) -> None: ...
