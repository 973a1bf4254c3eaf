"""Job results as JSON files in the Hydra job directory (sweeps collect them from there)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_result(output_dir: Path | None, name: str, result: dict[str, Any]) -> Path | None:
    """Write `result` as output_dir/name; nothing when there is no output directory (tests, offline API)."""
    if output_dir is None:
        return None
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / name
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path
