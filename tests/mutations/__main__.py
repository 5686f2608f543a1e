"""python -m tests.mutations [NAME ...]: apply each registered mutation (all, or those named), run its tests,
and exit 1 unless every named test failed under every mutation (and was collected)."""

from __future__ import annotations

import sys
import time

import pytest

from . import REGISTRY, Mutation


class _Apply:
    """A pytest plugin: the mutation's patch for the whole run, and each test's outcome."""

    def __init__(self, mutation: Mutation) -> None:
        self.mutation = mutation
        self.failed: dict[str, bool] = {}
        self._mp = pytest.MonkeyPatch()

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.mutation.patch(self._mp)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._mp.undo()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.failed[report.nodeid] = self.failed.get(report.nodeid, False) or report.failed


def run(mutation: Mutation) -> list[str]:
    """The problems with one mutation: named tests that were not collected or that passed."""
    plugin = _Apply(mutation)
    # No cache (a failing run must not reorder later ones), no random order, quiet; no unraisable-exception plugin:
    # it ends each session with five full garbage collections (0.1-0.25 s each over torch and the simulator), a
    # second of every mutation's run, and only the tests' failures count here.
    args = ["-q", "--no-header", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:unraisableexception",
            "-o", "addopts=", *mutation.tests]
    pytest.main(args, plugins=[plugin])
    problems = []
    for test in mutation.tests:
        ran = [node for node in plugin.failed if node == test or node.startswith(test + "[")]
        if not ran:
            problems.append(f"{test}: not collected")
        problems += [f"{node}: passed with the mechanism switched off" for node in ran if not plugin.failed[node]]
    return problems


def main(names: list[str]) -> int:
    unknown = set(names) - {m.name for m in REGISTRY}
    if unknown:
        print(f"unknown mutations: {sorted(unknown)}", file=sys.stderr)
        return 2
    chosen = [m for m in REGISTRY if not names or m.name in names]
    summary = []
    for mutation in chosen:
        start = time.perf_counter()
        problems = run(mutation)
        summary.append((mutation, problems, time.perf_counter() - start))
    print("\nmutations:")
    for mutation, problems, took in summary:
        print(f"  {'caught  ' if not problems else 'SURVIVED'} {mutation.name} ({took:.1f}s): {mutation.promise}")
        for problem in problems:
            print(f"      {problem}")
    return 1 if any(problems for _, problems, _ in summary) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
