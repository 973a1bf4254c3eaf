"""`make wheelhouse`: every wheel this project installs besides torch, for a host with no network (a GPU or NPU server).

Run on a connected host; name the offline host's Python and platform (they may differ from this one):

    python bench/wheelhouse.py --dest wheelhouse --python-version 3.12 --platform manylinux_2_35_x86_64

then copy the folder and the checkout there and install with pip alone, keeping the torch it has (torch >= 2.5):

    pip install --no-index --find-links wheelhouse -e '.[dev]'

What it does: reads the dependencies (and --extras) from pyproject.toml, leaves out torch (the offline host has its
own build: CUDA, or torch-npu's), builds the one dependency PyPI ships as source only (antlr4-python3-runtime 4.9.3,
Hydra's parser runtime) into a wheel, then lets pip resolve and download the rest for the target with
`pip download --only-binary=:all:`, so the wheelhouse holds the whole closure.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE_ONLY = ["antlr4-python3-runtime==4.9.3"]       # no wheel on PyPI: built here (pure Python)
BUILD = ["setuptools>=68"]                             # pyproject's build backend, for `pip install -e .` offline


def requirements(extras: list[str]) -> list[str]:
    """pyproject's dependencies and the named extras, torch left out."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return [r for r in reqs if re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].strip().lower() != "torch"]


def platform_tags(platform: str) -> list[str]:
    """pip matches platform tags exactly: manylinux_2_N_<arch> and every older glibc it runs on."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    newest, arch = int(m.group(1)), m.group(2)
    return [f"manylinux_2_{n}_{arch}" for n in range(newest, 16, -1)] + [f"manylinux2014_{arch}", f"linux_{arch}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", default="wheelhouse")
    parser.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    parser.add_argument("--platform", default="manylinux_2_35_x86_64", help="the offline host's newest tag (glibc 2.35: Ubuntu 22.04)")
    parser.add_argument("--extras", default="dev", help="comma-separated extras of pyproject.toml (default: dev)")
    args = parser.parse_args()
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(dest), *SOURCE_ONLY], check=True)
    target = ["--python-version", args.python_version, "--implementation", "cp", "--only-binary=:all:"]
    for tag in platform_tags(args.platform):
        target += ["--platform", tag]
    reqs = requirements([e for e in args.extras.split(",") if e]) + BUILD
    subprocess.run([*pip, "download", "-d", str(dest), "--find-links", str(dest), *target, *reqs], check=True)
    wheels = sorted(dest.glob("*.whl"))
    print(f"{len(wheels)} wheels in {dest} ({sum(w.stat().st_size for w in wheels) / 2**20:.0f} MiB) for Python "
          f"{args.python_version} on {args.platform}; install offline with:\n"
          f"  pip install --no-index --find-links {dest} -e '.[dev]'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
