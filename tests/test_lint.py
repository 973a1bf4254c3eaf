"""Static checks that catch what a test run may not reach: undefined names, unused imports, import order."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_ruff_pyflakes_and_isort_are_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F,I", "appliance", "npu", "tests",
                           "bench"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
