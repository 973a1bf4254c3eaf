"""Config errors that name the key path, the value and the rule, reported all at once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigIssue:
    path: str
    value: object
    rule: str

    def __str__(self) -> str:
        return f"{self.path} = {self.value!r}: {self.rule}"


class ConfigError(ValueError):
    """Raised before any device work; the CLI prints it and exits with status 2."""

    def __init__(self, issues: list[ConfigIssue]):
        self.issues = list(issues)
        noun = "error" if len(self.issues) == 1 else "errors"
        lines = [f"Invalid configuration ({len(self.issues)} {noun}):"]
        lines += [f"  - {issue}" for issue in self.issues]
        super().__init__("\n".join(lines))


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: a missing file, a config.json that disagrees with the layout,
    or every missing, unexpected or misshapen tensor."""
