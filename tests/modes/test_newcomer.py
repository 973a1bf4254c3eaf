"""What a newcomer sees: --help, mode=validate naming the model, plan output per device vs the deployment,
byte counts in readable units, a plan sweep of one line per job plus its table."""

from __future__ import annotations

import re

import pytest

from appliance.config.compose import load_runtime_config
from appliance.config.overrides import available_models
from appliance.core.tables import capacity_plan_table
from appliance.core.units import human_bytes
from appliance.modes.plan import make_plan


def test_help_explains_modes_models_plan_vs_serve_and_the_client(cli):
    proc = cli("--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "is powered by Hydra" not in out
    for words in (["serve", "plan", "validate", "bench"], ["+model=dsv4", "not model=dsv4", "RANDOM weights"],
                  ["plan vs serve", "same planner"], ["python -m appliance.client", "--startup"],
                  [f"model: {', '.join(available_models())}"], ["APPLIANCE_AUTH_TOKEN"]):
        assert all(w in out for w in words), words


@pytest.mark.parametrize("overrides", [[], ["+model=qwen3_tiny"]])
def test_validate_names_the_selected_model_and_its_weights(cli, overrides):
    proc = cli("mode=validate", *overrides)
    assert proc.returncode == 0, proc.stderr
    rc = load_runtime_config(overrides)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("selected model: "))
    assert rc.model.name in line and rc.model.arch in line and "random (seed 0)" in line
    assert "meaningless" in proc.stdout and "model.weights=DIR" in proc.stdout


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (4_753_632, "4.53 MiB"),
                                     (3 << 30, "3.00 GiB"), (5 << 40, "5.00 TiB"), (-2048, "-2.00 KiB")])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


def test_plan_table_small_numbers_and_per_device_vs_deployment():
    rc = load_runtime_config(["+model=dsv4", "mode=plan", "device=ascend_a3", "max_model_len=8192"])
    plan = make_plan(rc)
    text = capacity_plan_table(plan)
    assert "0.00 GiB" not in text
    assert human_bytes(plan.devices[0].headroom_bytes) in text
    per_device = next(ln for ln in text.splitlines() if ln.startswith("per device:"))
    deployment = next(ln for ln in text.splitlines() if ln.startswith("deployment:"))
    assert f"capacity_slots {plan.capacity_slots:,}" in per_device and "one device" in per_device
    assert f"max concurrency {plan.max_concurrency:,}" in deployment
    assert f"{plan.capacity_slots:,} slots x 16 data-parallel rank(s)" in deployment
    assert plan.max_concurrency == plan.capacity_slots * rc.parallel.data_parallel_size == plan.capacity_slots * 16
    assert f"KV cache {plan.kv_cache_bytes:,} B" in text and f"unused {plan.unused_bytes:,} B" in text


def test_capacity_plan_sweep_prints_one_line_per_job_and_the_table(cli, tmp_path):
    proc = cli("-m", "+model=dsv4", "device=ascend_a3", "mode=plan", "+sweep=capacity")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    progress = [ln for ln in lines if ln.startswith("[sweep ") and "/27]" in ln]
    rows = [ln for ln in lines if re.match(r"^\d+\s+0\.[789]\s", ln)]
    assert len(progress) == 27 and len(rows) == 27
    others = [ln for ln in lines if ln not in progress and ln not in rows]
    assert len(others) <= 15, "\n".join(others)          # the table's title, header and file paths
    assert not any("HYDRA" in ln or "Launching" in ln for ln in lines)
