"""The mutation registry runs in the suite: every README promise it lists must still be guarded by tests
that fail when its mechanism is switched off. One subprocess runs every entry (in-process pytest runs, one
per mutation, so patches never leak into this session)."""

from __future__ import annotations

import os
from pathlib import Path

import cli_zygote
from mutations import REGISTRY

ROOT = Path(__file__).resolve().parents[2]


def test_registry_names_each_mutation_once_with_its_tests():
    assert len({m.name for m in REGISTRY}) == len(REGISTRY)
    assert all(m.tests and all(t.startswith("tests/") and "::" in t for t in m.tests) for m in REGISTRY)


def run_half(half: int) -> None:
    """Every mutation of one half of the registry makes its tests fail. The suite's workers take a file each
    (--dist loadfile): two halves in two files let them share the registry's minutes."""
    names = [m.name for m in REGISTRY][half::2]
    # forked from a process that imported torch once (tests/cli_zygote.py)
    done = cli_zygote.run(["-m", "tests.mutations", *names], cwd=ROOT, env=dict(os.environ), timeout=300)
    summary = done.stdout[done.stdout.rfind("\nmutations:"):]
    assert done.returncode == 0, summary or done.stdout + done.stderr
    assert summary.count("caught") == len(names), summary


def test_every_mutation_of_the_first_half_makes_its_tests_fail():
    run_half(0)
