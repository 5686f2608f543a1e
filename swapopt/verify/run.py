"""One verify run, phase by phase: environment, device tests, calibration and its preset, the benchmark's parts
measured, the same modeled on the calibrated simulator, the peers, the report.

A phase that fails is recorded in the report with why, and the run goes on: device time is scarce, and one
broken phase must not cost the figures of the others. The exit code still says that something failed.

``quick``: the device tests, calibration, quick table, layouts, one end-to-end config and, where
swapopt.bench.capacity is installed, the capacity table, each phase stopped at its own time limit (the plan's
``limits``, cut to what is left of QUICK_BUDGET_S); a stopped phase keeps what it finished and is reported
"stopped", and the later phases still run. No peers and no modeled side: :func:`model_report` adds that later, on
any CPU machine, to the report the quick run wrote (``python -m swapopt.verify --model REPORT.json``).

A limit is enforced with SIGALRM in the main thread: the phase's Python is interrupted where it is (a single long
call into torch, such as one pinned allocation, finishes first), except inside the simulator's own Python (an op, a
backward pass), where raising would cross torch's C++ (Note [signals inside simulated ops] in device/sim/signals.py):
there the stop waits until it returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import inspect
import json
import platform
import signal
import sys
import tempfile
import threading
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
from swapopt.verify.bench_runs import (BenchParts, measured_sizes, peer_rows, run_e2e_configs, run_layouts, run_parts,
                                       run_sizes, work_count)
from swapopt.verify.calibrate import measure, probe_count
from swapopt.verify.calibrated_preset import calibrated_preset
from swapopt.verify.copy_sweep import EXPANDABLE_NPU, run_copy_sweep
from swapopt.verify.device_tests import run_device_tests
from swapopt.verify.environment import collect
from swapopt.verify.modeled import ModeledRequest, run_modeled
from swapopt.verify.plan import (DEVICE_PLAN, DRY_PLAN, QUICK_BUDGET_S, QUICK_DEVICE_PLAN, QUICK_DRY_PLAN,
                                  QUICK_STARTUP_S, CalibrationPlan, VerifyPlan)
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
    quick: bool = False  # the short plan (module docstring): a slot of a few minutes on a shared device
    limits: dict[str, float] | None = None  # per-phase limits in seconds, over the plan's (tests)


class PhaseStopped(BaseException):
    """A phase ran past its time limit. A BaseException, so that the ``except Exception`` of a benchmark that
    turns a failing row into a note does not swallow the stop."""


def _sim_holds_signals() -> bool:
    """Whether the main thread is inside the simulator's own Python (an op, a backward pass), where a handler must
    not raise (Note [signals inside simulated ops] in device/sim/signals.py); False where no simulator was loaded."""
    signals = sys.modules.get("device.sim.signals")
    return signals is not None and signals.inside_simulator()


@contextlib.contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Raise PhaseStopped in the body once `seconds` have passed (main thread only; elsewhere no limit)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    armed = True

    def stop(signum: int, frame: Any) -> None:
        if not armed:
            return
        if _sim_holds_signals():
            # Try again soon: the simulator's own Python (a backward pass, an op) can take most of a phase's
            # time, and a retry that lands in one more region would let the phase run on.
            signal.setitimer(signal.ITIMER_REAL, 0.002)
            return
        # Armed again before raising: a stop that lands in a finalizer or a weakref callback is swallowed by
        # the interpreter ("Exception ignored in ..."), and the phase must still stop at the next tick.
        signal.setitimer(signal.ITIMER_REAL, 0.02)
        raise PhaseStopped

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _recover_device() -> None:
    """After a stopped phase: let the device finish what was queued and give back what the phase held."""
    gc.collect()
    with contextlib.suppress(Exception):
        mod = device.get_torch_device_module()
        mod.synchronize()
        mod.empty_cache()


class _Phases:
    """Times each phase and records how it ended; a failing phase is logged and recorded, not raised. A phase
    with a limit is stopped there (PhaseStopped) and recorded "stopped"."""

    def __init__(self, progress: Progress) -> None:
        self.done: list[Phase] = []
        self.progress = progress

    @contextlib.contextmanager
    def phase(self, name: str, total: int = 1, limit_s: float | None = None) -> Iterator[Callable[[], None]]:
        task = self.progress.add_task(name, total=max(total, 1))
        started = time.monotonic()
        status = "ok"
        try:
            with _time_limit(limit_s):
                yield lambda: self.progress.advance(task)
        except PhaseStopped:
            status = f"stopped: past its {limit_s:.0f} s limit; what it finished is kept"
            logger.error("{} stopped at its {:.0f} s limit", name, limit_s)
            _recover_device()
        except Exception as err:  # noqa: BLE001 - see the module docstring
            status = f"failed: {type(err).__name__}: {' '.join(str(err).split())[:300]}"
            logger.opt(exception=err).error("{} failed", name)
        finally:
            self.progress.update(task, completed=max(total, 1))
            self.done.append(Phase(name=name, seconds=time.monotonic() - started, status=status,
                                   limit_s=limit_s))

    def skip(self, name: str, why: str) -> None:
        self.done.append(Phase(name=name, seconds=0.0, status=f"skipped: {why}"))

    @property
    def failed(self) -> list[Phase]:
        return [p for p in self.done if p.status.startswith(("failed", "stopped"))]


def _measured_side(options: VerifyOptions) -> contextlib.AbstractContextManager[Any]:
    """The simulator with the dry run's preset, or nothing on a device."""
    if not options.dry_run:
        return contextlib.nullcontext()
    from device import sim
    from device.sim.presets import resolve_preset

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


def _calibrate(report: VerifyReport, plan: VerifyPlan, options: VerifyOptions, kind: str, label: str, now: datetime,
               preset_path: Path, advance: Callable[[], None]) -> None:
    """The calibration probes, and the preset they make written to `preset_path` (checked to load back)."""
    from device.sim.preset_file import load_preset, save_preset
    from device.sim.presets import resolve_preset

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


def _capacity(report: VerifyReport, options: VerifyOptions) -> None:
    """swapopt.bench.capacity's table (the largest model that fits), for this run's device and host: its memory
    and host RAM as the environment reports them, and the preset the calibration wrote (or the dry run's)."""
    from swapopt.bench import capacity  # type: ignore[attr-defined]

    table = capacity.capacity_table
    env = report.environment
    preset = report.preset_path if report.preset_round_trip and report.preset_env_ok else (
        options.sim or "h100" if options.dry_run else BASE_PRESETS.get(env.kind, "h100"))
    wanted: dict[str, Any] = {"preset": preset}
    if not options.dry_run:  # the simulator's own capacity is the preset's; a device's is what it reports
        wanted.update(device_bytes=env.device_memory_bytes, host_bytes=env.host_ram_bytes)
    accepted = inspect.signature(table).parameters
    result = table(**{k: v for k, v in wanted.items() if k in accepted and v is not None})
    report.capacity = _plain(result)


def _plain(value: Any) -> Any:
    """JSON-able form of what a module returns: pydantic models, dataclasses, named tuples, lists of them."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if hasattr(value, "_asdict"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def _start_report(options: VerifyOptions, plan: Any, now: Any, quick: bool) -> tuple[str, str, VerifyReport, str, str]:
    """The device's label and kind, an empty report with its environment (printed), the files' stem in
    ``options.out`` and the pytest marker of the device tests."""
    label = device_label()
    kind = "sim" if device.is_simulated() else device.get_device()
    report = VerifyReport(dry_run=options.dry_run, quick=quick, date=f"{now:%Y-%m-%d %H:%M} UTC", label=label,
                          environment=collect(label), plan=plan)
    for line in report.environment.lines():
        print(line)
    options.out.mkdir(parents=True, exist_ok=True)
    stem = unique_stem(options.out, f"{label}-{now:%Y-%m-%d}-verify" + ("-quick" if quick else ""))
    return label, kind, report, stem, "npu" if report.environment.kind == "npu" else "cuda"


def _quick(options: VerifyOptions) -> tuple[VerifyReport, list[Path], bool]:
    """The quick plan (module docstring)."""
    plan: VerifyPlan = QUICK_DRY_PLAN if options.dry_run else QUICK_DEVICE_PLAN
    limits = {**(plan.limits or {}), **(options.limits or {})}
    now = datetime.now(timezone.utc)
    started = time.monotonic()
    # What is left for the phases once start-up (before this call) and writing the files are counted.
    deadline = started + QUICK_BUDGET_S - QUICK_STARTUP_S - 5
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), disable=not options.progress)
    phases = _Phases(progress)

    def limit(name: str) -> float | None:
        """The phase's own limit, cut to what is left of the budget on a device (the dry run has no budget)."""
        own = limits.get(name)
        if options.dry_run:
            return own
        left = deadline - time.monotonic()
        return left if own is None else min(own, left)

    def run(name: str, body: Callable[[Callable[[], None]], None], total: int = 1) -> None:
        seconds = limit(name)
        if seconds is not None and seconds < 1:
            phases.skip(name, f"no time left of the {QUICK_BUDGET_S} s quick budget")
            return
        with phases.phase(name, total, seconds) as advance:
            body(advance)

    with progress, _measured_side(options):
        label, kind, report, stem, marker = _start_report(options, plan, now, quick=True)

        if options.device_tests:
            def device_tests(advance: Callable[[], None]) -> None:
                seconds = limit("device tests")
                timeout = plan.device_tests_timeout_s if seconds is None else max(int(seconds), 1)
                report.device_tests = run_device_tests(marker, collect_only=options.dry_run, timeout_s=timeout)
                print(f"device tests: {report.device_tests.summary}")
                if report.device_tests.returncode not in (0, 5):
                    raise RuntimeError(f"pytest -m {marker} exited with {report.device_tests.returncode}")

            run("device tests", device_tests)
        else:
            phases.skip("device tests", "--skip-device-tests")

        preset_path = options.out / f"{stem}-preset.json"
        run("calibration", lambda advance: _calibrate(report, plan, options, kind, label, now, preset_path, advance),
            probe_count(plan.calibration))

        if options.bench:
            report.measured = parts = BenchParts()
            sizes = measured_sizes(plan)
            run("quick table", lambda advance: run_sizes(plan, sizes, parts, advance),
                work_count(plan, sizes, e2e=False) - len(plan.layouts))
            run("layouts", lambda advance: run_layouts(plan, parts, None, advance), len(plan.layouts))
            # per config: one step per variant and one for its host time
            run("end to end", lambda advance: run_e2e_configs(plan, parts, True, advance), 4 * len(plan.e2e))
        else:
            for name in ("quick table", "layouts", "end to end"):
                phases.skip(name, "--skip-bench")

        try:
            importlib.import_module("swapopt.bench.capacity")
        except ImportError:
            phases.skip("capacity", "swapopt.bench.capacity is not in this swapopt")
        else:
            run("capacity", lambda advance: _capacity(report, options))

    phases.skip("peers", "not in the quick plan (python -m swapopt.bench.peers runs them)")
    phases.skip("modeled on the calibrated simulator", "left to a CPU machine: python -m swapopt.verify --model "
                f"{options.out / (stem + '.json')}")
    elapsed = time.monotonic() - started
    notes = [f"quick plan: {elapsed:.0f} s from the start of verify to the report (its phases' limits and "
             f"{QUICK_STARTUP_S} s of start-up fit {QUICK_BUDGET_S} s)"]
    if options.dry_run:
        notes.append("dry run: small sizes on the simulator; 'measured' figures are the simulator's own model")
    report.phases, report.notes = phases.done, notes
    paths = write(report, options.out, stem)
    return report, paths, not phases.failed


def verify(options: VerifyOptions) -> tuple[VerifyReport, list[Path], bool]:
    """Run every phase; (report, files written, whether every phase passed)."""
    if options.quick:
        return _quick(options)
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
        label, kind, report, stem, marker = _start_report(options, plan, now, quick=False)
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
            _calibrate(report, plan, options, kind, label, now, preset_path, advance)

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


# ----- the modeled side, later, on a CPU machine --------------------------------------------------------------


def plan_of(report: VerifyReport) -> VerifyPlan:
    """The plan a report ran: stored in it, or (a report written before plans were stored) the device plan with
    the probes and layouts the report shows."""
    if report.plan is not None:
        return report.plan
    base = DRY_PLAN if report.dry_run else DEVICE_PLAN
    cal = report.calibration
    update: dict[str, Any] = {}
    if cal is not None:
        update["calibration"] = CalibrationPlan(**{
            **base.calibration.model_dump(), "copy_sizes": [p.nbytes for p in cal.copies],
            "adamw_numels": [p.numel for p in cal.adamw], "matmul_n": cal.matmul.n})
    if report.measured is not None:
        update["layouts"] = [lay.layout for lay in report.measured.layouts]
    return base.model_copy(update=update)


def modeled_preset(report: VerifyReport, report_path: Path, preset: str | None, workdir: Path) -> tuple[Path, str]:
    """The preset file the modeled side runs with, and what it is: `preset` (a name or file) when given; else the
    preset the report's calibration wrote (kept in the report); else its file; else the stock h100 preset."""
    from device.sim.preset_file import FORMAT, preset_from_dict, save_preset
    from device.sim.presets import resolve_preset

    target = workdir / "preset.json"
    if preset is not None:
        save_preset(resolve_preset(preset), target)
        return target, f"the preset {preset} (given with --preset)"
    if report.calibrated_preset:
        save_preset(preset_from_dict({"format": FORMAT, **report.calibrated_preset}, where=str(report_path)), target)
        return target, f"the preset this report's calibration wrote ({report.calibrated_preset.get('name')})"
    if report.preset_path:
        for candidate in (Path(report.preset_path), report_path.parent / Path(report.preset_path).name):
            if candidate.is_file():
                return candidate, f"the preset file {candidate}"
    save_preset(resolve_preset("h100"), target)
    return target, "the stock h100 preset (the report has no calibrated preset)"


def model_report(report_path: Path, *, preset: str | None = None, model_e2e: bool | None = None,
                 timeout_s: int = 7200) -> tuple[VerifyReport, list[Path], bool]:
    """Add the modeled side to a verify report written on a device (a quick run leaves it out): the same probes and
    benchmark parts on the simulator, in a process of its own, and the comparison measured / modeled per row.
    Rewrites the report's JSON and markdown in place (and its copy-rate chart); (report, files, whether it ran)."""
    report = VerifyReport.model_validate_json(report_path.read_text())
    if report.calibration is None:
        raise ValueError(f"{report_path} has no calibration: there is nothing to model against")
    plan = plan_of(report)
    if model_e2e is not None:
        plan = plan.model_copy(update={"model_e2e": model_e2e})
    measured = report.measured
    request = ModeledRequest(
        plan=plan, label=f"sim-{report.label}", bench=measured is not None, e2e=plan.model_e2e and bool(measured),
        sizes=[min(s.size_b, plan.model_bench_size) for s in measured.sizes] if measured else [],
        layout_caps={lay.layout: min(lay.numel, plan.model_layout_max_numel) for lay in measured.layouts}
        if measured else {},
    )
    started = time.monotonic()
    status = "ok"
    with tempfile.TemporaryDirectory() as tmp:
        path, how = modeled_preset(report, report_path, preset, Path(tmp))
        print(f"modeling {report_path} on the simulator with {how}")
        try:
            modeled = run_modeled(path, request, Path(tmp), timeout_s=timeout_s)
            report.modeled_calibration, report.modeled = modeled.calibration, modeled.parts
        except Exception as err:  # noqa: BLE001 - recorded in the report like any phase
            status = f"failed: {type(err).__name__}: {' '.join(str(err).split())[:300]}"
    name = "modeled on the calibrated simulator"
    report.phases = [p for p in report.phases if p.name != name] + [
        Phase(name=name, seconds=time.monotonic() - started, status=status)]
    when = datetime.now(timezone.utc)
    report.notes = [n for n in report.notes if not n.startswith("modeled side: ")] + [
        f"modeled side: added {when:%Y-%m-%d %H:%M} UTC by python -m swapopt.verify --model on a CPU machine "
        f"({platform.machine()}, {platform.system()}), with {how}"]
    paths = write(report, report_path.parent, report_path.stem)
    return report, paths, status == "ok"
