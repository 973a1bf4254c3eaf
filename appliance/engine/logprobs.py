"""Which logits rows of a step are sampled and which give prompt logprobs, and the prompt logprobs themselves.

A runner returns, per sequence of a step in batch order, the rows npu.step.logits_offsets names: the last token's
(sampled) or, for a request that asked for prompt logprobs, every token's. Row j of a prompt chunk is the model's
distribution of prompt token j + 1, so a chunk yields the logprobs of the prompt tokens after its positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from appliance.core.request import TokenLogprob
from appliance.engine.sequence import Sequence
from npu.sampler import token_logprobs
from npu.step import SeqStep, StepBatch, draft_rows, logits_offsets


def wants_prompt_logits(seq: Sequence, start: int, num_tokens: int) -> bool:
    """Whether the chunk [start, start + num_tokens) holds a position whose prompt logprob is still missing (a
    recomputation after preemption does not ask again for those already computed)."""
    got = seq.prompt_logprobs
    if got is None or len(got) >= seq.num_prompt_tokens:
        return False
    return start <= len(got) - 1 < start + num_tokens


def asked_prompt_logprobs(seq: Sequence) -> tuple[list[TokenLogprob | None], int]:
    """The prompt logprobs seq collects and the top tokens each carries: only a request that asked has rows for them."""
    got, top = seq.prompt_logprobs, seq.params.prompt_logprobs
    if got is None or top is None:
        raise ValueError(f"request {seq.request_id!r} did not ask for prompt logprobs")
    return got, top


@dataclass(frozen=True)
class LogitsRows:
    sample_rows: list[int]                              # one per sampling sequence, in step order
    prompt_rows: list[tuple[Sequence, list[int], list[int]]]   # (seq, rows, the prompt tokens they predict)

    @property
    def only_sampled(self) -> bool:
        return not self.prompt_rows and self.sample_rows == list(range(len(self.sample_rows)))

    def sampled(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling rows of a step's logits, in step order (the logits themselves when they are just those)."""
        if self.only_sampled:
            return logits
        return logits.index_select(0, torch.tensor(self.sample_rows, dtype=torch.long, device=logits.device))


def logits_rows(steps: list[tuple[Sequence, SeqStep]]) -> LogitsRows:
    """Where each sequence's rows are in the step's logits, in step order."""
    sample_rows: list[int] = []
    prompt_rows = []
    at = 0
    for seq, step in steps:
        offsets = logits_offsets(step)
        if step.all_logits:
            first_missing = len(asked_prompt_logprobs(seq)[0]) - 1          # position predicting the first missing token
            positions = [step.start_pos + k for k in offsets
                         if first_missing <= step.start_pos + k < seq.num_prompt_tokens - 1]
            if positions:
                prompt_rows.append((seq, [at + p - step.start_pos for p in positions],
                                    [seq.prompt_token_ids[p + 1] for p in positions]))
        if step.sample:
            sample_rows.append(at + len(offsets) - 1)
        at += len(offsets)
    return LogitsRows(sample_rows, prompt_rows)


@dataclass(frozen=True)
class VerifyRows:
    """A verifying decode row's logits: its K + 1 target rows from `first`, its drafter rows from first_draft (in the
    rows a runner appends after the step's, npu.step.draft_rows)."""
    seq: Sequence
    first: int
    first_draft: int
    num_draft: int


def verify_rows(steps: list[tuple[Sequence, SeqStep]], rows: LogitsRows) -> list[VerifyRows]:
    """Where each verifying row's target and drafter logits are, in step order."""
    out, at, drafted = [], 0, 0
    for seq, step in steps:
        n = len(logits_offsets(step))
        if step.num_draft:
            out.append(VerifyRows(seq, at, drafted, step.num_draft))
            drafted += step.num_draft
        at += n
    return out


def split_draft_rows(logits: torch.Tensor, batches: list[StepBatch]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the step's logits rows, its drafter rows), each in step order: a runner returns each batch's rows, then
    that batch's drafter rows (npu.step.draft_rows), batch after batch (one per data-parallel rank)."""
    main, drafted, at = [], [], 0
    for batch in batches:
        n = sum(len(logits_offsets(s)) for s in batch.seqs)
        d = draft_rows(batch.seqs)
        main.append(logits[at:at + n])
        drafted.append(logits[at + n:at + n + d])
        at += n + d
    return torch.cat(main), torch.cat(drafted)


def add_prompt_logprobs(logits: torch.Tensor, rows: LogitsRows) -> None:
    """Append each sequence's newly computed prompt logprobs (one batched call over all their rows)."""
    if not rows.prompt_rows:
        return
    flat = [r for _, seq_rows, _ in rows.prompt_rows for r in seq_rows]
    targets = [t for _, _, seq_targets in rows.prompt_rows for t in seq_targets]
    tops = [asked_prompt_logprobs(seq)[1] for seq, seq_rows, _ in rows.prompt_rows for _ in seq_rows]
    found = iter(token_logprobs(logits.index_select(0, torch.tensor(flat, device=logits.device)), targets, tops))
    for seq, seq_rows, _ in rows.prompt_rows:
        asked_prompt_logprobs(seq)[0].extend(next(found) for _ in seq_rows)


def sampled_logprobs(logits: torch.Tensor, params: list, tokens: list[int]) -> list:
    """Per sampled row: its token's logprob and top-N when its request asked (logprobs=N), else None."""
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list = [None] * len(tokens)
    if asked:
        found = token_logprobs(logits.index_select(0, torch.tensor(asked, device=logits.device)),
                               [tokens[i] for i in asked], [params[i].logprobs for i in asked])
        for i, lp in zip(asked, found):
            out[i] = lp
    return out
