"""pytest plugin for the mutation run only (`make mutation`; [tool.mutmut] in pyproject.toml loads it).

mutmut runs, against each mutant, every test that reached the mutated function in its first (stats) run.
For the planner that includes every engine test, which reaches it only through startup: a surviving planner
mutant would cost a full engine run on a shared two-core machine, and mutmut's timeout (a multiple of all
those tests' time) would let a mutant that loops run for minutes. So, while MUTATION_TESTS is set:

- MUTATION_TESTS (space-separated node-id prefixes: files or folders) narrows the tests of each mutant, and
  of the clean run before them, to the ones written for the module under test;
- MUTATION_TIMEOUT_S ends a mutant's test session after that many seconds with mutmut's timeout status.

The stats run and mutmut's test listing (MUTANT_UNDER_TEST "stats" / "list_all_tests") keep every test,
so the recorded test-to-function map stays whole for the other modules.
"""

from __future__ import annotations

import os
import signal

import pytest

MUTMUT_TIMEOUT_EXIT = 36         # the exit status mutmut records as "timeout"


def narrowed() -> bool:
    """True while a mutant (or the clean run, MUTANT_UNDER_TEST empty) is tested with MUTATION_TESTS set."""
    mutant = os.environ.get("MUTANT_UNDER_TEST")
    return bool(os.environ.get("MUTATION_TESTS")) and mutant is not None and (mutant == "" or "__mutmut_" in mutant)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not narrowed():
        return
    prefixes = tuple(os.environ["MUTATION_TESTS"].split())
    dropped = [item for item in items if not item.nodeid.startswith(prefixes)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item.nodeid.startswith(prefixes)]


def pytest_sessionstart(session: pytest.Session) -> None:
    seconds = int(os.environ.get("MUTATION_TIMEOUT_S", "0"))
    if seconds > 0 and narrowed() and os.environ.get("MUTANT_UNDER_TEST"):
        signal.signal(signal.SIGALRM, lambda signum, frame: os._exit(MUTMUT_TIMEOUT_EXIT))
        signal.alarm(seconds)
