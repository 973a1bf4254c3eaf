"""sweep.png: the key numbers against the swept value (capacity for plan sweeps; throughput and latency for
bench sweeps). matplotlib is imported only when the plot is drawn."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from appliance.sweep.jobs import SweepRow
from appliance.sweep.tables import fixed_overrides, sweep_title, varying_keys

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


def as_float(v: str | None) -> float | None:
    if v is None:
        return None
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
        numeric = all(as_float(v) is not None for v in values)
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
    numeric = all(as_float(v) is not None for v in xs_text)
    position = {v: (as_float(v) if numeric else i) for i, v in enumerate(xs_text)}

    combos = list(dict.fromkeys(tuple(r.overrides.get(k, "") for k in others) for r in rows))
    first_values = list(dict.fromkeys(c[0] for c in combos)) if others else [""]
    tails = list(dict.fromkeys(c[1:] for c in combos))
    cmap = plt.get_cmap("tab10")
    colors = [cmap(i) for i in range(cmap.N)]          # an int picks the colormap's i-th color itself
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
