"""Rules a setting may declare beyond its type, beside its declaration (appliance.core.config.setting(rule=...)).
Each returns why a value breaks it, or None; the composer checks every declared rule at the field's key path,
with every other issue (appliance.core.checks.declared_rule_issues). A null value of an optional field is never
checked: its type allows it."""

from __future__ import annotations

from typing import Any, Callable

Rule = Callable[[Any], "str | None"]


def positive_int(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return None if ok else "must be a positive integer"


def non_negative(value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return None if ok else "must be >= 0"


def positive(value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    return None if ok else "must be > 0"


def one_of(*allowed: str) -> Rule:
    def rule(value: Any) -> str | None:
        return None if value in allowed else f"must be one of {list(allowed)}"
    return rule


MAX_DRAFT_TOKENS = 3


def draft_tokens(value: Any) -> str | None:
    """speculative.num_tokens: tokens drafted per decode row (more than 3 are rarely accepted, as vLLM's MTP)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_DRAFT_TOKENS
    return None if ok else f"must be an integer in [1, {MAX_DRAFT_TOKENS}] (tokens drafted per decode row)"
