"""One verify run, phase by phase: environment, device tests, calibration and its preset, the benchmark's parts
measured, the same modeled on the calibrated simulator, the peers, the report.

A phase that fails is recorded in the report with why, and the run goes on: device time is scarce, and one
broken phase must not cost the figures of the others. The exit code still says that something failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loguru import logger
from pydantic import BaseModel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import device
from swapopt.bench.report import unique_stem
from swapopt.bench.run import device_label
from swapopt.verify.bench_runs import measured_sizes, peer_rows, run_parts, work_count
from swapopt.verify.calibrate import measure, probe_count
from swapopt.verify.calibrated_preset import calibrated_preset
from swapopt.verify.copy_sweep import EXPANDABLE_NPU, run_copy_sweep
from swapopt.verify.device_tests import run_device_tests
from swapopt.verify.environment import collect
from swapopt.verify.modeled import ModeledRequest, run_modeled
from swapopt.verify.plan import DEVICE_PLAN, DRY_PLAN, VerifyPlan
from swapopt.verify.report import Phase, VerifyReport, write

DEFAULT_OUT = Path("bench/results")
DEVICE_BUDGET_S = 30 * 60
# Which stock preset a device's calibration starts from: its figures stand where a probe cannot fit one.
BASE_PRESETS = {"cuda": "h100", "npu": "910b"}


class VerifyOptions(BaseModel):
    dry_run: bool = False
    sim: str | None = None  # the dry run's preset: a name or a preset file (default h100)
    out: Path = DEFAULT_OUT
    device_tests: bool = True
    bench: bool = True
    peers: bool = True
    model_e2e: bool | None = None  # None: the plan's choice (on in the dry run, off on a device)
    progress: bool = True


class _Phases:
    """Times each phase and records how it ended; a failing phase is logged and recorded, not raised."""

    def __init__(self, progress: Progress) -> None:
        self.done: list[Phase] = []
        self.progress = progress

    @contextlib.contextmanager
    def phase(self, name: str, total: int = 1) -> Iterator[Callable[[], None]]:
        task = self.progress.add_task(name, total=max(total, 1))
        started = time.monotonic()
        status = "ok"
        try:
            yield lambda: self.progress.advance(task)
        except Exception as err:  # noqa: BLE001 - see the module docstring
            status = f"failed: {type(err).__name__}: {' '.join(str(err).split())[:300]}"
            logger.opt(exception=err).error("{} failed", name)
        finally:
            self.progress.update(task, completed=max(total, 1))
            self.done.append(Phase(name=name, seconds=time.monotonic() - started, status=status))

    def skip(self, name: str, why: str) -> None:
        self.done.append(Phase(name=name, seconds=0.0, status=f"skipped: {why}"))

    @property
    def failed(self) -> list[Phase]:
        return [p for p in self.done if p.status.startswith("failed")]


def _measured_side(options: VerifyOptions) -> contextlib.AbstractContextManager[Any]:
    """The simulator with the dry run's preset, or nothing on a device."""
    if not options.dry_run:
        return contextlib.nullcontext()
    from device import sim
    from device.sim.preset_file import resolve_preset

    return sim.activate(resolve_preset(options.sim or "h100"), sanitize=False)


def _same_preset(a: Any, b: Any) -> bool:
    return dataclasses.asdict(a) == dataclasses.asdict(b)


def _env_takes_path(path: Path) -> bool:
    """Whether SWAPOPT_SIM_PRESET may name this file (the process-wide simulator reads it through get_preset)."""
    from device.sim.presets import get_preset

    try:
        get_preset(str(path))
    except (ValueError, TypeError, AttributeError):
        return False
    return True


def verify(options: VerifyOptions) -> tuple[VerifyReport, list[Path], bool]:
    """Run every phase; (report, files written, whether every phase passed)."""
    from device.sim.preset_file import load_preset, resolve_preset, save_preset

    plan: VerifyPlan = DRY_PLAN if options.dry_run else DEVICE_PLAN
    if options.model_e2e is not None:
        plan = plan.model_copy(update={"model_e2e": options.model_e2e})
    now = datetime.now(timezone.utc)
    started = time.monotonic()
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), disable=not options.progress)
    phases = _Phases(progress)
    notes: list[str] = []
    with progress, _measured_side(options):
        label = device_label()
        kind = "sim" if device.is_simulated() else device.get_device()
        report = VerifyReport(dry_run=options.dry_run, date=f"{now:%Y-%m-%d %H:%M} UTC", label=label,
                              environment=collect(label))
        for line in report.environment.lines():
            print(line)
        options.out.mkdir(parents=True, exist_ok=True)
        stem = unique_stem(options.out, f"{label}-{now:%Y-%m-%d}-verify")

        marker = "npu" if report.environment.kind == "npu" else "cuda"
        if options.device_tests:
            with phases.phase(f"device tests (-m {marker})"):
                report.device_tests = run_device_tests(marker, collect_only=options.dry_run,
                                                       timeout_s=plan.device_tests_timeout_s)
                print(f"device tests: {report.device_tests.summary}")
                if report.device_tests.returncode not in (0, 5):  # 5: no test carries the marker
                    raise RuntimeError(f"pytest -m {marker} exited with {report.device_tests.returncode}")
        else:
            phases.skip("device tests", "--skip-device-tests")

        preset_path = options.out / f"{stem}-preset.json"
        with phases.phase("calibration", probe_count(plan.calibration)) as advance:
            report.calibration = measure(plan.calibration, label, progress=advance)
            base = resolve_preset(options.sim or "h100") if options.dry_run else resolve_preset(BASE_PRESETS[kind])
            what = f"{report.environment.device_name}" + (
                f", driver {report.environment.driver}" if report.environment.driver else "") + (
                f", CANN {report.environment.cann}" if report.environment.cann else "") + (
                f", {report.environment.link.split(';')[0]}" if report.environment.link else "")
            preset = calibrated_preset(report.calibration, base, name=f"{label}-{now:%Y-%m-%d}",
                                       when=f"{now:%Y-%m-%d}", what_device=what)
            save_preset(preset, preset_path)
            report.base_preset, report.calibrated_preset = dataclasses.asdict(base), dataclasses.asdict(preset)
            report.preset_path = str(preset_path)
            report.preset_round_trip = _same_preset(load_preset(preset_path), preset)
            report.preset_env_ok = _env_takes_path(preset_path)
            if not report.preset_round_trip:
                raise RuntimeError(f"{preset_path} does not load back into the preset written")

        if report.environment.kind == "npu":
            with phases.phase("copies, expandable-segment pinned"), tempfile.TemporaryDirectory() as tmp:
                report.expandable_copies = run_copy_sweep(
                    plan.calibration.copy_sizes, plan.calibration.copy_target_bytes, EXPANDABLE_NPU,
                    Path(tmp) / "copies.json")

        if options.bench:
            sizes = measured_sizes(plan)
            with phases.phase("benchmark (measured)", work_count(plan, sizes, e2e=True)) as advance:
                report.measured = run_parts(plan, sizes, layout_caps=None, e2e=True, progress=advance)
        else:
            phases.skip("benchmark (measured)", "--skip-bench")

        if options.peers:
            with phases.phase("peers"):
                report.peers, report.peers_note = peer_rows(plan.peer_steps, options.dry_run)
        else:
            phases.skip("peers", "--skip-peers")

    # The modeled side needs the preset file, and a process of its own (swapopt/verify/modeled.py).
    if report.preset_path and report.preset_round_trip:
        measured = report.measured
        request = ModeledRequest(
            plan=plan, label=f"sim-{label}", bench=options.bench and measured is not None, e2e=plan.model_e2e,
            sizes=[min(s.size_b, plan.model_bench_size) for s in measured.sizes] if measured else [],
            layout_caps={lay.layout: min(lay.numel, plan.model_layout_max_numel) for lay in measured.layouts}
            if measured else {},
        )
        with progress, phases.phase("modeled on the calibrated simulator"), tempfile.TemporaryDirectory() as tmp:
            modeled = run_modeled(Path(report.preset_path), request, Path(tmp),
                                  timeout_s=600 if options.dry_run else 1200)
            report.modeled_calibration, report.modeled = modeled.calibration, modeled.parts
    else:
        phases.skip("modeled on the calibrated simulator", "no calibrated preset")

    elapsed = time.monotonic() - started
    if not options.dry_run and elapsed > DEVICE_BUDGET_S:
        notes.append(f"the run took {elapsed / 60:.1f} minutes, over its {DEVICE_BUDGET_S // 60}-minute budget")
    if options.dry_run:
        notes.append("dry run: small sizes on the simulator; 'measured' figures are the simulator's own model with "
                     f"the {options.sim or 'h100'} preset, so measured / modeled shows how well the calibration "
                     "reads that preset back, not how a device behaves")
    report.phases, report.notes = phases.done, notes
    paths = write(report, options.out, stem)
    return report, paths, not phases.failed
