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


@dataclass(frozen=True)
class MtpHistory:
    """A sequence's main-model streams from its last step: positions start .. start + len(tokens) - 1."""

    start: int
    tokens: tuple[int, ...]
    hidden: torch.Tensor       # [len(tokens), hc, D]
    mtp_next: int              # first MTP row not yet written from committed tokens
    step: int                  # runner step that wrote it (entries of sequences gone quiet are dropped)

    def hidden_at(self, pos: int) -> torch.Tensor | None:
        """[1, hc, D] streams at pos, or None when this history does not hold it."""
        i = pos - self.start
        return self.hidden[i:i + 1] if 0 <= i < len(self.tokens) else None


def catch_up_rows(history: MtpHistory | None, start: int, first_token: int) -> tuple[int, list[int], list[int]]:
    """MTP rows a verify step from `start` (whose first token is first_token) writes before drafting:
    (first row, their next tokens, their history indices). Rows mtp_next .. start - 1 that the history holds;
    none without history."""
    if history is None or history.hidden_at(start - 1) is None:
        return start - 1, [], []
    first = max(history.mtp_next, history.start, 0)
    known = list(history.tokens[:start - history.start]) + [first_token]      # tokens history.start .. start
    rows = list(range(first, start))
    return first, [known[i + 1 - history.start] for i in rows], [i - history.start for i in rows]


STALE_STEPS = 256    # a history unused this many runner steps belongs to a finished sequence: dropped
