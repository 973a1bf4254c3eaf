"""`python -m appliance [overrides]`: compose, validate, then validate / plan / serve / bench.

Config errors exit with status 2 and no traceback, both ours (ConfigError, printed with every issue; a
checkpoint that does not match the model, CheckpointError)
and Hydra's composition errors (unknown key, bad type, unknown group option), which Hydra prints.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from appliance.config.compose import CONF_DIR, compose_runtime_config
from appliance.config.schema import register_schema
from appliance.core.errors import CheckpointError, ConfigError
from appliance.core.planner import InsufficientMemoryError
from appliance.modes.results import write_result

EXIT_CONFIG = 2
_task_started = False


def _output_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig
    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """Run one job; in a multirun a bad point is returned as a result with its reason instead of exiting.

    Modes are imported only when chosen: validate and plan never load torch.
    """
    out = _output_dir()
    try:
        rc = compose_runtime_config(cfg)
        if rc.mode == "validate":
            from appliance.modes.validate import run_validate
            return run_validate(rc, out)
        if rc.mode == "plan":
            from appliance.modes.plan import run_plan
            return run_plan(rc, out)
        if rc.mode == "bench":
            from appliance.modes.bench import run_bench
            return run_bench(rc, out)
        from appliance.serve.server import serve
        return serve(rc, output_dir=out)
    except (ConfigError, CheckpointError, InsufficientMemoryError) as exc:
        status = "invalid" if isinstance(exc, ConfigError) else "does_not_fit"
        print(f"error: {exc}", file=sys.stderr)
        result = {"status": status, "reason": str(exc)}
        write_result(out, "result.json", result)
        if _is_multirun():
            return result
        sys.exit(EXIT_CONFIG)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> dict[str, Any]:
    global _task_started
    _task_started = True
    return run_job(cfg)


def main() -> None:
    register_schema()
    try:
        _hydra_main()
    except SystemExit as exc:
        # Hydra exits 1 after printing a composition error (unknown key, bad type, unknown option).
        multirun = any(a in ("-m", "--multirun") for a in sys.argv[1:])
        if exc.code == 1 and not _task_started and not multirun:
            raise SystemExit(EXIT_CONFIG) from None
        raise
