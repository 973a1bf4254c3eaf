"""DeepSeek V4's MTP layer as a drafter: what each sequence's drafting needs from its previous step.

The MTP layer j at position i reads the main model's final streams at i (before hc_head) and the embedding of
token i + 1, and predicts token i + 2 (the released MTPBlock: e_proj(enorm(embed(t))) + h_proj(hnorm(h)),
one decoder block, its own hc_head and norm, the shared head). It attends over its own sliding window (the
MTP window group), so its row i can be written only once token i + 1 is known: a prefill chunk [s, e) writes
rows up to e - 2, a verify step from s catches up rows up to s - 1 (the last one drafts the first token),
then chains: row s + k - 1 from its own output streams and draft k drafts token k + 1. Chained rows are
rewritten exactly by the next step's catch-up, so the MTP window only ever keeps rows of committed tokens.

A drafter's output decides only which tokens are proposed; the main model's verification decides what is
emitted, so no draft (or missing history) can change a greedy output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npu.deepseek_v4.paging import StepPlan, flat_order
from npu.step import SeqStep


@dataclass(frozen=True)
class MtpHistory:
    """A sequence's main-model streams from its last step: positions start .. start + len(tokens) + drafts - 1.

    The tokens at those positions: `tokens` known on the host, then `drafted` (a verify step's drafts, on the device:
    the runner never reads a draft's value on the host, so drafting stays free of host syncs)."""

    start: int
    tokens: tuple[int, ...]
    hidden: torch.Tensor       # [positions, hc, D]
    mtp_next: int              # first MTP row not yet written from committed tokens
    step: int                  # runner step that wrote it (entries of sequences gone quiet are dropped)
    drafted: torch.Tensor | None = None   # [K] int64 on the device: the tokens after `tokens`

    @property
    def length(self) -> int:
        return len(self.tokens) + (0 if self.drafted is None else self.drafted.shape[0])

    def hidden_at(self, pos: int) -> torch.Tensor | None:
        """[1, hc, D] streams at pos, or None when this history does not hold it."""
        i = pos - self.start
        return self.hidden[i:i + 1] if 0 <= i < self.length else None


@dataclass(frozen=True)
class CatchUp:
    """The MTP rows a verify step from `start` writes before drafting: rows first .. start - 1, each with the
    token after it. `tokens` are those next tokens as the host knows them (placeholders where `fed` covers them:
    drafts of the last step, accepted since, whose values only the device holds); `fed` = (offset in tokens, device
    tensor) or None; `hidden` = the history's rows [lo, hi) of streams they read."""

    first: int
    tokens: list[int]
    fed: tuple[int, torch.Tensor] | None
    hidden: tuple[int, int]


def catch_up_rows(history: MtpHistory | None, start: int, first_token: int) -> CatchUp | None:
    """The catch-up of a verify step from `start` (whose first token is first_token): rows mtp_next .. start - 1
    that the history holds; None without such a history."""
    if history is None or history.hidden_at(start - 1) is None:
        return None
    first = max(history.mtp_next, history.start, 0)
    if first >= start:
        return None
    # row i's next token is the one at position i + 1: positions first + 1 .. start - 1 from the history, then
    # first_token at start. Of the history's positions, the host knows the first len(tokens); the rest are drafts.
    lo, hi = first + 1 - history.start, start - history.start
    known = len(history.tokens)
    host = list(history.tokens[lo:min(hi, known)])
    fed = None
    if hi > known and history.drafted is not None:
        drafts = history.drafted[max(lo, known) - known:hi - known]
        fed = (len(host), drafts)
        host += [0] * drafts.shape[0]
    return CatchUp(first, host + [first_token], fed, (first - history.start, start - history.start))


STALE_STEPS = 256    # a history unused this many runner steps belongs to a finished sequence: dropped


# Tokens of a step's rows that only the device knows (drafts): batch index -> (offset in the row's token_ids,
# device tensor of the tokens there). The row's token_ids hold placeholders at those offsets.
Fed = dict[int, tuple[int, torch.Tensor]]


def flat_starts(seqs: list[SeqStep]) -> dict[int, int]:
    """Batch index -> the flat row of its first token in a plan of `seqs` (paging.flat_order)."""
    out, at = {}, 0
    for i in flat_order(seqs):
        out[i] = at
        at += len(seqs[i].token_ids)
    return out


def feed_tokens(plan: StepPlan, seqs: list[SeqStep], fed: Fed) -> None:
    """Write the fed tokens into the plan's token ids, on the plan's device (the plan was built from placeholders)."""
    if not fed:
        return
    starts = flat_starts(seqs)
    for i, (offset, tokens) in fed.items():
        at = starts[i] + offset
        plan.token_ids[at:at + tokens.shape[0]] = tokens
