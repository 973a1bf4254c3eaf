"""Sweeps through Hydra multirun: progress, sweep.csv / sweep.md / sweep.png, bad points kept with reasons."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.planner import InsufficientMemoryError
from appliance.modes.plan import make_plan
from tests.conftest import REPO, run_cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLAN_NUMBERS = ("capacity_slots", "kv_tokens_per_device", "max_concurrency", "budget_bytes", "bytes_per_slot",
                "scratch_bytes")


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


# `python -m appliance ...` exactly, except that mode=plan crashes at max_model_len 1024 (a stand-in for a
# bench job that crashes), plus a line at exit that says whether torch was ever imported.
RUN_APPLIANCE_WITH_CRASH = """
import atexit, runpy, sys
import appliance.modes.plan as pm
atexit.register(lambda: print("TORCH_IMPORTED", "torch" in sys.modules))
real = pm.run_plan
def run_plan(rc, output_dir=None, **kw):
    if rc.max_model_len == 1024:
        raise RuntimeError("boom at max_model_len 1024")
    return real(rc, output_dir, **kw)
pm.run_plan = run_plan
sys.argv = ["appliance", *sys.argv[1:]]
runpy.run_module("appliance", run_name="__main__")
"""


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def assert_png(path: Path) -> None:
    import matplotlib.image as mpimg
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300 and img.shape[2] in (3, 4)
    assert img.std() > 0.01          # not a blank canvas


# ---------------------------------------------------------------- a real plan sweep of the DeepSeek V4 layout

# 0.3 x 64 GiB does not fit the estimated weights + activations; max_model_len 1024 crashes (injected).
PLAN_SWEEP = ["+model=dsv4", "device=ascend_a3", "mode=plan", "npu_memory_utilization=0.3,0.9",
              "max_model_len=512,1024,16384"]


@pytest.fixture(scope="module")
def plan_sweep(tmp_path_factory):
    sweep_dir = tmp_path_factory.mktemp("plan_sweep")
    proc = run_python(RUN_APPLIANCE_WITH_CRASH, "-m", *PLAN_SWEEP, f"hydra.sweep.dir={sweep_dir}")
    return sweep_dir, proc


def test_plan_sweep_runs_torch_free_and_shows_progress(plan_sweep):
    sweep_dir, proc = plan_sweep
    assert proc.returncode == 1, proc.stderr[-3000:]          # 1: a job crashed, after the table was written
    assert "TORCH_IMPORTED False" in proc.stdout
    progress = [ln for ln in proc.stdout.splitlines() if ln.startswith("[sweep ")]
    assert [ln.split("]")[0] for ln in progress] == [f"[sweep {i}/6" for i in range(1, 7)]
    assert sum("-> does_not_fit" in ln for ln in progress) == 2
    assert sum("-> crashed" in ln for ln in progress) == 2
    assert str(sweep_dir / "sweep.csv") in proc.stdout and str(sweep_dir / "sweep.png") in proc.stdout


def test_crashed_jobs_are_reported_and_the_sweep_goes_on(plan_sweep):
    sweep_dir, proc = plan_sweep
    assert "RuntimeError: boom at max_model_len 1024" in proc.stderr        # the traceback is shown
    rows = read_csv(sweep_dir / "sweep.csv")
    assert [r["status"] for r in rows if r["max_model_len"] == "1024"] == ["crashed", "crashed"]
    assert {r["reason"] for r in rows if r["max_model_len"] == "1024"} == {"RuntimeError: boom at max_model_len 1024"}
    crashed_dir = next(r["job"] for r in rows if r["status"] == "crashed")
    crash = json.loads((sweep_dir / crashed_dir / "result.json").read_text())
    assert crash["status"] == "crashed" and "Traceback" in crash["traceback"]
    # The jobs after the first crash ran: job 5 (0.9, 16384) is ok.
    assert (rows[-1]["npu_memory_utilization"], rows[-1]["max_model_len"], rows[-1]["status"]) == (
        "0.9", "16384", "ok")


def test_plan_sweep_rows_equal_single_plans(plan_sweep):
    sweep_dir, _ = plan_sweep
    rows = read_csv(sweep_dir / "sweep.csv")
    assert [r["job"] for r in rows] == [str(i) for i in range(6)]
    assert [(r["npu_memory_utilization"], r["max_model_len"]) for r in rows] == [
        (u, n) for u in ("0.3", "0.9") for n in ("512", "1024", "16384")]
    assert all(r["model"] == "dsv4" and r["device"] == "ascend_a3" and r["mode"] == "plan" for r in rows)
    for r in rows:
        if r["max_model_len"] == "1024":
            continue                                    # the injected crash, checked above
        overrides = ["+model=dsv4", "device=ascend_a3", "mode=plan",
                     f"npu_memory_utilization={r['npu_memory_utilization']}", f"max_model_len={r['max_model_len']}"]
        rc = load_runtime_config(overrides)
        if r["npu_memory_utilization"] == "0.3":
            # 30% of 64 GiB is less than the estimated weights + activations: the point does not fit.
            with pytest.raises(InsufficientMemoryError) as exc:
                make_plan(rc)
            assert r["status"] == "does_not_fit"
            assert r["reason"] == str(exc.value)
            assert r["capacity_slots"] == ""
            continue
        plan = make_plan(rc)
        assert r["status"] == "ok" and r["reason"] == ""
        for key in PLAN_NUMBERS:
            assert int(r[key]) == getattr(plan, key), key
        for group, blocks in plan.num_blocks.items():
            assert int(r[f"num_blocks_{group}"]) == blocks, group
    # The DESIGN.md check figure: one slot at max_model_len 16,384 is 211,968,000 B.
    assert {r["bytes_per_slot"] for r in rows if r["max_model_len"] == "16384" and r["status"] == "ok"} == {
        "211968000"}


def test_plan_sweep_row_equals_a_single_cli_run(plan_sweep, tmp_path):
    sweep_dir, _ = plan_sweep
    row = next(r for r in read_csv(sweep_dir / "sweep.csv")
               if r["npu_memory_utilization"] == "0.9" and r["max_model_len"] == "16384")
    proc = run_cli("+model=dsv4", "device=ascend_a3", "mode=plan", "npu_memory_utilization=0.9",
                   "max_model_len=16384", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())["plan"]
    for key in PLAN_NUMBERS:
        assert int(row[key]) == plan[key], key
    assert {g["name"]: g["num_blocks"] for g in plan["groups"]} == {
        k.removeprefix("num_blocks_"): int(v) for k, v in row.items() if k.startswith("num_blocks_")}
    # A single run is not a sweep: the callback leaves it alone.
    assert not (tmp_path / "sweep.csv").exists() and not (tmp_path / ".sweep_progress").exists()


def test_plan_sweep_markdown_and_plot(plan_sweep):
    sweep_dir, _ = plan_sweep
    md = (sweep_dir / "sweep.md").read_text()
    table = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert len(table) == 1 + 6                       # header + one row per job
    assert "deepseek-v4-flash" in md and "does_not_fit" in md and "peak_non_kv alone exceeds" in md
    assert_png(sweep_dir / "sweep.png")


# ---------------------------------------------------------------- ready-made sweep configs

@pytest.mark.parametrize("overrides, jobs, mode", [
    (["+model=dsv4", "+sweep=capacity"], 27, "plan"),
    (["+sweep=throughput"], 9, "bench"),
])
def test_sweep_group_configs(overrides, jobs, mode):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from appliance.config.overrides import CONF_DIR
    from appliance.sweep import count_jobs

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides, return_hydra_config=True)
    GlobalHydra.instance().clear()
    assert cfg.mode == mode
    assert count_jobs(cfg) == jobs
    assert cfg.hydra.callbacks.sweep._target_ == "appliance.sweep.SweepCollector"


# ---------------------------------------------------------------- parallel jobs through the joblib launcher

def test_joblib_launcher_progress_and_collection(tmp_path):
    proc = run_cli("-m", "device=ascend_a3", "mode=plan", "decode_batch=4,8", "hydra/launcher=joblib",
                   "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    progress = [ln for ln in proc.stdout.splitlines() if ln.startswith("[sweep ")]
    assert [ln.split("]")[0] for ln in progress] == ["[sweep 1/2", "[sweep 2/2"]
    rows = read_csv(tmp_path / "sweep.csv")
    assert [r["decode_batch"] for r in rows] == ["4", "8"]
    for r in rows:
        plan = make_plan(load_runtime_config(["device=ascend_a3", "mode=plan", f"decode_batch={r['decode_batch']}"]))
        assert r["status"] == "ok" and int(r["capacity_slots"]) == plan.capacity_slots
        assert int(r["scratch_bytes"]) == plan.scratch_bytes


# ---------------------------------------------------------------- the collector on hand-made job directories

def _job(sweep: Path, num: int, overrides: list[str], name: str | None, result: dict | None) -> None:
    d = sweep / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if name:
        (d / name).write_text(json.dumps(result))


def test_collect_bench_results_and_a_job_without_result(tmp_path):
    from appliance.sweep import collect_sweep

    def bench(tok_s: float, ttft: float, tpot: float = 0.01) -> dict:
        return {"status": "ok", "mode": "bench",
                "startup": {"model_name": "tiny", "device_kind": "cpu", "device_count": 1,
                            "plan": {"capacity_slots": 7, "kv_tokens_per_device": 3584}},
                "metrics": {"output_tokens_per_s": tok_s, "requests_per_s": 2.0, "ttft_p50_s": ttft,
                            "ttft_p99_s": 2 * ttft, "tpot_p50_s": tpot, "tpot_p99_s": 0.02,
                            "peak_memory_bytes": 123, "note": "not a number"}}
    # One output token per request leaves no inter-token gap: the bench reports TPOT as NaN.
    _job(tmp_path, 0, ["mode=bench", "decode_batch=1"], "bench.json", bench(100.0, 0.05, float("nan")))
    _job(tmp_path, 1, ["mode=bench", "decode_batch=4"], "bench.json", bench(250.0, 0.08))
    _job(tmp_path, 2, ["mode=bench", "decode_batch=8"], None, None)                  # killed: nothing written
    summary = collect_sweep(tmp_path, echo=False)
    rows = read_csv(summary.csv_path)
    assert [(r["decode_batch"], r["status"]) for r in rows] == [("1", "ok"), ("4", "ok"), ("8", "crashed")]
    assert float(rows[1]["output_tokens_per_s"]) == 250.0 and float(rows[1]["ttft_p99_s"]) == 0.16
    assert rows[0]["capacity_slots"] == "7" and "note" not in rows[0] and rows[0]["tpot_p50_s"] == "nan"
    assert "no result file" in rows[2]["reason"]
    assert [r.job for r in summary.crashed] == [2]
    assert "benchmark sweep: tiny on 1 x cpu" in summary.md_path.read_text()
    assert_png(summary.png_path)


# ---------------------------------------------------------------- a real bench sweep

def test_bench_sweep(tmp_path):
    # A pinned pool of 8 slots: sizing the KV cache from 90% of the host's RAM would take most of the time.
    proc = run_cli("-m", "mode=bench", "device=cpu", "decode_batch=1,4", "kv_cache.num_slots_override=8",
                   "bench.num_requests=4",
                   "bench.prompt_len_min=4", "bench.prompt_len_max=8", "bench.output_len_min=2",
                   "bench.output_len_max=4", f"hydra.sweep.dir={tmp_path}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(tmp_path / "sweep.csv")
    assert [(r["decode_batch"], r["status"]) for r in rows] == [("1", "ok"), ("4", "ok")]
    # Each job prints nothing itself (README "Sweeps"): its startup log and figures go to its job directory.
    terminal = (proc.stdout + proc.stderr).splitlines()
    assert not any("[npu." in ln or "[appliance." in ln or ln.startswith("bench ") for ln in terminal), terminal
    assert "capacity_slots" in (tmp_path / "0" / "cli.log").read_text()
    for r in rows:
        assert float(r["output_tokens_per_s"]) > 0 and float(r["ttft_p50_s"]) > 0
        assert int(r["capacity_slots"]) == 8
    assert_png(tmp_path / "sweep.png")
