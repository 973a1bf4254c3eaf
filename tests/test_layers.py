"""The layers of docs/ARCHITECTURE.md hold: imports go downward only, no cycles, and the light layers stay light.

The import graph is read from the source (ast), function-local imports included, so a lazy import cannot hide
an upward dependency or a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("appliance", "npu")

# Layer of each module, by longest matching prefix; a layer may import its own layer and the ones it lists.
LAYERS = {
    "appliance.core": "core",
    "npu": "npu",
    "appliance.engine": "engine",
    "appliance.config": "frontend",
    "appliance.serve": "frontend",
    "appliance.modes": "frontend",
    "appliance.sweep": "frontend",
    "appliance.cli": "frontend",
    "appliance.client": "frontend",
    "appliance.offline": "frontend",
    "appliance.__main__": "frontend",
    "appliance": "frontend",          # the package __init__
}
MAY_IMPORT = {
    "core": {"core"},
    "npu": {"core", "npu"},
    "engine": {"core", "npu", "engine"},
    "frontend": {"core", "npu", "engine", "frontend"},
}
# Third-party packages a layer must not import (the device plane and the core know nothing about Hydra).
FORBIDDEN_THIRD_PARTY = {
    "core": ("torch", "hydra", "omegaconf", "grpc", "fastapi", "uvicorn"),
    "npu": ("hydra", "omegaconf", "grpc", "fastapi", "uvicorn"),
    "engine": ("hydra", "omegaconf", "grpc", "fastapi", "uvicorn"),
}


def module_files() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (REPO / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(REPO).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = f
    return mods


def layer_of(module: str) -> str:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def imports_of(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names imported from it, line) for every import statement, nested ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.append((base, [a.name for a in node.names], node.lineno))
    return out


def internal_graph() -> dict[str, set[str]]:
    mods = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for target, names, _ in imports_of(name, path):
            for candidate in [target] + [f"{target}.{n}" for n in names]:
                while candidate and candidate not in mods:
                    candidate = candidate.rpartition(".")[0]
                if candidate and candidate != name and not name.startswith(candidate + "."):
                    deps.add(candidate)
        graph[name] = deps
    return graph


def test_layers_import_downward_only():
    bad = []
    for name, deps in internal_graph().items():
        allowed = MAY_IMPORT[layer_of(name)]
        bad += [f"{name} ({layer_of(name)}) imports {d} ({layer_of(d)})" for d in sorted(deps)
                if layer_of(d) not in allowed]
    assert not bad, "\n".join(bad)


def test_no_third_party_imports_a_layer_must_not_know():
    bad = []
    for name, path in module_files().items():
        forbidden = FORBIDDEN_THIRD_PARTY.get(layer_of(name), ())
        for target, _, line in imports_of(name, path):
            if target.split(".")[0] in forbidden:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def test_no_private_names_across_modules():
    mods = module_files()
    bad = []
    for name, path in mods.items():
        for target, names, line in imports_of(name, path):
            if target.split(".")[0] in PACKAGES:
                bad += [f"{path.relative_to(REPO)}:{line} imports {target}.{n}" for n in names
                        if n.startswith("_") and n != "__version__"]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = internal_graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_check_sees_function_local_imports(tmp_path):
    """The graph counts an import inside a function (the way a lazy import could hide a cycle)."""
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from appliance.cli import main\n    return main\n")
    assert ("appliance.cli", ["main"], 2) in imports_of("appliance.core.m", f)


def loaded_after_import(*modules: str) -> set[str]:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            "print(' '.join(sorted(m for m in ('torch', 'hydra', 'omegaconf', 'grpc') if m in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split())


def test_device_plane_and_runtime_types_load_no_hydra():
    npu = sorted(m for m in module_files() if m.startswith("npu"))
    assert not {"hydra", "omegaconf"} & loaded_after_import(*npu, "appliance.core.config")


def test_core_loads_neither_torch_nor_hydra():
    core = sorted(m for m in module_files() if m.startswith("appliance.core"))
    assert not loaded_after_import(*core)


def test_plan_mode_loads_no_torch():
    assert "torch" not in loaded_after_import("appliance.modes.plan", "appliance.config.compose")


def test_the_check_sees_which_runner_serves_each_architecture():
    """npu/registry.py imports every runner module (no importlib string the graph could not follow), and its table
    names a runner for every architecture the core registry declares."""
    from appliance.core.archs import ARCHITECTURES
    from npu.registry import RUNNERS

    assert set(RUNNERS) == set(ARCHITECTURES)
    reached = internal_graph()["npu.registry"]
    assert {cls.__module__ for cls in RUNNERS.values()} <= reached


# What runs the product: `python -m` entry points (make install's kernel build and make proto included), the Python
# API, and the Hydra callbacks conf/ names (their `_target_` modules are added by the test).
ENTRY_POINTS = ("appliance.__main__", "appliance.cli", "appliance.sweep.__main__", "appliance.client",
                "appliance.offline", "npu.worker", "npu.cpu_kernels", "appliance.serve.api.generate")


def test_every_module_of_the_package_serves_the_product():
    """The installed package holds no test-only module (scripted devices, checkpoint writers live in tests/):
    every module is imported, directly or not, by an entry point of the product."""
    graph = internal_graph()
    targets = {line.split("_target_:")[1].strip() for f in (REPO / "conf").rglob("*.yaml")
               for line in f.read_text().splitlines() if "_target_:" in line}
    roots = [m for m in ENTRY_POINTS if m in graph]
    roots += [m for t in targets for m in [t.rpartition(".")[0]] if m in graph]
    reached: set[str] = set()
    stack = list(roots)
    while stack:
        module = stack.pop()
        if module not in reached:
            reached.add(module)
            stack += graph[module] | {p for p in graph if module.startswith(p + ".")}   # its packages run too
    assert sorted(set(graph) - reached) == []
