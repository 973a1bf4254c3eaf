"""Collecting config issues instead of stopping at the first: every rule of the composer and of core's derivations
reports through one Checker, so a config with several faults names them all at once (each with its key path)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from appliance.core.config import RULE
from appliance.core.errors import ConfigIssue
from appliance.core.kv_cache_spec import DTYPE_BYTES


class Checker:
    """Collects issues instead of stopping at the first one."""

    def __init__(self) -> None:
        self.issues: list[ConfigIssue] = []

    def fail(self, path: str, value: object, rule: str) -> None:
        self.issues.append(ConfigIssue(path, value, rule))

    def check(self, ok: bool, path: str, value: object, rule: str) -> bool:
        if not ok:
            self.fail(path, value, rule)
        return ok

    def positive_int(self, path: str, value: object, optional: bool = False) -> bool:
        if value is None and optional:
            return True
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        return self.check(ok, path, value, "must be a positive integer")

    def non_negative(self, path: str, value: object, optional: bool = False) -> bool:
        if value is None and optional:
            return True
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        return self.check(ok, path, value, "must be >= 0")

    def dtype(self, path: str, value: object, optional: bool = False) -> bool:
        if value is None and optional:
            return True
        return self.check(value in DTYPE_BYTES, path, value,
                          f"must be a torch dtype name ({', '.join(sorted(DTYPE_BYTES))})")

    def one_of(self, path: str, value: object, allowed: tuple[str, ...]) -> bool:
        return self.check(value in allowed, path, value, f"must be one of {list(allowed)}")


def declared_rule_issues(cls: type, values: dict[str, Any], prefix: str = "") -> list[ConfigIssue]:
    """Every rule a field of `cls` declares (appliance.core.config.setting), checked on `values` (the composed
    section as a plain dict) at the field's key path; nested sections too."""
    hints = typing.get_type_hints(cls)
    issues: list[ConfigIssue] = []
    for f in dataclasses.fields(cls):
        if f.name not in values or values[f.name] is None:
            continue
        value, rule = values[f.name], f.metadata.get(RULE)
        why = rule(value) if rule is not None else None
        if why:
            issues.append(ConfigIssue(prefix + f.name, value, why))
        section = hints[f.name]
        if dataclasses.is_dataclass(section) and isinstance(section, type) and isinstance(value, dict):
            issues += declared_rule_issues(section, value, f"{prefix}{f.name}.")
    return issues
