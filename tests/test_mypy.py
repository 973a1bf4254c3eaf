"""Type check: mypy reports no error in the layers held to it (the ratchet: a layer joins once it is clean)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

# Checked with zero errors ([tool.mypy] in pyproject.toml has the settings): every package, appliance/ and npu/, and
# the classes each Protocol names (tests/support/protocols.py).
TYPE_CHECKED = ("appliance", "npu", "tests/support/protocols.py")


def test_mypy_reports_no_error_in_the_checked_layers():
    proc = subprocess.run([sys.executable, "-m", "mypy", *TYPE_CHECKED], capture_output=True, text=True, cwd=REPO,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
