"""A sweep's jobs read back from their directories: overrides (.hydra/overrides.yaml), outcome and key numbers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULT_FILES = ("bench.json", "plan.json", "result.json")   # first one present wins
PLAN_METRICS = ("capacity_slots", "kv_tokens_per_device", "max_concurrency", "budget_bytes", "bytes_per_slot",
                "scratch_bytes")
BENCH_METRICS = ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                 "peak_memory_bytes")


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


def load_yaml(path: Path) -> Any:
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
        scalars = {k: v for k, v in metrics.items() if is_number(v)}
        out.update({k: scalars[k] for k in BENCH_METRICS if k in scalars})
        out.update({k: v for k, v in scalars.items() if k not in out})
        plan = (result.get("startup") or {}).get("plan") or {}
        for k in ("capacity_slots", "kv_tokens_per_device"):
            if is_number(plan.get(k)):
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
        each = f" ({total / (1 << 30):g} GiB each)" if is_number(total) else ""
        return f"{len(devices)} x {kind}{each}"
    return None


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_job(job_dir: Path, job: int | None = None) -> SweepRow:
    """Read one job directory; a job with no result file is reported as crashed, never skipped."""
    job_dir = Path(job_dir)
    hydra_dir = job_dir / ".hydra"
    overrides: dict[str, str] = {}
    if (hydra_dir / "overrides.yaml").is_file():
        overrides = dict(parse_override(str(o)) for o in (load_yaml(hydra_dir / "overrides.yaml") or []))
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
        num = ((load_yaml(hydra_yaml) or {}).get("hydra") or {}).get("job", {}).get("num")
        if isinstance(num, int):
            return num
    return -1


def collect(sweep_dir: Path) -> list[SweepRow]:
    """Every job directory under a sweep directory (any hydra.sweep.subdir), in job order."""
    sweep_dir = Path(sweep_dir)
    job_dirs = sorted({p.parent.parent for p in sweep_dir.glob("**/.hydra/overrides.yaml")})
    rows = [read_job(d) for d in job_dirs]
    return sorted(rows, key=lambda r: (r.job, str(r.job_dir)))
