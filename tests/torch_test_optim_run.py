"""Run torch's own test/test_optim.py on the CPU, on the simulated device, or on it with every optimizer wrapped.

torch's wheel ships its optimizer test database (torch/testing/_internal/common_optimizers.py) but not the test
file that uses it; pass its path (a PyTorch checkout's test/test_optim.py) with --file or SWAPOPT_TORCH_TEST_OPTIM.
The file is loaded unmodified; what it imports from its sibling modules (test/optim/: the LR scheduler, SWA and
differentiable-optimizer suites, which test no device-type behaviour) is given empty stand-ins.

Modes, one per process (a process registers one simulated device type):
- cpu: the file's CPU instantiation, plain torch: the baseline.
- sim: the simulated device's instantiation (torch's instantiate_device_type_tests with the simulator's
  PrivateUse1 device type), with the simulator active (sanitizer on). It is instantiated as torch instantiates
  the tests for cuda: the simulated device stands for CUDA, so optim_db's fused support lists name it wherever
  they name cuda (Adam, AdamW, SGD, Adagrad) and the fused variants run, as on a CUDA machine.
- wrapped: as sim, with every optimizer the tests construct wrapped in swapopt.SwapOptimizer (optim_db's
  classes, and the module-level SGD, torch.optim.AdamW, Adam and LBFGS the file uses by name).

Each test runs alone (unittest), its outcome recorded as pass / fail / error / skip with the first line of the
reason; `python tests/torch_test_optim_run.py MODE --json out.json [--optims Adam,SGD]` writes them keyed by
the test's name without its device suffix, so the modes compare name by name (tests/test_torch_test_optim.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import types
import unittest
from pathlib import Path
from typing import Any

# torch's TestCase appends a repro hint after a failure's traceback; the outcome keeps the exception's own line.
os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")
ROOT = Path(__file__).resolve().parents[1]
MODES = ("cpu", "sim", "wrapped")
ENV = "SWAPOPT_TORCH_TEST_OPTIM"


def test_file(path: str | None = None) -> Path | None:
    """torch's test_optim.py: --file, else SWAPOPT_TORCH_TEST_OPTIM; None when neither names a file."""
    value = path or os.environ.get(ENV, "").strip()
    if value and Path(value).is_file():
        return Path(value)
    return None


def _stub_siblings() -> None:
    """Empty stand-ins for the suites test_optim.py imports from test/optim/ (not shipped with torch either)."""
    from torch.testing._internal.common_utils import TestCase

    package = types.ModuleType("optim")
    package.__path__ = []
    sys.modules.setdefault("optim", package)
    for name, classes in {
        "test_lrscheduler": ("TestLRScheduler",),
        "test_optim": ("TestDifferentiableOptimizer",),
        "test_swa_utils": ("TestSWAUtils",),
    }.items():
        module = types.ModuleType(f"optim.{name}")
        for cls in classes:
            setattr(module, cls, type(cls, (TestCase,), {}))
        sys.modules[f"optim.{name}"] = module


def _as_cuda_stand_in(backend: str) -> None:
    """optim_db names the devices with fused kernels; the simulated device stands for CUDA, so it gets the fused
    variants wherever cuda does (the optimizer itself accepts it: torch's fused support list names the PrivateUse1
    backend)."""
    from torch.testing._internal.common_optimizers import optim_db

    for info in optim_db:
        if "cuda" in info.supports_fused_on and backend not in info.supports_fused_on:
            info.supports_fused_on = (*info.supports_fused_on, backend)


class _Wrapping:
    """Every optimizer the tests build comes back wrapped in SwapOptimizer: optim_db's classes are replaced by
    factories of the same name (the tests branch on `optim_cls.__name__`), and so are the classes the file uses
    by name (its SGD, and torch.optim.Adam/AdamW/LBFGS through a view of torch given to the file alone: torch's
    own classes stay as they are, swapopt checks them by identity)."""

    def __init__(self) -> None:
        import torch

        from swapopt import SwapOptimizer

        self.torch = torch
        self.swap = SwapOptimizer

    def factory(self, cls: type) -> type:
        swap = self.swap

        class Wrapped:
            def __new__(cls_, *args: Any, **kwargs: Any) -> Any:  # noqa: N804
                return swap(cls(*args, **kwargs))

        Wrapped.__name__ = Wrapped.__qualname__ = cls.__name__
        Wrapped.__module__ = cls.__module__
        return Wrapped

    def install(self, module: types.ModuleType) -> None:
        from torch.testing._internal.common_optimizers import optim_db

        for info in optim_db:
            info.optim_cls = self.factory(info.optim_cls)
        module.SGD = self.factory(module.SGD)
        optim = types.SimpleNamespace(**{n: getattr(self.torch.optim, n) for n in dir(self.torch.optim) if not n.startswith("__")})
        for name in ("Adam", "AdamW", "LBFGS"):
            setattr(optim, name, self.factory(getattr(self.torch.optim, name)))
        module.torch = _View(self.torch, optim=optim)


class _View(types.ModuleType):
    """A module that answers as `base` does except for the attributes given."""

    def __init__(self, base: types.ModuleType, **overrides: Any) -> None:
        super().__init__(base.__name__)
        self.__dict__.update(overrides)
        self._base = base

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def _load(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("torch_test_optim", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    # The exception's own line is the last of a traceback.
    return (lines[-1] if lines else "")[:300]


def _outcome(result: unittest.TestResult) -> tuple[str, str]:
    if result.errors:
        return "error", _first_line(result.errors[0][1])
    if result.failures:
        return "fail", _first_line(result.failures[0][1])
    if result.skipped:
        return "skip", _first_line(result.skipped[0][1])
    if result.expectedFailures:
        return "xfail", ""
    if result.unexpectedSuccesses:
        return "xpass", ""
    return "pass", ""


def _key(name: str, device_type: str) -> str:
    """A test's name without its device suffix (`_cpu`, `_sim`), so modes compare name by name."""
    for suffix in (f"_{device_type}_", f"_{device_type}"):
        if suffix in name:
            head, _, tail = name.rpartition(suffix)
            return f"{head}_{tail}" if tail else head
    return name


def run(
    mode: str,
    path: Path,
    optims: list[str] | None = None,
    flavour: str = "cuda",
    out: Path | None = None,
    tests: list[str] | None = None,
) -> dict[str, Any]:
    """Run the file's tests for `mode` in this process; {"tests": {key: [outcome, reason]}, ...}, also written
    to `out` after every test (a long run's partial results stay usable)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    import torch

    sim_context = None
    if mode != "cpu":
        sys.path[:0] = [str(ROOT)]
        import device.sim as sim_pkg
        from device.sim import backend

        backend.register(flavour)
        sim_context = sim_pkg.activate("h100" if flavour == "cuda" else "910b")
    # common_device_type lists its device bases at import: import it only now the backend is registered.
    from torch.testing._internal import common_device_type as cdt

    if mode != "cpu" and cdt.PrivateUse1TestBase not in cdt.device_type_test_bases:
        cdt.device_type_test_bases.append(cdt.PrivateUse1TestBase)
    _stub_siblings()
    device_type = "cpu" if mode == "cpu" else torch._C._get_privateuse1_backend_name()
    if mode != "cpu":
        _as_cuda_stand_in(device_type)
    sim = sim_context.__enter__() if sim_context is not None else None
    try:
        module = _load(path)
        if mode == "wrapped":
            _Wrapping().install(module)
        cls_name = "TestOptimRenewed" + ("CPU" if mode == "cpu" else device_type.upper())
        cls = getattr(module, cls_name, None) or getattr(module, "TestOptimRenewedPRIVATEUSE1")
        names = sorted(n for n in dir(cls) if n.startswith("test_"))
        if optims:
            names = [n for n in names if any(f"_{o}_" in n for o in optims)]
        if tests:
            names = [n for n in names if any(n.startswith(f"{t}_") for t in tests)]
        outcomes: dict[str, list[str]] = {}
        durations: dict[str, float] = {}
        started = time.perf_counter()
        for name in names:
            began = time.perf_counter()
            result = unittest.TestResult()
            cls(name).run(result)
            outcome = _outcome(result)
            if sim is not None and outcome[0] == "pass":
                # A race the sanitizer keeps for the next synchronize belongs to this test.
                try:
                    sim.synchronize()
                except Exception as error:  # noqa: BLE001 - any late report fails the test that caused it
                    outcome = ("error", f"{type(error).__name__}: {str(error).splitlines()[0][:250]}")
            outcomes[_key(name, device_type)] = list(outcome)
            durations[_key(name, device_type)] = round(time.perf_counter() - began, 2)
            if out is not None:
                _write(out, _summary(mode, device_type, time.perf_counter() - started, outcomes, durations))
        seconds = time.perf_counter() - started
    finally:
        if sim_context is not None:
            sim_context.__exit__(None, None, None)
    summary = _summary(mode, device_type, seconds, outcomes, durations)
    if out is not None:
        _write(out, summary)
    return summary


def _summary(mode: str, device_type: str, seconds: float, tests: dict, durations: dict) -> dict[str, Any]:
    import torch

    counts: dict[str, int] = {}
    for outcome, _ in tests.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return {"mode": mode, "device_type": device_type, "torch": torch.__version__, "seconds": round(seconds, 1),
            "counts": counts, "tests": tests, "durations": durations}  # fmt: skip


def _write(path: Path, summary: dict[str, Any]) -> None:
    path.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--file", help=f"torch's test/test_optim.py (default: ${ENV})")
    parser.add_argument("--optims", help="comma-separated optimizer names to run (default: all)")
    parser.add_argument("--tests", help="comma-separated test names (without parameters) to run (default: all)")
    parser.add_argument("--flavour", default="cuda", choices=("cuda", "npu"))
    parser.add_argument("--json", help="write the outcomes here")
    args = parser.parse_args(argv)
    path = test_file(args.file)
    if path is None:
        parser.error(f"no test_optim.py: pass --file or set {ENV}")
    out = run(args.mode, path, args.optims.split(",") if args.optims else None, args.flavour,
              Path(args.json) if args.json else None, args.tests.split(",") if args.tests else None)  # fmt: skip
    print(json.dumps({k: v for k, v in out.items() if k not in ("tests", "durations")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())


# What docs/optimizer.md says SwapOptimizer refuses, by a part of its message: a wrapped test that fails with one
# of them is a documented refusal, not a defect.
REFUSALS = {
    "sparse gradients": "SwapOptimizer does not support sparse gradients",
    "LBFGS": "LBFGS cannot be swapped",
    "SparseAdam": "SparseAdam cannot be swapped",
    "differentiable=True": "has differentiable=True",
}
# What docs/optimizer.md asks of a program that holds a reference to the states across a step: fetching
# `opt.state` after step() waits for the step's swap-outs (Note [reading states] in swapopt/optimizer.py), but a
# dict or tensor taken before the step and read after it needs `opt.wait_for_swap_out()` first; without it the
# read races with the swap-outs (on hardware too), and the sanitizer says so, naming the swap-out.
UNWAITED_READ = ("state held across a step, read before wait_for_swap_out", "(in 'swapopt.swap_out")
DOCUMENTED = {**REFUSALS, UNWAITED_READ[0]: UNWAITED_READ[1]}
# A test torch itself runs on the CPU only (@onlyCPU): skipped for any other device type, CUDA's included.
CPU_ONLY = "Only runs on cpu"


def compare(cpu: dict[str, list[str]], other: dict[str, list[str]], wrapped: bool) -> dict[str, Any]:
    """Every test that passes on the CPU must pass in `other` (a sim or wrapped run of the same tests), except
    @onlyCPU tests and, wrapped, what docs/optimizer.md documents (DOCUMENTED: refusals, and the states read
    without the wait it asks for); {"violations": {key: outcome}, "refusals": {category: n}, "compared": n,
    "cpu_only": n}."""
    violations: dict[str, list[str]] = {}
    refusals: dict[str, int] = {}
    compared = cpu_only = 0
    for key, (outcome, _) in sorted(cpu.items()):
        if outcome != "pass" or key not in other:
            continue
        got = other[key]
        if got[0] == "pass":
            compared += 1
            continue
        if got[0] == "skip" and got[1].startswith(CPU_ONLY):
            cpu_only += 1
            continue
        category = next((c for c, text in DOCUMENTED.items() if wrapped and text in got[1]), None)
        if category is not None:
            compared += 1
            refusals[category] = refusals.get(category, 0) + 1
            continue
        violations[key] = got
    return {"violations": violations, "refusals": refusals, "compared": compared, "cpu_only": cpu_only}
