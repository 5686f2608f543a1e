"""The second half of the device-dependent tests under the npu flavour (tests/test_npu_flavour.py)."""

from __future__ import annotations

import pytest

from test_npu_flavour import SECOND_HALF, run_under_npu


@pytest.mark.slow
def test_device_dependent_tests_of_the_second_half_pass_under_the_npu_flavour() -> None:
    run_under_npu(SECOND_HALF)
