"""A sweep as tables: sweep.csv (every column, raw numbers), sweep.md and the terminal table (for people)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Sequence

from appliance.sweep.jobs import SweepRow

REASON_WIDTH = 32                                               # terminal table only; full reasons follow it


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


def format_value(v: Any) -> str:
    if v is None or v == "":
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def one_line(text: str) -> str:
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
        reason = one_line(r.reason)
        if reason_width is not None and len(reason) > reason_width:
            reason = reason[:reason_width - 1] + "…"
        body.append([str(r.job), *(r.overrides.get(k, "") for k in keys), r.status, reason,
                     *(format_value(r.metrics.get(k)) for k in metrics)])
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
        out.append(f"job {r.job} {r.status}: {one_line(r.reason)}")
    if len(failed) > max_reasons:
        out.append(f"... {len(failed) - max_reasons} more not-ok jobs: see sweep.md")
    return "\n".join(out)
