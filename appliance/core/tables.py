"""Plain-text tables for the terminal: cache groups, capacity plans, startup reports."""

from __future__ import annotations

from typing import Sequence

from appliance.core.archs.parameter_counts import ParameterCounts
from appliance.core.kv_cache_spec import CacheGroupSpec, bytes_per_slot, scratch_bytes
from appliance.core.planner import CapacityPlan
from appliance.core.units import human_bytes


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    def line(r: list[str]) -> str:
        return "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths)))
    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def _cell(v: object) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.1%}" if v <= 1 else f"{v:,.1f}"
    return str(v)


def cache_group_table(specs: Sequence[CacheGroupSpec], max_model_len: int, decode_batch: int) -> str:
    rows = [(s.name, s.history, s.num_layers, s.rows_per_block, f"{s.row_dtype} x {s.row_width}"
             + (f" + {s.row_extra_bytes} B" if s.row_extra_bytes else ""), s.page_size_bytes,
             s.max_blocks_per_seq, s.max_memory_usage_bytes) for s in specs]
    table = format_table(["group", "history", "layers", "rows/block", "row", "page bytes", "max blocks/seq",
                          "bytes/seq"], rows)
    return (f"{table}\n"
            f"bytes_per_slot (one sequence at max_model_len {max_model_len}): {bytes_per_slot(specs):,} B\n"
            f"scratch (decode_batch {decode_batch} x sum of page bytes): {scratch_bytes(specs, decode_batch):,} B")


def capacity_plan_table(plan: CapacityPlan, title: str = "KV-cache capacity plan") -> str:
    hb = human_bytes
    dev_rows = [(d.name, hb(d.total_bytes), hb(d.free_bytes), hb(d.usable_bytes), hb(d.peak_non_kv_bytes),
                 hb(d.non_torch_margin_bytes), hb(d.budget_bytes), hb(d.headroom_bytes)) for d in plan.devices]
    # Identical devices collapse to one row so that a 16-device profile stays readable.
    if len({r[1:] for r in dev_rows}) == 1 and len(dev_rows) > 1:
        dev_rows = [(f"{dev_rows[0][0]} (x{len(dev_rows)} identical)",) + dev_rows[0][1:]]
    devices = format_table(["device", "total", "free", "total x util", "- peak_non_kv", "- non-torch margin",
                            "= budget", "headroom"], dev_rows)
    groups = format_table(
        ["group", "history", "layers", "rows/block", "page bytes", "blocks/seq", "num_blocks", "bytes",
         "share of budget"],
        [(g.name, g.history, g.num_layers, g.rows_per_block, g.page_size_bytes, g.max_blocks_per_seq, g.num_blocks,
          g.bytes, g.share_of_budget) for g in plan.groups])
    lines = [
        f"== {title} ==",
        devices,
        "",
        groups,
        "",
        f"utilization {plan.utilization}   decode_batch {plan.decode_batch}   max_model_len {plan.max_model_len}"
        f"   block_size {plan.block_size}",
        f"limiting device {plan.limiting_device}: budget {plan.budget_bytes:,} B = scratch {plan.scratch_bytes:,} B"
        f" + KV cache {plan.kv_cache_bytes:,} B ({plan.capacity_slots:,} slots x {plan.bytes_per_slot:,} B)"
        f" + unused {plan.unused_bytes:,} B",
        f"per device:  capacity_slots {plan.capacity_slots:,} (sequences of max_model_len {plan.max_model_len} "
        f"one device's pools hold)   KV tokens {plan.kv_tokens_per_device:,}",
        f"deployment:  max concurrency {plan.max_concurrency:,} sequences at max_model_len = "
        f"{plan.capacity_slots:,} slots x {plan.data_parallel_size:,} data-parallel "
        f"rank(s), each with its own pools, over {len(plan.devices)} device(s)",
    ]
    if plan.override:
        lines.append(f"override: {plan.override}")
    return "\n".join(lines)


def startup_report_table(report) -> str:
    """The startup lines serving engineers look for: what was loaded, measured, planned and allocated."""
    head = (f"{report.model_name} ({report.arch}) on {report.device_count} x {report.device_kind}; weights "
            f"{report.weights}; load {report.load_seconds:.2f} s, profile {report.profile_seconds:.2f} s, "
            f"allocate {report.allocate_seconds:.2f} s")
    if report.allocation_retries:
        head += f"; allocation retried {report.allocation_retries} time(s) with fewer slots"
    notes = "".join(f"\nnote: {n}" for n in report.notes)
    return capacity_plan_table(report.plan, title=f"startup report: {head}") + notes


def parameter_table(counts: ParameterCounts) -> str:
    """Parameter counts (total, active per token, MTP) and the checkpoint's bytes, replicated vs routed experts."""
    billions = lambda n: f"{n / 1e9:,.2f} billion"  # noqa: E731
    rows = [("total (main model)", counts.total, billions(counts.total)),
            ("active per token (embedding and head included)", counts.active, billions(counts.active)),
            ("MTP layers (held, not served)", counts.mtp, billions(counts.mtp)),
            ("checkpoint bytes: replicated", counts.replicated_bytes, human_bytes(counts.replicated_bytes)),
            ("checkpoint bytes: routed experts", counts.expert_bytes, human_bytes(counts.expert_bytes)),
            ("checkpoint bytes: all", counts.total_bytes, human_bytes(counts.total_bytes))]
    return format_table(["parameters", "count", ""], rows)
