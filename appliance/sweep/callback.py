"""The Hydra callback that turns a multirun into a sweep: progress, crash capture, the final table and plot."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from appliance.core.secrets import redact
from appliance.sweep.collect import collect_sweep
from appliance.sweep.jobs import RESULT_FILES
from appliance.sweep.progress import (
    SweepProgress,
    constant_overrides,
    count_jobs,
    job_summary,
)


class SweepCollector(Callback):
    """Hydra callback (registered in conf/config.yaml under hydra.callbacks.sweep).

    on_multirun_start: count the jobs, start the progress printer.
    on_job_end (in the job's process): turn a crash into a `crashed` result with its traceback so the
        sweep goes on, and drop a progress marker.
    on_multirun_end: write sweep.csv / sweep.md / sweep.png, print the table; exit 1 if any job crashed.
    Does nothing for single runs.
    """

    def __init__(self, plot_x: str | None = None, progress_interval_s: float = 0.5) -> None:
        self.plot_x = plot_x
        self.progress_interval_s = progress_interval_s
        self._main_pid: int | None = None
        self._started: float | None = None
        self._progress: SweepProgress | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Launchers pickle callbacks into worker processes; the printer thread stays in the main process.
        state = dict(self.__dict__)
        state["_progress"] = None
        return state

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._main_pid = os.getpid()
        sweep_dir = Path(str(config.hydra.sweep.dir))
        total = count_jobs(config)
        self._progress = SweepProgress(sweep_dir, total, hide=redact(constant_overrides(config)))
        print(f"[sweep] {total if total is not None else 'some'} jobs; results in {sweep_dir}", flush=True)
        self._started = time.perf_counter()
        self._progress.start(self.progress_interval_s)

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN:
            return
        job_dir = Path(str(config.hydra.runtime.output_dir))
        if job_return.status == JobStatus.FAILED:
            exc = job_return._return_value  # the public JobReturn.return_value re-raises it; no other accessor
            result = crash_result(exc)
            print(f"[sweep] job {config.hydra.job.num} crashed:\n{result['traceback']}", file=sys.stderr, flush=True)
            if not any((job_dir / n).is_file() for n in RESULT_FILES):
                job_dir.mkdir(parents=True, exist_ok=True)
                (job_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
            # The sweep goes on; on_multirun_end reports the crash and sets the exit status.
            job_return.status = JobStatus.COMPLETED
            job_return.return_value = result
        SweepProgress.mark(Path(str(config.hydra.sweep.dir)), int(config.hydra.job.num),
                           list(job_return.overrides or []), job_summary(job_return.return_value))
        if self._progress is not None and os.getpid() == self._main_pid:
            self._progress.poll()

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
            shutil.rmtree(self._progress.dir, ignore_errors=True)
        summary = collect_sweep(Path(str(config.hydra.sweep.dir)), plot_x=self.plot_x)
        if self._started is not None:
            print(f"[sweep] {len(summary.rows)} jobs in {time.perf_counter() - self._started:.1f} s")
        if summary.crashed:
            print(f"[sweep] {len(summary.crashed)} of {len(summary.rows)} jobs crashed; see their job directories",
                  file=sys.stderr, flush=True)
            raise SystemExit(1)


def crash_result(exc: BaseException) -> dict[str, Any]:
    return {"status": "crashed", "reason": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}
