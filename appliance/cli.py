"""`python -m appliance [overrides]`: compose, validate, then validate / plan / serve / bench.

Config errors exit with status 2 and no traceback, both ours (ConfigError, printed with every issue)
and Hydra's composition errors (unknown key, bad type, unknown group option), which Hydra prints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from appliance.config import CONF_DIR, ConfigError, RuntimeConfig, compose_runtime_config
from appliance.planner import InsufficientMemoryError

EXIT_CONFIG = 2
_task_started = False


def _output_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig
    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def write_result(name: str, result: dict[str, Any]) -> Path | None:
    """Write a job's structured result as JSON into its Hydra job directory."""
    out = _output_dir()
    if out is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path


def run_validate(rc: RuntimeConfig) -> dict[str, Any]:
    from appliance.report import cache_group_table
    print(rc.resolved_yaml)
    print(f"== cache groups of {rc.model.name} ({rc.model.arch}) ==")
    print(cache_group_table(rc.model.cache_groups, rc.max_model_len, rc.decode_batch))
    return {"status": "ok", "mode": "validate"}


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """Run one job; in a multirun a bad point is returned as a result with its reason instead of exiting."""
    try:
        rc = compose_runtime_config(cfg)
        if rc.mode == "validate":
            return run_validate(rc)
        if rc.mode == "plan":
            from appliance.plan_mode import run_plan
            return run_plan(rc)
        if rc.mode == "bench":
            from appliance.bench_mode import run_bench
            return run_bench(rc)
        from appliance.server import serve
        return serve(rc)
    except (ConfigError, InsufficientMemoryError) as exc:
        status = "invalid" if isinstance(exc, ConfigError) else "does_not_fit"
        print(f"error: {exc}", file=sys.stderr)
        result = {"status": status, "reason": str(exc)}
        write_result("result.json", result)
        if _is_multirun():
            return result
        sys.exit(EXIT_CONFIG)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> dict[str, Any]:
    global _task_started
    _task_started = True
    return run_job(cfg)


def main() -> None:
    try:
        _hydra_main()
    except SystemExit as exc:
        # Hydra exits 1 after printing a composition error (unknown key, bad type, unknown option).
        multirun = any(a in ("-m", "--multirun") for a in sys.argv[1:])
        if exc.code == 1 and not _task_started and not multirun:
            raise SystemExit(EXIT_CONFIG) from None
        raise
