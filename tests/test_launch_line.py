"""`python -m appliance` says it is starting before anything heavy loads: its first line comes while the
process is still importing (before Hydra and torch), so a launch on a busy host is never silent. Read from the
processes' own output order (PYTHONPROFILEIMPORTTIME logs every import as it happens, in the server's process and in
the engine core's, which loads torch when server.engine_process=true), not from timings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from appliance.__main__ import launch_line
from tests.conftest import REPO


@pytest.mark.parametrize("engine_process", ["true", "false"])
def test_the_first_line_comes_before_hydra_torch_and_listening(tmp_path, engine_process):
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPROFILEIMPORTTIME": "1"}   # the core process's too
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "device=cpu", "server.port=0",
                             "server.http_port=null", f"server.engine_process={engine_process}",
                             f"hydra.run.dir={tmp_path}"], cwd=REPO, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:                       # ends at "listening on" (or when the process ends)
            lines.append(line)
            if line.startswith("listening on"):
                break
    finally:
        proc.kill()
        proc.wait()
    said = [i for i, ln in enumerate(lines) if not ln.startswith("import time:")]
    assert said and lines[said[0]].startswith("starting: serve the embedded default model on cpu"), lines[-20:]

    def first_import(package: str) -> int:
        return next(i for i, ln in enumerate(lines) if ln.startswith("import time:") and
                    ln.rsplit("|", 1)[-1].strip() == package)

    assert said[0] < first_import("hydra") < first_import("torch")
    assert any(ln.startswith("listening on") for ln in lines[said[0]:]), lines[-20:]


def test_the_line_names_the_model_and_devices_and_is_left_out_where_a_mode_answers_at_once():
    assert launch_line(["+model=qwen3_tiny", "device=cpu", "device.count=2"]) == \
        "starting: serve qwen3_tiny on cpu x2 (loading torch and the model)"
    assert launch_line(["mode=bench"]).startswith("starting: bench the embedded default model on the default device")
    assert launch_line(["mode=plan", "+model=dsv4"]) is None
    assert launch_line(["--help"]) is None
    assert launch_line(["-m", "npu_memory_utilization=0.8,0.9"]) is None
