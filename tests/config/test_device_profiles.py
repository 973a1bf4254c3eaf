"""Device profiles: the offline planning profiles carry the total memory the runtime reports for one device
of their kind (not the marketing figure) and name where that figure comes from; the non-torch margin is in
every profile and in mode=plan exactly as at runtime."""

from pathlib import Path

import pytest
import yaml

from appliance.config.compose import load_runtime_config
from appliance.core.estimate import offline_devices

DEVICE_DIR = Path(__file__).resolve().parents[2] / "conf" / "device"

# torch.npu.mem_get_info()[1] (what vLLM-Ascend logs as "total memory") on one device of each kind.
RUNTIME_TOTAL_BYTES = {
    "ascend_a2": 65_452_113_920,     # Ascend 910B: 60.96 GiB
    "ascend_a3": 65_787_658_240,     # one Ascend 910C (A3) die: 61.27 GiB
}


@pytest.mark.parametrize("profile", sorted(RUNTIME_TOTAL_BYTES))
def test_offline_profile_total_is_what_the_runtime_reports(profile):
    path = DEVICE_DIR / f"{profile}.yaml"
    text = path.read_text()
    assert yaml.safe_load(text)["memory_bytes_per_device"] == RUNTIME_TOTAL_BYTES[profile]
    assert f"{RUNTIME_TOTAL_BYTES[profile]:,}" in text and "Source:" in text and "github.com/" in text
    rc = load_runtime_config(["mode=plan", f"device={profile}"])
    assert {d.total_bytes for d in offline_devices(rc)} == {RUNTIME_TOTAL_BYTES[profile]}


def test_every_offline_profile_is_checked_here():
    offline = {p.stem for p in DEVICE_DIR.glob("*.yaml") if yaml.safe_load(p.read_text()).get("offline")}
    assert offline == set(RUNTIME_TOTAL_BYTES)


@pytest.mark.parametrize("profile", ["auto", "cpu", "cuda", "npu", "ascend_a2", "ascend_a3"])
def test_every_profile_states_its_non_torch_margin(profile):
    data = yaml.safe_load((DEVICE_DIR / f"{profile}.yaml").read_text())
    assert isinstance(data["non_torch_margin_bytes"], int) and data["non_torch_margin_bytes"] >= 0
    mode = ["mode=plan"] if data.get("offline") else []
    assert load_runtime_config([*mode, f"device={profile}"]).device.non_torch_margin_bytes == data["non_torch_margin_bytes"]


def test_plan_keeps_the_same_margin_as_the_runtime():
    rc = load_runtime_config(["mode=plan", "device=ascend_a3", "device.non_torch_margin_bytes=12345"])
    assert {d.non_torch_margin_bytes for d in offline_devices(rc)} == {12345}
