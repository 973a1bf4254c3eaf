import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]

# Without a GPU, Triton kernels (npu/paged_attention_triton.py) run in Triton's interpreter on CPU tensors, so their
# tests check them here; the flag is read when a kernel is defined, hence before anything imports npu.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Property tests draw the same examples on every run and every machine (derandomize: examples from a seed
# fixed by each test's source, no example database), so a run that passes is not luck and a failure
# reproduces anywhere. HYPOTHESIS_PROFILE=explore draws fresh random examples (and keeps the database) to hunt.
settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


def run_cli(*args: str, module: str = "appliance", timeout: float = 120, cwd: Path | None = None,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m appliance ...` as a user would, capturing output."""
    full_env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | (env or {})
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env=full_env)


@pytest.fixture
def cli(tmp_path):
    """CLI runner whose Hydra output goes to a temporary directory."""
    def _run(*args: str, **kw) -> subprocess.CompletedProcess:
        return run_cli(*args, f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/multirun", **kw)
    return _run


@pytest.fixture
def one_torch_thread():
    """Tiny matrices: one intra-op thread is far faster than two contending ones on a shared CPU."""
    import torch  # here, so that collecting torch-free tests does not load it

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
