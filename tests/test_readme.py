"""README.md, run as a newcomer runs it: every code block a user pastes works against what `python -m appliance`
serves, every command composes as written, and every sample of output (`$ command` and the lines after it)
equals a real run. A stale sample, a snippet asking for a model the default does not serve, or a renamed key or
flag fails `make test`.

One server for the module: `python -m appliance` (the embedded default) on free ports; the addresses the README
writes (127.0.0.1:8000, localhost:8000, 127.0.0.1:50051) are rewritten to them. What is not run, and why:
installs (pip, make, the kernel build: `make test` is this suite), a server or benchmark start (composed
in-process instead: the one real start is the module's server) and grpcurl where it is not installed. In a
sample, log lines shown as `[...]` are cut short on purpose (timestamps, host-dependent lines): the rest must be
the run's output, line for line, and a sample that shows `error:` must exit with status 2.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.config.compose import load_runtime_config
from appliance.modes.plan import make_plan
from tests.conftest import REPO
from tests.serve.test_server_e2e import ServerProcess, wait_for

README = (REPO / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]\[")          # a log record's prefix: [date time][logger]
INSTALLS = ("pip", "make")
PLACEHOLDERS = ("/path/to/", "/models/", "X.Y.Z")                  # paths and versions the reader fills in


def fenced(lang: str) -> list[tuple[int, str]]:
    """(line number, text) of every fenced block of the language ("" for plain blocks)."""
    return [(README.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(README) if m.group(1) == lang]


def bash_commands() -> list[tuple[int, str]]:
    """Every command of the bash blocks, continuation lines joined, comment lines dropped."""
    out = []
    for line_no, text in fenced("bash"):
        for i, line in enumerate(text.replace("\\\n", " ").splitlines()):
            if line.strip() and not line.lstrip().startswith("#"):
                out.append((line_no + i + 1, line.strip()))
    return out


def samples() -> list[tuple[int, list[tuple[str, list[str]]]]]:
    """Plain blocks that show a session: [(command, the output lines shown after it)]."""
    out = []
    for line_no, text in fenced(""):
        if text.startswith("$ "):
            steps: list[tuple[str, list[str]]] = []
            for line in text.splitlines():
                if line.startswith("$ "):
                    steps.append((line[2:], []))
                else:
                    steps[-1][1].append(line)
            out.append((line_no, steps))
    return out


# -- the module's server and the environment the README's commands run in --------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`python -m appliance` on free ports, SERVING: {the README's address: this server's}. Its pool is pinned to
    16 slots (sizing it from the host's memory takes seconds; no block's answer depends on it)."""
    srv = ServerProcess("server.port=0", "server.http_port=0", "kv_cache.num_slots_override=16",
                        run_dir=tmp_path_factory.mktemp("run"))
    try:
        grpc_address = srv.wait_address()
        wait_for(lambda: "SERVING on" in srv.output or srv.proc.poll() is not None, 300, "SERVING")
        assert srv.proc.poll() is None, srv.output
        http_port = re.search(r"^http listening on 127\.0\.0\.1:(\d+) ", srv.output, re.M).group(1)
        yield {"127.0.0.1:8000": f"127.0.0.1:{http_port}", "localhost:8000": f"127.0.0.1:{http_port}",
               "127.0.0.1:50051": grpc_address}
    finally:
        srv.proc.terminate()
        srv.proc.wait(60)


def readdressed(text: str, addresses: dict[str, str]) -> str:
    for written, real in addresses.items():
        text = text.replace(written, real)
    return text


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Where a user runs the README from: a fresh directory where `python` is this interpreter, the repository is
    importable and `bench/` is at hand, and no GPU is visible (the samples show a host without one)."""
    path = tmp_path_factory.mktemp("newcomer")
    (path / "bench").symlink_to(REPO / "bench")
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(REPO),
               CUDA_VISIBLE_DEVICES="")
    return path, env


def shell(command: str, workdir, timeout: float = 300) -> subprocess.CompletedProcess:
    path, env = workdir
    return subprocess.run(["bash", "-c", command], cwd=path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)     # in order, as a terminal shows it


RECIPE = "python bench/make_tiny_checkpoint.py qwen3_tiny ckpt/qwen3-tiny"


@pytest.fixture(scope="module")
def recipe_run(workdir) -> subprocess.CompletedProcess:
    """The README's recipe for ckpt/qwen3-tiny, run once in the work directory (a sample shows its output)."""
    assert any(c.startswith(RECIPE) for _, c in bash_commands()), "the README no longer gives the recipe"
    return shell(RECIPE, workdir)


@pytest.fixture(scope="module")
def tiny_checkpoint(workdir, recipe_run):
    assert recipe_run.returncode == 0, recipe_run.stdout
    return workdir[0] / "ckpt" / "qwen3-tiny"


# -- the blocks ------------------------------------------------------------------------------------------------

def test_the_readme_has_what_these_tests_run():
    """The parsing above finds the blocks (a fence written another way would silently run nothing)."""
    assert len(fenced("python")) >= 4 and len(bash_commands()) >= 30 and len(samples()) >= 5


@pytest.mark.parametrize("line_no, code", fenced("python"), ids=lambda v: f"line {v}" if isinstance(v, int) else "")
def test_python_blocks_run_against_the_default_server(server, line_no, code):
    proc = subprocess.run([sys.executable, "-c", readdressed(code, server)], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, f"README.md line {line_no}:\n{proc.stderr[-3000:]}"


def command_kind(command: str) -> str:
    """What the bash tests do with a README command: run, compose, skip (with the reason) or unknown."""
    words = shlex.split(command, comments=True)
    if words[0] in INSTALLS or words[:3] == ["python", "-m", "npu.cpu_kernels"]:
        return "install"
    if words[0] == "grpcurl":
        return "run" if shutil.which("grpcurl") else "grpcurl not installed"
    if words[:2] == ["python", "bench/make_tiny_checkpoint.py"]:
        return "checkpoint"
    if words[0] == "curl" or words[:3] == ["python", "-m", "appliance.client"]:
        return "run"
    if (words[:3] == ["python", "-m", "appliance"] or words[0] == "torchrun") \
            and not any(p in command for p in PLACEHOLDERS):
        return "compose"
    if any(p in command for p in PLACEHOLDERS):
        return "a placeholder for the reader"
    return "unknown"


def test_every_readme_command_is_one_these_tests_know():
    unknown = [(n, c) for n, c in bash_commands() if command_kind(c) == "unknown"]
    assert not unknown, f"README commands of a kind tests/test_readme.py does not run or compose: {unknown}"


@pytest.mark.parametrize("line_no, command", [(n, c) for n, c in bash_commands() if command_kind(c) != "compose"],
                         ids=lambda v: f"line {v}" if isinstance(v, int) else "")
def test_bash_commands_run_against_the_default_server(request, workdir, line_no, command):
    kind = command_kind(command)
    if kind == "checkpoint":                     # the recipe the fixture follows (once for the module)
        assert (request.getfixturevalue("tiny_checkpoint") / "config.json").is_file()
        return
    if kind != "run":
        pytest.skip(kind)
    server = request.getfixturevalue("server")
    if command.startswith("python -m appliance.client"):       # its address is a flag, not in the text
        command = shlex.join([*shlex.split(command, comments=True), "--address", server["127.0.0.1:50051"]])
    proc = shell(readdressed(command, server), workdir)
    assert proc.returncode == 0 and proc.stdout.strip(), f"README.md line {line_no}: {command}\n{proc.stdout}"


def overrides_of(command: str) -> list[str]:
    """The Hydra overrides of `python -m appliance ...` or `torchrun ... -m appliance ...`; a sweep's first point."""
    words = shlex.split(command, comments=True)
    words = words[words.index("appliance") + 1:]
    return [re.sub(r"=([^,\[\]]+),.*", r"=\1", w) for w in words if w not in ("-m", "--multirun")]


def test_appliance_commands_compose_as_written(tiny_checkpoint, monkeypatch):
    """Every `python -m appliance ...` line is a valid configuration (a plan line also fits), checked in-process:
    starting each server or benchmark would take minutes and devices this host lacks."""
    monkeypatch.chdir(tiny_checkpoint.parents[1])             # ckpt/qwen3-tiny, as the README's recipe made it
    for line_no, command in bash_commands():
        if command_kind(command) == "compose":
            rc = load_runtime_config(overrides_of(command))
            if rc.mode == "plan":
                make_plan(rc)
            assert rc.model.name, f"README.md line {line_no}"


@pytest.mark.parametrize("line_no, steps", samples(), ids=lambda v: f"line {v}" if isinstance(v, int) else "")
def test_output_samples_equal_a_real_run(request, workdir, line_no, steps):
    addresses = request.getfixturevalue("server") if any("localhost:8000" in c for c, _ in steps) else {}
    status = None
    for command, shown in steps:
        if command == "echo $?":
            assert [str(status)] == shown, f"README.md line {line_no}: exit status"
            continue
        proc = request.getfixturevalue("recipe_run") if command == RECIPE else \
            shell(readdressed(command, addresses), workdir)
        status = proc.returncode
        if not shown:                   # a command shown without its output: it must succeed
            assert status == 0, f"README.md line {line_no}: {command}\n{proc.stdout}"
            continue
        got = [ln for ln in proc.stdout.splitlines() if not LOG_LINE.match(ln)]
        assert got == [ln for ln in shown if not ln.startswith("[...]")], f"README.md line {line_no}: {command}"
        assert status == (2 if any(ln.startswith("error:") for ln in shown) else 0), f"README.md line {line_no}"
