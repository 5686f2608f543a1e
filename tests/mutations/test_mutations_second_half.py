"""The other half of the mutation registry (tests/mutations/test_mutations.py says why it is split)."""

from __future__ import annotations

from mutations.test_mutations import run_half


def test_every_mutation_of_the_second_half_makes_its_tests_fail():
    run_half(1)
