"""Startup faults: errors the operator fixes in the config, the files or the host, never bugs.

Every one is a StartupError whose message names the key, file or device and the fix; the CLI prints it
and exits with status 2 and no traceback (HYDRA_FULL_ERROR=1 adds the traceback). Anything else that
escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

from dataclasses import dataclass


class StartupError(Exception):
    """A fault found while starting, with a message that says what to change."""


@dataclass(frozen=True)
class ConfigIssue:
    path: str
    value: object
    rule: str

    def __str__(self) -> str:
        return f"{self.path} = {self.value!r}: {self.rule}"


class ConfigError(StartupError, ValueError):
    """Raised before any device work, with every issue at once (each naming its key path)."""

    def __init__(self, issues: list[ConfigIssue]):
        self.issues = list(issues)
        noun = "error" if len(self.issues) == 1 else "errors"
        lines = [f"Invalid configuration ({len(self.issues)} {noun}):"]
        lines += [f"  - {issue}" for issue in self.issues]
        super().__init__("\n".join(lines))


class CheckpointError(StartupError, ValueError):
    """A checkpoint that cannot serve the model: a missing or unreadable file, a config.json that disagrees with
    the layout, every missing, unexpected or misshapen tensor, or a tensor holding NaN or inf."""


class TokenizerError(StartupError, ValueError):
    """A tokenizer.json that is missing, cannot be parsed, or has more ids than the model's vocabulary."""


class EnvironmentSettingError(StartupError, ValueError):
    """An APPLIANCE_* environment variable set to a value it does not take (the message names it and the values)."""
