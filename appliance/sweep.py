"""Sweeps: a Hydra callback that shows progress and collects every job's result into a table and a plot.

Each job writes its result as JSON into its own job directory (plan.json, bench.json or result.json),
so the collector reads files, not JobReturn objects: that works the same for the basic launcher, joblib
workers and cluster launchers (submitit, Ray) as long as the sweep directory is on a shared filesystem.

    python -m appliance -m +model=dsv4 device=ascend_a3 mode=plan +sweep=capacity
    python -m appliance.sweep multirun/2026-01-01/12-00-00      # collect (again) after the fact

Outputs in the sweep directory: sweep.csv (every column, raw numbers), sweep.md (the same table for
people), sweep.png (capacity against the swept value; throughput and latency for bench sweeps).
Nothing here imports torch; matplotlib is imported only when the plot is drawn.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from hydra.experimental.callback import Callback

RESULT_FILES = ("bench.json", "plan.json", "result.json")   # first one present wins
PROGRESS_DIR = ".sweep_progress"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
REASON_WIDTH = 32                                               # terminal table only; full reasons follow it

PLAN_METRICS = ("capacity_slots", "kv_tokens_per_device", "max_concurrency", "budget_bytes", "bytes_per_slot",
                "scratch_bytes")
BENCH_METRICS = ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                 "peak_memory_bytes")

# Units for axis labels of the usual swept keys.
KEY_UNITS = {
    "npu_memory_utilization": "fraction of device memory",
    "max_model_len": "tokens",
    "decode_batch": "rows per decode step",
    "max_num_seqs": "sequences",
    "max_num_batched_tokens": "tokens per step",
    "plan.peak_non_kv_bytes": "bytes",
    "kv_cache.kv_cache_memory_bytes": "bytes",
}

# (metric, y label, scale) per panel.
PLAN_PANELS = (("capacity_slots", "capacity slots per device\n(sequences at max_model_len)", 1.0),
               ("kv_tokens_per_device", "KV-cache tokens per device (tokens)", 1.0))
BENCH_PANELS = (("output_tokens_per_s", "output throughput (tokens/s)", 1.0),
                ("ttft_p50_s", "time to first token, p50 (ms)", 1000.0),
                ("tpot_p50_s", "time per output token, p50 (ms)", 1000.0))


@dataclass
class SweepRow:
    """One job of a sweep: its overrides, outcome and key numbers."""

    job: int
    job_dir: Path
    overrides: dict[str, str]          # key (without +/++/~) -> value as given on the command line
    status: str                        # ok | invalid | does_not_fit | crashed
    reason: str = ""
    mode: str | None = None
    model: str | None = None
    devices: str | None = None         # "16 x npu": where the numbers hold
    metrics: dict[str, float | int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class SweepSummary:
    sweep_dir: Path
    rows: list[SweepRow]
    csv_path: Path
    md_path: Path
    png_path: Path

    @property
    def crashed(self) -> list[SweepRow]:
        return [r for r in self.rows if r.status == "crashed"]


# ---------------------------------------------------------------- reading job directories

def parse_override(text: str) -> tuple[str, str]:
    """`+model=dsv4` -> ("model", "dsv4"); `~key` -> ("key", "<deleted>")."""
    key, sep, value = text.partition("=")
    key = key.lstrip("+~")
    return key, (value if sep else "<deleted>")


def _load_yaml(path: Path) -> Any:
    import yaml
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with path.open() as f:
        return yaml.load(f, Loader=loader)


def result_metrics(result: dict[str, Any]) -> dict[str, float | int]:
    """The key numbers of a plan or bench result, flat and in a stable order."""
    out: dict[str, float | int] = {}
    if result.get("mode") == "plan" and isinstance(result.get("plan"), dict):
        plan = result["plan"]
        out.update({k: plan[k] for k in PLAN_METRICS if k in plan})
        for g in plan.get("groups", ()):
            out[f"num_blocks_{g['name']}"] = g["num_blocks"]
    elif result.get("mode") == "bench":
        metrics = result.get("metrics") or {}
        scalars = {k: v for k, v in metrics.items() if _is_number(v)}
        out.update({k: scalars[k] for k in BENCH_METRICS if k in scalars})
        out.update({k: v for k, v in scalars.items() if k not in out})
        plan = (result.get("startup") or {}).get("plan") or {}
        for k in ("capacity_slots", "kv_tokens_per_device"):
            if _is_number(plan.get(k)):
                out[k] = plan[k]
    return out


def result_model(result: dict[str, Any]) -> str | None:
    return result.get("model") or (result.get("startup") or {}).get("model_name")


def result_devices(result: dict[str, Any]) -> str | None:
    """`16 x npu` from a plan's devices or a bench's startup report."""
    startup = result.get("startup") or {}
    if startup.get("device_kind"):
        return f"{startup.get('device_count', '?')} x {startup['device_kind']}"
    devices = (result.get("plan") or {}).get("devices") or []
    if devices:
        kind = str(devices[0].get("name", "?")).split(":")[0]
        total = devices[0].get("total_bytes")
        each = f" ({total / (1 << 30):g} GiB each)" if _is_number(total) else ""
        return f"{len(devices)} x {kind}{each}"
    return None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_job(job_dir: Path, job: int | None = None) -> SweepRow:
    """Read one job directory; a job with no result file is reported as crashed, never skipped."""
    job_dir = Path(job_dir)
    hydra_dir = job_dir / ".hydra"
    overrides: dict[str, str] = {}
    if (hydra_dir / "overrides.yaml").is_file():
        overrides = dict(parse_override(str(o)) for o in (_load_yaml(hydra_dir / "overrides.yaml") or []))
    if job is None:
        job = _job_number(job_dir)
    for name in RESULT_FILES:
        path = job_dir / name
        if not path.is_file():
            continue
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            return SweepRow(job, job_dir, overrides, "crashed", f"unreadable {name}: {exc}")
        return SweepRow(job, job_dir, overrides, str(result.get("status", "unknown")),
                        str(result.get("reason", "") or ""), result.get("mode"), result_model(result),
                        result_devices(result), result_metrics(result))
    return SweepRow(job, job_dir, overrides, "crashed",
                    f"no result file ({', '.join(RESULT_FILES)}) in {job_dir}: the job crashed or was killed")


def _job_number(job_dir: Path) -> int:
    if job_dir.name.isdigit():
        return int(job_dir.name)
    hydra_yaml = job_dir / ".hydra" / "hydra.yaml"
    if hydra_yaml.is_file():
        num = ((_load_yaml(hydra_yaml) or {}).get("hydra") or {}).get("job", {}).get("num")
        if isinstance(num, int):
            return num
    return -1


def collect(sweep_dir: Path) -> list[SweepRow]:
    """Every job directory under a sweep directory (any hydra.sweep.subdir), in job order."""
    sweep_dir = Path(sweep_dir)
    job_dirs = sorted({p.parent.parent for p in sweep_dir.glob("**/.hydra/overrides.yaml")})
    rows = [read_job(d) for d in job_dirs]
    return sorted(rows, key=lambda r: (r.job, str(r.job_dir)))


# ---------------------------------------------------------------- tables

def override_keys(rows: Sequence[SweepRow]) -> list[str]:
    keys: dict[str, None] = {}
    for r in rows:
        keys.update(dict.fromkeys(r.overrides))
    return list(keys)


def varying_keys(rows: Sequence[SweepRow]) -> list[str]:
    """Overridden keys whose value differs between jobs (the swept axes)."""
    return [k for k in override_keys(rows) if len({r.overrides.get(k) for r in rows}) > 1]


def fixed_overrides(rows: Sequence[SweepRow]) -> list[str]:
    vary = set(varying_keys(rows))
    return [f"{k}={rows[0].overrides[k]}" for k in override_keys(rows) if k not in vary]


def metric_keys(rows: Sequence[SweepRow]) -> list[str]:
    keys: dict[str, None] = {}
    for r in rows:
        keys.update(dict.fromkeys(r.metrics))
    return list(keys)


def write_csv(rows: Sequence[SweepRow], path: Path) -> Path:
    """All overridden keys, status, reason, then every number, raw (no thousands separators)."""
    okeys, mkeys = override_keys(rows), metric_keys(rows)
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["job", *okeys, "status", "reason", *mkeys])
        for r in rows:
            w.writerow([r.job, *(r.overrides.get(k, "") for k in okeys), r.status, r.reason,
                        *(r.metrics.get(k, "") for k in mkeys)])
    return Path(path)


def _fmt(v: Any) -> str:
    if v is None or v == "":
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def _one_line(text: str) -> str:
    """A multi-line reason on one line: `Invalid (2 errors): - a; - b`."""
    out = ""
    for line in filter(None, (ln.strip() for ln in text.splitlines())):
        sep = "" if not out else " " if out.endswith(":") else "; "
        out += sep + line
    return out


def table_rows(rows: Sequence[SweepRow], *, metrics: Sequence[str],
               reason_width: int | None) -> tuple[list[str], list[list[str]]]:
    """Headers and formatted cells: the swept keys (all overrides if none varies), status, reason, numbers."""
    keys = varying_keys(rows) or override_keys(rows)
    headers = ["job", *keys, "status", "reason", *metrics]
    body = []
    for r in rows:
        reason = _one_line(r.reason)
        if reason_width is not None and len(reason) > reason_width:
            reason = reason[:reason_width - 1] + "…"
        body.append([str(r.job), *(r.overrides.get(k, "") for k in keys), r.status, reason,
                     *(_fmt(r.metrics.get(k)) for k in metrics)])
    return headers, body


def sweep_title(rows: Sequence[SweepRow]) -> str:
    models = sorted({r.model for r in rows if r.model})
    modes = sorted({r.mode for r in rows if r.mode})
    what = {"plan": "KV-cache capacity plan sweep", "bench": "benchmark sweep"}.get(modes[0] if len(modes) == 1 else "",
                                                                                     "sweep")
    devices = sorted({r.devices for r in rows if r.devices})
    return f"{what}: {', '.join(models) or 'unknown model'}" + (f" on {', '.join(devices)}" if devices else "")


def write_markdown(rows: Sequence[SweepRow], path: Path) -> Path:
    headers, body = table_rows(rows, metrics=metric_keys(rows), reason_width=None)
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = [f"# {sweep_title(rows)}", ""]
    fixed = fixed_overrides(rows)
    if fixed:
        lines += [f"Fixed overrides: `{' '.join(fixed)}`", ""]
    ok = sum(r.ok for r in rows)
    lines += [f"{len(rows)} jobs: {ok} ok, {len(rows) - ok} not ok.", ""]
    lines.append("| " + " | ".join(headers) + " |")
    lines.append("|" + "|".join("---" if i < len(headers) - len(metric_keys(rows)) else "---:"
                                for i in range(len(headers))) + "|")
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in body]
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)


def terminal_table(rows: Sequence[SweepRow], max_reasons: int = 10) -> str:
    """The table without per-group block counts (in sweep.csv and sweep.md), then the full reasons."""
    metrics = [k for k in metric_keys(rows) if not k.startswith("num_blocks_")]
    headers, body = table_rows(rows, metrics=metrics, reason_width=REASON_WIDTH)
    cells = [headers] + body
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    first_metric = len(headers) - len(metrics)
    def line(r: list[str]) -> str:
        return "  ".join(v.rjust(w) if i >= first_metric else v.ljust(w)
                         for i, (v, w) in enumerate(zip(r, widths))).rstrip()
    out = [line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in body]
    failed = [r for r in rows if not r.ok]
    for r in failed[:max_reasons]:
        out.append(f"job {r.job} {r.status}: {_one_line(r.reason)}")
    if len(failed) > max_reasons:
        out.append(f"... {len(failed) - max_reasons} more not-ok jobs: see sweep.md")
    return "\n".join(out)


# ---------------------------------------------------------------- plot

def _as_float(v: str) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def choose_x(rows: Sequence[SweepRow], preferred: str | None = None) -> str | None:
    """The swept key for the x axis: `preferred` if swept, else the numeric key with most values."""
    keys = varying_keys(rows)
    if preferred and preferred in keys:
        return preferred
    if not keys:
        return None
    def score(k: str) -> tuple[int, int, int]:
        values = {r.overrides.get(k) for r in rows}
        numeric = all(_as_float(v) is not None for v in values)
        return (numeric, len(values), -keys.index(k))
    return max(keys, key=score)


def _plottable(r: SweepRow, metric: str) -> bool:
    return r.ok and metric in r.metrics and math.isfinite(r.metrics[metric])   # a bench may report NaN


def _x_label(key: str | None) -> str:
    if key is None:
        return "job"
    unit = KEY_UNITS.get(key)
    return f"{key} ({unit})" if unit else key


def plot_sweep(rows: Sequence[SweepRow], path: Path, *, x_key: str | None = None) -> Path:
    """Key numbers against the swept value, one line per combination of the other swept keys."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    modes = {r.mode for r in rows if r.ok}
    panels = BENCH_PANELS if "bench" in modes and "plan" not in modes else PLAN_PANELS
    x_key = choose_x(rows, x_key)
    others = [k for k in varying_keys(rows) if k != x_key]

    def xval(r: SweepRow) -> str:
        return r.overrides.get(x_key, "") if x_key else str(r.job)
    xs_text = list(dict.fromkeys(xval(r) for r in rows))
    numeric = all(_as_float(v) is not None for v in xs_text)
    position = {v: (_as_float(v) if numeric else i) for i, v in enumerate(xs_text)}

    combos = list(dict.fromkeys(tuple(r.overrides.get(k, "") for k in others) for r in rows))
    first_values = list(dict.fromkeys(c[0] for c in combos)) if others else [""]
    tails = list(dict.fromkeys(c[1:] for c in combos))
    colors = plt.get_cmap("tab10").colors
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ("-", "v"), ("--", "P"), (":", "X")]

    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.8), squeeze=False)
    failed = [r for r in rows if not r.ok]
    legend: dict[str, Any] = {}
    for ax, (metric, ylabel, scale) in zip(axes[0], panels):
        drew = False
        for combo in combos:
            pts = sorted((position[xval(r)], r.metrics[metric] * scale) for r in rows
                         if _plottable(r, metric) and tuple(r.overrides.get(k, "") for k in others) == combo)
            if not pts:
                continue
            color = colors[first_values.index(combo[0]) % len(colors)] if others else colors[0]
            ls, marker = styles[tails.index(combo[1:]) % len(styles)]
            label = ", ".join(f"{k}={v}" for k, v in zip(others, combo)) or "ok jobs"
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker=marker, color=color, label=label)
            legend.setdefault(label, line)
            drew = True
        values = [r.metrics[metric] * scale for r in rows if _plottable(r, metric)]
        if values and min(values) > 0 and max(values) / min(values) > 30:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(EngFormatter(sep=""))
        if failed:
            # Not-ok points sit on the x axis as red crosses: visible, without faking a value.
            label = f"not ok ({', '.join(sorted({r.status for r in failed}))}; reasons in sweep.md)"
            (mark,) = ax.plot([position[xval(r)] for r in failed], [0.03] * len(failed), "x", color="red",
                              markersize=10, mew=2, linestyle="none", transform=ax.get_xaxis_transform(), label=label)
            legend.setdefault(label, mark)
        if not drew:
            ax.text(0.5, 0.5, f"no ok job reported {metric}", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(_x_label(x_key))
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if not numeric:
            ax.set_xticks(list(position.values()), list(position))
        elif len(xs_text) <= 10:
            ticks = sorted((p, t) for t, p in position.items())
            ax.set_xticks([p for p, _ in ticks], [t for _, t in ticks])
    fixed = fixed_overrides(rows)
    fig.suptitle(sweep_title(rows) + (f"\n{' '.join(fixed)}" if fixed else ""), fontsize=11)
    fig.tight_layout()
    if others or failed:
        # One legend for all panels, below them; one column per value of the first other key (= per colour).
        ncol = max(1, min(len(first_values) if others else 1, 5))
        fig.legend(list(legend.values()), list(legend), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=ncol, fontsize=8, frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def collect_sweep(sweep_dir: Path, *, plot_x: str | None = None, echo: bool = True) -> SweepSummary:
    """Read every job of a sweep and write sweep.csv, sweep.md and sweep.png into the sweep directory."""
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    summary = SweepSummary(sweep_dir, rows, sweep_dir / "sweep.csv", sweep_dir / "sweep.md", sweep_dir / "sweep.png")
    if not rows:
        if echo:
            print(f"[sweep] no job directories under {sweep_dir}", file=sys.stderr)
        return summary
    write_csv(rows, summary.csv_path)
    write_markdown(rows, summary.md_path)
    plot_sweep(rows, summary.png_path, x_key=plot_x)
    if echo:
        ok = sum(r.ok for r in rows)
        print(f"\n== {sweep_title(rows)}: {len(rows)} jobs, {ok} ok, {len(rows) - ok} not ok ==")
        fixed = fixed_overrides(rows)
        if fixed:
            print(f"fixed overrides: {' '.join(fixed)}")
        print(terminal_table(rows))
        if any(k.startswith("num_blocks_") for k in metric_keys(rows)):
            print("(per-group num_blocks are in sweep.csv and sweep.md)")
        print(f"table: {summary.csv_path}\n       {summary.md_path}\nplot:  {summary.png_path}")
    return summary


# ---------------------------------------------------------------- progress

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
            return f"ok, {k} {_fmt(m[k])}"
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
        tmp.write_text(json.dumps({"job": job, "overrides": list(overrides), "summary": summary}))
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

        if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
            return None
        params = OmegaConf.to_container(config.hydra.sweeper.params) if config.hydra.sweeper.get("params") else {}
        args = [f"{k}={v}" for k, v in (params or {}).items()]
        args += list(OmegaConf.to_container(config.hydra.overrides.task))
        parsed = OverridesParser.create().parse_overrides(args)
        return sum(len(batch) for batch in BasicSweeper.split_arguments(parsed, None))
    except Exception:  # noqa: BLE001 - a glob sweep or another sweeper: progress then shows k/?
        return None


def constant_overrides(config: Any) -> list[str]:
    """Command-line overrides that are the same for every job (not worth repeating on progress lines)."""
    from omegaconf import OmegaConf
    task = [str(o) for o in OmegaConf.to_container(config.hydra.overrides.task)]
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        parsed = OverridesParser.create().parse_overrides(task)
        return [o.input_line for o in parsed if not o.is_sweep_override()]
    except Exception:  # noqa: BLE001 - unparsable here (e.g. a glob over groups): show everything
        return []


# ---------------------------------------------------------------- the callback

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
        self._progress = SweepProgress(sweep_dir, count_jobs(config), hide=constant_overrides(config))
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


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m appliance.sweep SWEEP_DIR [--x KEY]`: collect a finished (or aborted) sweep again."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m appliance.sweep", description=main.__doc__)
    p.add_argument("sweep_dir", type=Path)
    p.add_argument("--x", dest="plot_x", default=None, help="swept key for the plot's x axis")
    args = p.parse_args(argv)
    if not args.sweep_dir.is_dir():
        p.error(f"{args.sweep_dir} is not a directory")
    plot_x = args.plot_x
    multirun_yaml = args.sweep_dir / "multirun.yaml"
    if plot_x is None and multirun_yaml.is_file():   # the sweep's own choice (e.g. conf/sweep/capacity.yaml)
        callbacks = ((_load_yaml(multirun_yaml) or {}).get("hydra") or {}).get("callbacks") or {}
        plot_x = (callbacks.get("sweep") or {}).get("plot_x")
    summary = collect_sweep(args.sweep_dir, plot_x=plot_x)
    return 1 if not summary.rows or summary.crashed else 0


if __name__ == "__main__":
    raise SystemExit(main())
