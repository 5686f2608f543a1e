"""One command that proves swapopt on a device and feeds the simulator its true figures.

``python -m swapopt.verify`` (or ``swapopt-verify``) on a CUDA or NPU machine: the environment, the device test
suite, a calibration of copies, kernels and launches written as a simulator preset file, the benchmark's quick
table, real layouts and end-to-end configs, the peers, and a report with every figure measured and modeled
side by side. Without a device (or with ``--dry-run``) the same path runs on the simulator at small sizes.
Parts, one concept each: plan (what is run), environment, device_tests, calibrate (probes), calibrated_preset
(probes to preset), bench_runs (the benchmark's parts), modeled (the simulator's side), comparison, report,
charts, run (the phases in order).
"""

from __future__ import annotations

from typing import Any

__all__ = ["VerifyOptions", "verify"]


def __getattr__(name: str) -> Any:
    # Imported on first use: `python -m swapopt.verify.modeled` must not find that module already imported
    # through this package (run.py imports it), which runpy warns about.
    if name in __all__:
        from swapopt.verify import run

        return getattr(run, name)
    raise AttributeError(f"module 'swapopt.verify' has no attribute {name!r}")
