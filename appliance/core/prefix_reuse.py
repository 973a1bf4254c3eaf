"""Which prefix-cache hits keep greedy outputs exact, and the choice the user makes about the others.

A cached page is reused by a request whose prompt starts with the same tokens. For most architectures a page's
contents depend on those tokens alone. DeepSeek V4's lightning indexer is the exception: from its first top-k
choice on (position (index_topk + 1) x CSA ratio - 1, where a query sees more compressed rows than it picks),
rows that score exactly alike (every indexer head's relu 0) are picked as transformers picks them, by torch.topk
over a row as long as the prompt (npu/deepseek_v4/attention.py). So a page past that position, computed for a prompt of
another length, may hold what another tie rule made: reusing it can change greedy tokens against transformers.
Such ties are common with few indexer heads and practically absent with the released 64.

`prefix_caching_ties` (top level):
    exact   past that position, hits only between prompts of the same length (their ties break alike)
    reuse   every cached prefix is reused (more hits; a tie past it may break as the other prompt broke it)
    auto    exact when ties are likely (fewer than 16 indexer heads), else reuse
The engine states what it resolved in a startup note.
"""

from __future__ import annotations

from dataclasses import dataclass

CHOICES = ("auto", "exact", "reuse")


@dataclass(frozen=True)
class LengthDependentKv:
    """An architecture's cached pages from `from_position` on depend on the prompt's length too (`why`), and
    whether that changes tokens often enough (`likely`) that `auto` keeps hits there to prompts of one length."""

    from_position: int
    likely: bool
    why: str


def exact_prefix_from(choice: str, kv: LengthDependentKv | None) -> tuple[int | None, str | None]:
    """(position from which a prefix hit needs a prompt of the same length, or None: any hit is taken; the startup
    note, None when there is nothing to say: the architecture's pages depend on the tokens alone)."""
    if kv is None:
        return None, None
    exact = choice == "exact" or (choice == "auto" and kv.likely)
    chose = f"prefix_caching_ties={choice}" + (f" ({kv.why})" if choice == "auto" else "")
    if exact:
        return kv.from_position, (
            f"prefix caching: past position {kv.from_position}, hits only between prompts of the same length, so "
            f"greedy tokens are those of the whole prompt, tied indexer scores included ({chose}; "
            f"prefix_caching_ties=reuse takes every hit)")
    return None, (f"prefix caching: every cached prefix is reused, also past position {kv.from_position}, where an "
                  f"exact tie of indexer scores may break as for the prompt that cached it ({chose}; "
                  f"prefix_caching_ties=exact keeps greedy tokens exact)")
