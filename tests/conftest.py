import os
import shutil
import subprocess
import sys
import tempfile
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


# Every engine step that raises is retried one request at a time, which keeps serving and so can hide a broken
# batch behind right tokens. Engines of this process and of the servers and ranks it starts (they inherit the
# variable) append each failed step to one file (appliance.engine.core.FAILED_STEPS_FILE, named here so that
# collecting torch-free tests does not import the engine); a test during which a line was added fails, unless it
# makes steps fail on purpose (@pytest.mark.expects_failed_steps).
FAILED_STEPS_FILE = "APPLIANCE_FAILED_STEPS_FILE"
_failed_steps_read = [0]                 # bytes of the file already attributed to a test


def pytest_configure(config):
    config.addinivalue_line("markers", "expects_failed_steps: the test makes engine steps fail on purpose "
                                       "(no failure if one does; tests/conftest.py)")
    fd, path = tempfile.mkstemp(prefix="appliance-failed-steps-", suffix=".log")
    os.close(fd)
    os.environ[FAILED_STEPS_FILE] = path


def pytest_unconfigure(config):
    path = os.environ.pop(FAILED_STEPS_FILE, None)
    if path:
        Path(path).unlink(missing_ok=True)


def failed_steps_since_last_look() -> list[str]:
    """Lines the engines appended since the last look (from any test, fixture or process)."""
    path = os.environ.get(FAILED_STEPS_FILE)
    if not path or not Path(path).exists():
        return []
    with open(path, "rb") as log:
        log.seek(_failed_steps_read[0])
        new = log.read()
    _failed_steps_read[0] += len(new)
    return new.decode("utf-8", "replace").splitlines()


@pytest.fixture(autouse=True)
def no_engine_step_failed(request):
    """Fail a test (at its teardown) during which an engine step failed, unless it expects that."""
    yield
    failed = failed_steps_since_last_look()
    if failed and request.node.get_closest_marker("expects_failed_steps") is None:
        pytest.fail(f"{len(failed)} engine step(s) failed during this test and were retried one request at a time "
                    f"(which can hide a broken batch behind right tokens), e.g. {failed[:3]}. A test that makes steps "
                    f"fail on purpose is marked @pytest.mark.expects_failed_steps.", pytrace=False)


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
