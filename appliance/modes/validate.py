"""`mode=validate`: print the resolved config and the derived cache-group table; touches no device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from appliance.core.config import RuntimeConfig
from appliance.core.tables import cache_group_table


def run_validate(rc: RuntimeConfig, output_dir: Path | None = None) -> dict[str, Any]:
    print(rc.resolved_yaml)
    print(f"== cache groups of {rc.model.name} ({rc.model.arch}) ==")
    print(cache_group_table(rc.model.cache_groups, rc.max_model_len, rc.decode_batch))
    return {"status": "ok", "mode": "validate"}
