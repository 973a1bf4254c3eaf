"""`[sweep k/N]` progress lines, wherever the jobs run (in-process, joblib workers, cluster nodes)."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

from appliance.core.secrets import redact
from appliance.sweep.jobs import result_metrics
from appliance.sweep.tables import format_value

PROGRESS_DIR = ".sweep_progress"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def job_summary(result: Any) -> str:
    """A few words for the progress line: status and the headline number."""
    if not isinstance(result, dict):
        return "done"
    status = str(result.get("status", "?"))
    if status != "ok":
        return status   # the job printed its reason; the final table lists it again
    m = result_metrics(result)
    for k in ("capacity_slots", "output_tokens_per_s"):
        if k in m and result.get("mode") == ("plan" if k == "capacity_slots" else "bench"):
            return f"ok, {k} {format_value(m[k])}"
    return "ok"


class SweepProgress:
    """`[sweep k/N]` lines as jobs finish, wherever they run.

    A job's process (main process, joblib worker, cluster node) drops a marker file into the sweep
    directory; the main process prints markers it has not printed yet, from on_job_end when the job ran
    in-process and from a polling thread otherwise. One printer, so lines never repeat or interleave.
    """

    def __init__(self, sweep_dir: Path, total: int | None, hide: Sequence[str] = (), stream: Any = None) -> None:
        self.dir = Path(sweep_dir) / PROGRESS_DIR
        self.total = total
        self.hide = set(hide)
        self.stream = stream
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def mark(sweep_dir: Path, job: int, overrides: Sequence[str], summary: str) -> None:
        d = Path(sweep_dir) / PROGRESS_DIR
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{job}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"job": job, "overrides": redact(list(overrides)), "summary": summary}))
        os.replace(tmp, d / f"{job}.json")

    def poll(self) -> int:
        """Print lines for newly finished jobs; returns how many jobs are done."""
        with self._lock:
            try:
                new = [p for p in self.dir.glob("*.json") if p.name not in self._seen]
            except OSError:
                new = []
            new.sort(key=lambda p: (p.stat().st_mtime_ns, p.name))
            for p in new:
                try:
                    info = json.loads(p.read_text())
                except (OSError, ValueError):
                    continue
                self._seen.add(p.name)
                shown = " ".join(o for o in info.get("overrides", []) if o not in self.hide)
                total = self.total if self.total is not None else "?"
                print(f"[sweep {len(self._seen)}/{total}] job {info.get('job')} {shown} -> {info.get('summary')}",
                      file=self.stream or sys.stdout, flush=True)
            return len(self._seen)

    def start(self, interval_s: float = 0.5) -> None:
        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.poll()
        self._thread = threading.Thread(target=loop, name="sweep-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.poll()


def count_jobs(config: Any) -> int | None:
    """Jobs the basic sweeper will launch (sweeper params x command-line sweeps); None if unknown."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        from appliance.config.plain import plain_dict, plain_list

        if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
            return None
        params = plain_dict(config.hydra.sweeper.params, resolve=False) if config.hydra.sweeper.get("params") else {}
        args = [f"{k}={v}" for k, v in params.items()]
        args += [str(o) for o in plain_list(config.hydra.overrides.task)]
        parsed = OverridesParser.create().parse_overrides(args)
        return sum(len(batch) for batch in BasicSweeper.split_arguments(parsed, None))
    except Exception:  # noqa: BLE001 - a glob sweep or another sweeper: progress then shows k/?
        return None


def constant_overrides(config: Any) -> list[str]:
    """Command-line overrides that are the same for every job (not worth repeating on progress lines)."""
    from appliance.config.plain import plain_list
    task = [str(o) for o in plain_list(config.hydra.overrides.task)]
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        parsed = OverridesParser.create().parse_overrides(task)
        return [o.input_line for o in parsed if not o.is_sweep_override() and o.input_line is not None]
    except Exception:  # noqa: BLE001 - unparsable here (e.g. a glob over groups): show everything
        return []
