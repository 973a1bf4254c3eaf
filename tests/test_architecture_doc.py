"""docs/ARCHITECTURE.md tells the truth about the modules: its module map has one line for every module of appliance/
and npu/, each under its own layer, and every file, module and `file` `function` the page names exists.

Why a test: the map is how a newcomer finds a module, and a refactor (issue #34 moved loop.py, http.py,
openai_api.py, npu/qwen3.py ...) leaves a page like this stale without anyone noticing. A module added without a line,
a line left for a module that is gone, or a request walk citing a function that was renamed fails `make test`.

The map's lines read "- `path` (layer) — what it holds", under "### N ..." headings of the section "## The modules,
layer by layer". Exempt: the generated stubs under appliance/serve/api/ (one line names the folder) and an
`__init__.py` that holds only its docstring (a package marker).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO

DOC = REPO / "docs" / "ARCHITECTURE.md"
PACKAGES = ("appliance", "npu")
MAP_HEADING = "## The modules, layer by layer"
FOLDER_LINES = ("appliance/serve/api/",)        # generated stubs: one line for the folder
LAYER_OF = (("appliance/core/", 1), ("npu/", 2), ("appliance/engine/", 3), ("appliance/", 4))

ENTRY = re.compile(r"^- `([^`]+)` \((\d)\) — \S")
LAYER_HEADING = re.compile(r"^### (\d) ")
PATH = re.compile(r"(?<![\w/.-])((?:appliance|npu|tests|bench|docs|conf|protos)/[\w./*-]*\w/?)")
DOTTED = re.compile(r"(?<![\w./])((?:appliance|npu)(?:\.\w+)+)")
PY_NAME = re.compile(r"(?<![\w/.-])([\w/]*\w\.py)\b")
CITATION = re.compile(r"`((?:appliance|npu)/[\w/]+\.py)` `(\w+(?:\.\w+)?)`")
CLASS_MEMBER = re.compile(r"`([A-Z]\w*)\.(\w+)`")


def layer_of(path: str) -> int:
    return next(layer for prefix, layer in LAYER_OF if path.startswith(prefix))


def only_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in body)


def modules(root: Path = REPO) -> set[str]:
    """Every module that needs a line of its own (repository-relative paths)."""
    out = set()
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            if "__pycache__" in rel or any(rel.startswith(f) for f in FOLDER_LINES):
                continue
            if path.name == "__init__.py" and only_docstring(path):
                continue
            out.add(rel)
    return out


def map_entries(doc: str) -> list[tuple[str, int, int | None]]:
    """(path, the line's layer, the layer of the heading it sits under) of every line of the module map."""
    section = doc.split(MAP_HEADING, 1)[1].split("\n## ", 1)[0]
    entries, heading = [], None
    for line in section.splitlines():
        m = LAYER_HEADING.match(line)
        if m:
            heading = int(m.group(1))
        m = ENTRY.match(line)
        if m:
            entries.append((m.group(1), int(m.group(2)), heading))
    return entries


def map_problems(doc: str, wanted: set[str]) -> list[str]:
    """What is wrong with the module map: modules without a line, lines twice, lines naming no module of the
    repository, lines under another layer than their module's."""
    entries = map_entries(doc)
    listed = [path for path, _, _ in entries]
    problems = [f"{path}: no line in the module map" for path in sorted(wanted - set(listed) - set(FOLDER_LINES))]
    problems += [f"{path}: listed {listed.count(path)} times" for path in sorted(set(listed)) if listed.count(path) > 1]
    for path, layer, heading in entries:
        if path not in wanted and path not in FOLDER_LINES:
            problems.append(f"{path}: a line for no module (gone, renamed, or a package marker)")
            continue
        if not layer == heading == layer_of(path):
            problems.append(f"{path}: written as layer ({layer}) under heading {heading}, but it is layer {layer_of(path)}")
    return problems


def defined_names(tree: ast.Module) -> dict[str, set[str]]:
    """Top-level names a module defines (not imports), each with the names its class body defines."""
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    members.update(t.id for t in item.targets if isinstance(t, ast.Name))
            out[node.name] = members
        elif isinstance(node, ast.Assign):
            out.update({t.id: set() for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = set()
    return out


def class_members(root: Path = REPO) -> dict[str, set[str]]:
    """Class name -> the names its body defines, with its bases' (by name, within appliance/ and npu/), over every
    class of the packages (two classes of one name: the union)."""
    bodies: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    members = defined_names(ast.Module(body=[node], type_ignores=[]))[node.name]
                    bodies.setdefault(node.name, set()).update(members)
                    bases.setdefault(node.name, set()).update(b.id for b in node.bases if isinstance(b, ast.Name))

    def closure(name: str, seen: set[str]) -> set[str]:
        out = set(bodies.get(name, ()))
        for base in bases.get(name, set()) - seen:
            out |= closure(base, seen | {base})
        return out
    return {name: closure(name, {name}) for name in bodies}


def reference_problems(doc: str, root: Path = REPO) -> list[str]:
    """Names on the page that do not exist: paths, dotted modules, bare `x.py` names (a basename no file under the
    repository's packages has), `file` `function` citations whose function (or Class.member, defined in that
    class's own body) the file lacks, and `Class.member` names whose class (one of the packages', with its bases)
    has no such member."""
    problems = []
    for path in sorted(set(PATH.findall(doc))):
        if "*" not in path and not (root / path).exists():
            problems.append(f"{path}: no such file or folder")
    for dotted in sorted(set(DOTTED.findall(doc))):
        parts = dotted.split(".")
        found = next(((k, f) for k in range(len(parts), 0, -1)
                      for f in (root.joinpath(*parts[:k]).with_suffix(".py"), root.joinpath(*parts[:k]) / "__init__.py")
                      if f.exists()), None)
        rest = parts[found[0]:] if found is not None else parts
        if found is not None and rest:                  # a module's name (defined or imported), or Class.member
            tree = ast.parse(found[1].read_text())
            names = defined_names(tree)
            imported = {(a.asname or a.name).split(".")[0] for node in tree.body
                        if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
            ok = len(rest) == 1 and (rest[0] in names or rest[0] in imported) or (
                len(rest) == 2 and rest[1] in names.get(rest[0], set()))
        else:
            ok = found is not None
        if not ok:
            problems.append(f"{dotted}: no such module")
    basenames = {p.name for folder in (*PACKAGES, "tests", "bench") for p in (root / folder).rglob("*.py")}
    for name in sorted(set(PY_NAME.findall(doc))):
        if not (root / name).exists() and not (root / "appliance" / name).exists() and Path(name).name not in basenames:
            problems.append(f"{name}: no module of that name")
    trees: dict[str, dict[str, set[str]]] = {}
    for path, name in sorted(set(CITATION.findall(doc))):
        if not (root / path).exists():
            continue                                    # reported above
        names = trees.setdefault(path, defined_names(ast.parse((root / path).read_text())))
        owner, _, member = name.partition(".")
        if owner not in names:
            problems.append(f"{path} {name}: {path} defines no {owner}")
        elif member and member not in names[owner]:
            problems.append(f"{path} {name}: {owner} has no {member}")
    classes = class_members(root)
    for owner, member in sorted(set(CLASS_MEMBER.findall(doc))):
        if owner in classes and member not in classes[owner]:
            problems.append(f"{owner}.{member}: {owner} has no {member}")
    return problems


def test_every_module_has_one_line_under_its_layer():
    problems = map_problems(DOC.read_text(), modules())
    assert not problems, "docs/ARCHITECTURE.md's module map:\n" + "\n".join(problems)


def test_every_name_on_the_page_exists():
    problems = reference_problems(DOC.read_text())
    assert not problems, "docs/ARCHITECTURE.md names what does not exist:\n" + "\n".join(problems)


def test_the_checks_catch_what_they_are_for():
    """The checks fail on the faults they exist for (so a parsing slip cannot make them pass on anything)."""
    doc, wanted = DOC.read_text(), modules()
    assert len(map_entries(doc)) >= len(wanted) > 100
    # a module added without a line
    assert map_problems(doc, wanted | {"appliance/engine/new_module.py"}) == [
        "appliance/engine/new_module.py: no line in the module map"]
    # a line for a module that is gone
    assert map_problems(doc, wanted - {"appliance/engine/output.py"}) == [
        "appliance/engine/output.py: a line for no module (gone, renamed, or a package marker)"]
    # a line under another layer's heading
    moved = doc.replace("- `appliance/engine/preflight.py` (3)", "- `appliance/engine/preflight.py` (2)")
    assert map_problems(moved, wanted) == [
        "appliance/engine/preflight.py: written as layer (2) under heading 3, but it is layer 3"]
    # stale names in the prose: a path, a bare module name, a dotted module, a renamed function
    stale = doc + ("\nSee `npu/qwen3.py`, `loop.py`, appliance.serve.openai_api, "
                   "`appliance/engine/core.py` `EngineCore._execute_all` and `Engine._append`.\n")
    assert reference_problems(stale) == [
        "npu/qwen3.py: no such file or folder", "appliance.serve.openai_api: no such module",
        "loop.py: no module of that name", "npu/qwen3.py: no module of that name",
        "appliance/engine/core.py EngineCore._execute_all: EngineCore has no _execute_all",
        "Engine._append: Engine has no _append", "EngineCore._execute_all: EngineCore has no _execute_all"]
