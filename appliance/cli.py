"""`python -m appliance [overrides]`: compose, validate, then validate / plan / serve / bench.

One error contract for every startup fault (appliance.core.errors.StartupError: a bad or unknown key, a
checkpoint, tokenizer or TLS file that cannot be used, a device that is missing or too small, a port that
cannot be bound): one message naming the key, file or device and the fix on stderr, exit status 2, no
traceback (HYDRA_FULL_ERROR=1 adds it). Hydra's composition errors (bad type, unknown group option) exit 2
too. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from appliance.config.compose import compose_runtime_config
from appliance.config.overrides import CONF_DIR, check_override_keys
from appliance.config.schema import register_schema
from appliance.core.errors import ConfigError, StartupError
from appliance.core.logs import configure_logging
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


def _full_error() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def result_status(exc: StartupError) -> str:
    """How a sweep table lists a job that stopped at startup."""
    if isinstance(exc, ConfigError):
        return "invalid"
    if isinstance(exc, InsufficientMemoryError):
        return "does_not_fit"
    return "startup_failed"


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """Run one job; in a multirun a bad point is returned as a result with its reason instead of exiting.

    Modes are imported only when chosen: validate and plan never load torch. Under torchrun (serve, bench) the
    process of RANK 0 is the owner and runs the mode; every other rank executes the owner's steps (npu.worker).
    """
    out = _output_dir()
    try:
        rc = compose_runtime_config(cfg)
        configure_logging(rc.logging.format, rc.logging.level, console_level="WARNING" if _is_multirun() else None)
        if rc.mode == "validate":
            from appliance.modes.validate import run_validate
            return run_validate(rc, out)
        if rc.mode == "plan":
            from appliance.modes.plan import run_plan
            return run_plan(rc, out, quiet=_is_multirun())
        if rc.mode in ("serve", "bench") and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            from npu.ranks import Rendezvous  # (torch: only under torchrun, whose variables these are)
            rdv = Rendezvous.from_environment()
            if rdv is not None and rdv.rank != 0:      # under torchrun: not the owner, one of its ranks
                from npu.leaving import leave_process
                from npu.worker import run_rank
                status = run_rank(rc, rdv)
                if status:
                    leave_process(status)
                return {"status": "ok", "mode": rc.mode, "rank": rdv.rank}
        if rc.mode == "bench":
            from appliance.modes.bench import run_bench
            return run_bench(rc, out, quiet=_is_multirun())
        from appliance.serve.server import serve
        result = serve(rc, output_dir=out)
        if not _is_multirun():
            leave_after_serving()
        return result
    except StartupError as exc:
        if _full_error():
            raise
        print(f"error: {exc}", file=sys.stderr)
        result = {"status": result_status(exc), "reason": str(exc)}
        write_result(out, "result.json", result)
        if _is_multirun():
            return result
        if _in_process_group():         # the owner of failed ranks: leave as they do (npu.leaving.leave_process)
            from npu.leaving import leave_process
            leave_process(EXIT_CONFIG)
        sys.exit(EXIT_CONFIG)


def leave_after_serving() -> None:
    """End the process once the server has stopped, skipping the interpreter's teardown.

    Everything that matters is done by then (responses flushed, the engine and its ranks shut down, output
    flushed here). The teardown adds nothing but risk and time: an engine thread still inside torch (a start
    cut short by SIGTERM, a step outlasting the shutdown's bound) is killed by CPython with pthread_exit, whose
    unwinding through torch's noexcept C++ frames calls std::terminate ("terminate called without an active
    exception", exit 134); and freeing the model and KV pools object by object takes seconds."""
    from npu.leaving import leave_process
    leave_process(0)


def _in_process_group() -> bool:
    """Whether this process joined torch.distributed ranks (checked without importing torch)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> dict[str, Any]:
    global _task_started
    _task_started = True
    return run_job(cfg)


def command_line_overrides(argv: list[str]) -> list[str]:
    """The overrides of a command line, parsed the way @hydra.main parses them."""
    from hydra._internal.utils import get_args_parser  # Hydra's own parser: flags and overrides as it sees them

    args, _ = get_args_parser().parse_known_args(argv)
    return list(args.overrides)


def main() -> None:
    register_schema()
    try:
        check_override_keys(command_line_overrides(sys.argv[1:]))   # typos get the closest key, not Hydra's '+' hint
        _hydra_main()
    except StartupError as exc:      # a bad override key; with HYDRA_FULL_ERROR=1 also a job's startup fault
        if _full_error():
            traceback.print_exc()
        else:
            print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    except SystemExit as exc:
        # Hydra exits 1 after printing a composition error (bad type, unknown group option).
        multirun = any(a in ("-m", "--multirun") for a in sys.argv[1:])
        if exc.code == 1 and not _task_started and not multirun:
            raise SystemExit(EXIT_CONFIG) from None
        raise
