"""python -m swapopt.verify: preset files, calibration read back from the simulator, the dry run end to end.

The simulator's times are its deterministic model, so the calibration tests can ask for the preset's own
figures back; nothing here is timed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from pydantic import BaseModel

import cli_zygote
from device import sim as device_sim
from device.sim.preset_file import load_preset, looks_like_path, preset_to_dict, save_preset
from device.sim.presets import PRESETS, SimPreset, resolve_preset
from swapopt.verify.calibrate import (
    Calibration,
    CopyPoint,
    DuplexPoint,
    LaunchCost,
    MatmulPoint,
    StepPoint,
    _duplex,
    measure,
)
from swapopt.verify.calibrated_preset import calibrated_preset, fit, keeps_rate
from swapopt.verify.comparison import Comparison, _scale
from swapopt.verify.device_tests import parse_summary, run_device_tests
from swapopt.verify.environment import cann_version, pcie_link
from swapopt.verify.plan import CalibrationPlan

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SWAPOPT_DEVICE", "SWAPOPT_SIM_PRESET")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


# ---- preset files ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_file_round_trip_keeps_every_field(tmp_path, name):
    preset = dataclasses.replace(PRESETS[name], calibrated="2026-11-25, a device", measured={"h2d_gbps": 51.5})
    path = save_preset(preset, tmp_path / "sub" / f"{name}.json")
    data = json.loads(path.read_text())
    assert {f.name for f in dataclasses.fields(SimPreset)} <= set(data)  # read off the class, not a list
    back = load_preset(path)
    assert back == preset
    assert isinstance(back.capacity_bytes, int)


def test_preset_file_missing_optional_fields_take_defaults_and_unknown_keys_are_dropped(tmp_path):
    data = preset_to_dict(PRESETS["h100"])
    del data["measured"], data["calibrated"]
    data["a_field_from_a_newer_swapopt"] = 1.0
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    back = load_preset(path)
    assert back.measured == {} and back.calibrated is None
    assert back.h2d_gbps == PRESETS["h100"].h2d_gbps


@pytest.mark.parametrize("content, message", [
    ('{"name": "x"}', "not a simulator preset file"),
    ('{"format": "swapopt-sim-preset", "name": "x"}', "lacks simulator preset fields: h2d_gbps"),
    ("[1, 2]", "does not hold a JSON object"),
    ("{oops", "is not JSON"),
])
def test_bad_preset_files_are_refused_naming_the_file(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        load_preset(path)
    assert "bad.json" in str(err.value)


def test_preset_file_checks_still_apply(tmp_path):
    data = preset_to_dict(PRESETS["h100"]) | {"duplex_gbps": 1.0}
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="duplex_gbps must be at least"):
        load_preset(tmp_path / "p.json")


def test_names_and_paths_resolve(tmp_path):
    assert looks_like_path("x.json") and looks_like_path("dir/x") and looks_like_path(tmp_path)
    assert not looks_like_path("h100")
    assert resolve_preset("910b") is PRESETS["910b"]
    with pytest.raises(ValueError, match="does not exist"):
        resolve_preset(tmp_path / "missing.json")


def test_activate_takes_a_preset_path(tmp_path, clean_device_env):
    preset = dataclasses.replace(PRESETS["h100"], name="calibrated-test", h2d_gbps=40.0)
    path = save_preset(preset, tmp_path / "p.json")
    with device_sim.activate(str(path)) as simulated:
        assert simulated.preset == preset
    with device_sim.activate(path) as simulated:
        assert simulated.preset.name == "calibrated-test"


def test_process_wide_simulator_takes_a_preset_path(tmp_path):
    from device.sim.presets import get_preset

    path = save_preset(dataclasses.replace(PRESETS["h100"], name="from-env", h2d_gbps=33.0), tmp_path / "p.json")
    try:
        get_preset(str(path))
    except ValueError:
        pytest.skip("device.sim.presets.get_preset does not take preset file paths yet (SWAPOPT_SIM_PRESET needs it)")
    env = _env() | {"SWAPOPT_DEVICE": "sim", "SWAPOPT_SIM_PRESET": str(path)}
    done = cli_zygote.run(["-c", "import device; p = device.get_torch_device_module().preset; print(p.name, p.h2d_gbps)"],
                          cwd=ROOT, env=env, timeout=300)
    assert done.stdout.split() == ["from-env", "33.0"], done.stderr[-2000:]


# ---- calibration ----------------------------------------------------------------------------------------------

# The matmul at 512^3: torch's CPU bf16 GEMM, which the simulator runs, takes about a minute at 2048^3 on a host
# without AVX-512 (a 2-core AMD EPYC, AVX2 alone), a second at 512^3; ODD's bf16 rate keeps it compute-bound there.
SMALL = CalibrationPlan(copy_sizes=[MB, 4 * MB], copy_target_bytes=16 * MB, adamw_numels=[100_000, 400_000],
                        matmul_n=512, matmul_repeats=1, launches=50, repeats=1)
# A preset unlike either stock one, so that reading it back proves the fit, not a default.
ODD = dataclasses.replace(PRESETS["h100"], name="odd", h2d_gbps=40.0, d2h_gbps=50.0, duplex_gbps=70.0,
                          copy_latency_us=3.0, hbm_gbps=2000.0, bf16_tflops=5.0, launch_us=4.0,
                          duplex_table=((float(MB), 30.0, 40.0),))


@pytest.fixture(scope="module")
def odd_calibration() -> Calibration:
    # Sanitizer on: the probes' own stream use must be race-free, as it must be on a device.
    with device_sim.activate(ODD, sanitize=True):
        return measure(SMALL, "sim-odd")


def test_calibration_reads_the_simulators_figures_back(odd_calibration):
    f = fit(odd_calibration)
    assert f.h2d_gbps == pytest.approx(40.0, rel=1e-3)
    assert f.d2h_gbps == pytest.approx(50.0, rel=1e-3)
    assert f.copy_latency_us == pytest.approx(3.0, rel=1e-2)
    assert f.hbm_gbps == pytest.approx(2000.0, rel=1e-3)
    assert f.bf16_tflops == pytest.approx(5.0, rel=1e-3)
    assert f.launch_us == pytest.approx(4.0, rel=1e-3)
    # The cap is the most the table's rows carry together; each row comes back within 5% (below): the windows'
    # edges are worked out at the alone rates, which the "sized" rule departs from while the other direction drains.
    assert f.duplex_gbps == max(h + d for _, h, d in f.duplex_table) == pytest.approx(70.0, rel=0.05)
    # Under the preset's table neither direction keeps its rate with both busy: each moves at the table's.
    assert f.keeps_rate == "neither"
    assert [row[1:] for row in f.duplex_table] == [pytest.approx((30.0, 40.0), rel=0.05)] * len(SMALL.copy_sizes)
    assert odd_calibration.capacity_bytes == ODD.capacity_bytes


def test_calibrated_preset_fills_measured_and_names_its_sources(odd_calibration):
    preset = calibrated_preset(odd_calibration, PRESETS["h100"], name="cal", when="2026-11-25", what_device="Odd GPU")
    assert preset.name == "cal" and preset.flavour == "cuda"
    assert preset.h2d_gbps == pytest.approx(40.0, rel=1e-3)
    assert "2026-11-25" in preset.calibrated and "Odd GPU" in preset.calibrated
    assert preset.measured["h2d_gbps"] == pytest.approx(40.0, rel=1e-3)
    assert preset.measured["first_launched_keeps_rate"] == 0.0
    assert preset.sources["hbm_gbps"].startswith("measured by python -m swapopt.verify on 2026-11-25, Odd GPU")
    assert preset.sources["fp64_tflops"] == PRESETS["h100"].sources["fp64_tflops"]  # not probed: kept
    assert preset.fp64_tflops == PRESETS["h100"].fp64_tflops
    if "link_sharing" in {f.name for f in dataclasses.fields(SimPreset)}:
        assert preset.link_sharing == "sized"


def _calibration(both: list[DuplexPoint], h2d=50.0, d2h=50.0, matmul_ms=1.0) -> Calibration:
    copy = CopyPoint(nbytes=MB, repeats=4, h2d_ms=MB / (h2d * 1e6), d2h_ms=MB / (d2h * 1e6), h2d_gbps=h2d,
                     d2h_gbps=d2h, both=both)
    return Calibration(device="x", simulated=False, copies=[copy],
                       adamw=[StepPoint(numel=1000, ms=0.01), StepPoint(numel=2000, ms=0.02)],
                       matmul=MatmulPoint(n=64, ms=matmul_ms, tflops=1.0),
                       launch=LaunchCost(kernel_us=5.0, host_launch_us=5.0, event_record_us=1.0, event_gap_us=0.0))


@pytest.mark.parametrize("both, rule", [
    ([DuplexPoint(first="h2d", h2d_gbps=30, d2h_gbps=50), DuplexPoint(first="d2h", h2d_gbps=30, d2h_gbps=50)], "d2h"),
    ([DuplexPoint(first="h2d", h2d_gbps=50, d2h_gbps=30), DuplexPoint(first="d2h", h2d_gbps=50, d2h_gbps=30)], "h2d"),
    ([DuplexPoint(first="h2d", h2d_gbps=50, d2h_gbps=30), DuplexPoint(first="d2h", h2d_gbps=30, d2h_gbps=50)],
     "first-launched"),
    ([DuplexPoint(first="h2d", h2d_gbps=40, d2h_gbps=40), DuplexPoint(first="d2h", h2d_gbps=40, d2h_gbps=40)],
     "neither"),
    ([DuplexPoint(first="h2d", h2d_gbps=50, d2h_gbps=50), DuplexPoint(first="d2h", h2d_gbps=50, d2h_gbps=50)], "both"),
])
def test_which_direction_keeps_its_rate(both, rule):
    cal = _calibration(both)
    assert keeps_rate(cal, 50.0, 50.0) == rule
    preset = calibrated_preset(cal, PRESETS["h100"], name="x", when="d", what_device="x")
    assert preset.measured["d2h_keeps_rate"] == float(rule in ("d2h", "both"))
    if "link_sharing" in {f.name for f in dataclasses.fields(SimPreset)}:
        # Whatever kept its rate, the preset takes the rates measured with both busy (Note [link sharing]).
        assert preset.link_sharing == "sized"
        avg = {d: sum(getattr(b, f"{d}_gbps") for b in both) / len(both) for d in ("h2d", "d2h")}
        assert preset.duplex_table == ((MB, pytest.approx(avg["h2d"]), pytest.approx(avg["d2h"])),)


def test_launch_bound_matmul_keeps_the_base_rate():
    cal = _calibration([DuplexPoint(first="h2d", h2d_gbps=50, d2h_gbps=30)], matmul_ms=0.006)  # 6 us < 2 launches
    f = fit(cal)
    assert f.bf16_tflops is None and any("bf16 rate not fitted" in n for n in f.notes)
    preset = calibrated_preset(cal, PRESETS["h100"], name="x", when="d", what_device="x")
    assert preset.bf16_tflops == PRESETS["h100"].bf16_tflops


def test_duplex_rates_from_staggered_blocks():
    # H2D runs 0-10 ms, D2H 2-12 ms; alone each moves 1 byte/ms... here 100 bytes in total each.
    # Outside the common window [2, 10] each ran alone at 10 bytes/ms: H2D 0-2 (20 B), D2H 10-12 (20 B).
    point = _duplex({"h2d": (0.0, 10.0), "d2h": (2.0, 12.0)}, {"h2d": 10.0, "d2h": 10.0}, 100, first="h2d")
    assert point.h2d_gbps == pytest.approx(80 / 8 / 1e6)
    assert point.d2h_gbps == pytest.approx(80 / 8 / 1e6)
    apart = _duplex({"h2d": (0.0, 1.0), "d2h": (1.0, 2.0)}, {"h2d": 7e6, "d2h": 9e6}, 100, first="h2d")
    assert (apart.h2d_gbps, apart.d2h_gbps) == (7.0, 9.0)  # never together: each at its own rate


# ---- environment, device tests, comparison, peers -------------------------------------------------------------


def test_pcie_link_text():
    smi = {"pcie.link.gen.current": "5", "pcie.link.width.current": "16", "pcie.link.gen.max": "5",
           "pcie.link.width.max": "16"}
    assert pcie_link(smi).startswith("PCIe gen 5 x16 (max gen 5 x16)")
    assert pcie_link({}) is None


def test_cann_version_from_the_toolkit_files(tmp_path, monkeypatch):
    (tmp_path / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC3\n")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    assert cann_version() == "8.0.RC3"


def test_pytest_summaries_are_parsed():
    counts, summary, failures = parse_summary(
        "tests/a.py::t PASSED\nFAILED tests/a.py::u - AssertionError: no\n"
        "===== 1 failed, 3 passed, 2 skipped, 17 deselected, 1 warning in 4.12s =====\n")
    assert counts == {"failed": 1, "passed": 3, "skipped": 2, "deselected": 17, "warnings": 1}
    assert summary.startswith("1 failed") and failures == ["FAILED tests/a.py::u - AssertionError: no"]
    counts, _, _ = parse_summary("57/74 tests collected (17 deselected) in 2.46s\n")
    assert counts == {"collected": 57, "deselected": 17}


def test_device_tests_select_the_files_that_name_the_marker(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(
        "import pytest\n\n@pytest.mark.cuda\ndef test_on_device():\n    pass\n\ndef test_plain():\n    pass\n")
    (tmp_path / "tests" / "test_b.py").write_text("def test_other():\n    pass\n")
    done = run_device_tests("cuda", collect_only=True, timeout_s=120, root=tmp_path)
    assert done.command[-2:] == ["--collect-only", "tests/test_a.py"]
    assert done.counts.get("collected") == 1 and done.returncode == 0, done.tail
    none = run_device_tests("npu", collect_only=False, timeout_s=120, root=tmp_path)
    assert none.returncode == 5 and "no test file names pytest.mark.npu" in none.summary


def test_scaled_comparison_says_so():
    assert _scale(100, 100) == (1.0, "")
    factor, note = _scale(8 * MB, 2 * MB)
    assert factor == 4.0 and "scaled x4" in note
    assert Comparison(section="s", item="i", unit="ms", measured=3.0, modeled=2.0).ratio == 1.5
    assert Comparison(section="s", item="i", unit="ms", measured=3.0, modeled=None).ratio is None


class _Peer(BaseModel):
    name: str
    available: bool
    reason: str | None = None
    step_ms: float | None = None
    device_peak_bytes: int | None = None
    note: str | None = None


def test_peer_rows_come_from_the_peers_module(monkeypatch):
    from swapopt.verify.bench_runs import peer_rows

    fake = types.ModuleType("swapopt.bench.peers")
    fake.compare = lambda *, steps, dry_run: [_Peer(name="p", available=True, step_ms=float(steps)),
                                              _Peer(name="q", available=False, reason=f"dry {dry_run}")]
    monkeypatch.setitem(sys.modules, "swapopt.bench.peers", fake)
    monkeypatch.setattr("swapopt.bench.peers", fake, raising=False)
    rows, note = peer_rows(3, True)
    assert note is None and [r["name"] for r in rows] == ["p", "q"] and rows[0]["step_ms"] == 3.0
    assert rows[1]["reason"] == "dry True"

    def broken(*, steps, dry_run):
        raise RuntimeError("no peers today")

    fake.compare = broken
    rows, note = peer_rows(3, True)
    assert rows == [] and "no peers today" in note


# ---- the dry run, end to end ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("verify")
    # Peers have tests of their own (tests/test_bench_peers.py); here the run's own phases.
    done = cli_zygote.run(["-m", "swapopt.verify", "--dry-run", "--skip-peers", "--no-progress",
                           "--out", str(out)], cwd=ROOT, env=_env(), timeout=600)
    return done, out


def test_dry_run_writes_report_chart_and_a_preset_that_loads_back(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    (md,) = out.glob("sim-h100-*-verify.md")
    stem = md.stem
    assert {f"{stem}.json", f"{stem}-copies.png", f"{stem}-preset.json"} <= {p.name for p in out.iterdir()}
    report = json.loads((out / f"{stem}.json").read_text())
    assert report["dry_run"] is True and report["preset_round_trip"] is True
    assert all(p["status"] in ("ok", "skipped: --skip-peers") for p in report["phases"]), report["phases"]
    assert report["device_tests"]["counts"]["collected"] > 0 and report["device_tests"]["ran"] is False
    # The round trip: the file the run wrote is the simulator's preset once loaded, with measured filled in.
    preset = load_preset(out / f"{stem}-preset.json")
    assert preset.measured and preset.calibrated.startswith(report["date"][:10])
    assert preset.h2d_gbps == pytest.approx(PRESETS["h100"].h2d_gbps, rel=1e-3)
    with device_sim.activate(out / f"{stem}-preset.json", sanitize=False) as simulated:
        assert simulated.preset == preset
    text = md.read_text()
    for heading in ("## Environment", "## Device tests (`-m cuda`)", "## Calibrated preset", "## Measured and modeled",
                    "## Host time per step", "## Quick table (measured)", "## End to end (measured)",
                    "## Layouts (measured)"):
        assert heading in text


def test_dry_run_models_what_it_measured(dry_run):
    done, out = dry_run
    (json_path,) = [p for p in out.glob("*-verify.json")]
    report = json.loads(json_path.read_text())
    measured, modeled = report["calibration"], report["modeled_calibration"]
    # Calibrated on the simulator and modeled by it: the single-direction copies and kernels come back exactly.
    for m, d in zip(measured["copies"], modeled["copies"]):
        assert d["h2d_gbps"] == pytest.approx(m["h2d_gbps"], rel=1e-3)
        assert d["d2h_gbps"] == pytest.approx(m["d2h_gbps"], rel=1e-3)
    assert [p["ms"] for p in modeled["adamw"]] == pytest.approx([p["ms"] for p in measured["adamw"]], rel=1e-3)
    # Every benchmark part has its modeled counterpart.
    assert report["modeled"]["sizes"] and report["modeled"]["layouts"] and report["modeled"]["e2e"]
    e2e, e2e_modeled = report["measured"]["e2e"][0], report["modeled"]["e2e"][0]
    assert e2e["losses_equal"] is True and e2e_modeled["losses_equal"] is True
    assert e2e_modeled["train_on_ms"] == pytest.approx(e2e["train_on_ms"], rel=0.02)
    assert report["measured"]["host"][0]["fraction"] > 0


def test_bench_runs_on_the_calibrated_preset_file(dry_run):
    _, out = dry_run
    (preset_path,) = out.glob("*-preset.json")
    preset = load_preset(preset_path)
    bench_out = out / "bench"
    done = cli_zygote.run(["-m", "swapopt.bench", "--sim", str(preset_path), "--sizes", "0.0001",
                           "--strategies", "swapopt", "--times", "4", "--slots", "3", "--e2e", "none",
                           "--no-progress", "--out", str(bench_out)], cwd=ROOT, env=_env(), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    (json_path,) = bench_out.glob("*.json")
    assert json_path.name.startswith(f"sim-{preset.name}-")
    assert json.loads(json_path.read_text())["preset"]["calibrated"] == preset.calibrated


def test_bench_refuses_a_missing_preset_file(tmp_path):
    done = cli_zygote.run(["-m", "swapopt.bench", "--sim", str(tmp_path / "nope.json"), "--out",
                           str(tmp_path / "out")], cwd=ROOT, env=_env(), timeout=300)
    assert done.returncode == 2
    assert done.stdout.startswith("error: simulator preset file") and "does not exist" in done.stdout
    assert not (tmp_path / "out").exists()


# ---- --quick: each phase under its own time limit; --model: the modeled side later --------------------------


def test_a_phase_past_its_limit_is_stopped_and_the_next_one_runs():
    import time

    from rich.progress import Progress

    from swapopt.verify.run import _Phases

    phases = _Phases(Progress(disable=True))
    ran = []
    with phases.phase("slow", limit_s=0.3):
        while True:  # stands for a phase that would run on
            time.sleep(0.01)
    with phases.phase("next", limit_s=5):
        ran.append("next")
    slow, after = phases.done
    assert slow.status.startswith("stopped: past its 0 s limit") and slow.limit_s == 0.3
    assert 0.3 <= slow.seconds < 3
    assert ran == ["next"] and after.status == "ok"
    assert phases.failed == [slow]  # a stopped phase makes the exit code 1


def test_a_stopped_benchmark_phase_keeps_what_it_finished_and_leaves_the_simulator_usable():
    import torch
    from rich.progress import Progress

    import device
    from swapopt.verify.bench_runs import BenchParts, run_sizes
    from swapopt.verify.plan import QUICK_DRY_PLAN
    from swapopt.verify.run import _Phases

    plan = QUICK_DRY_PLAN.model_copy(update={"strategies": ["resident", "swapopt"]})
    phases, parts = _Phases(Progress(disable=True)), BenchParts()
    with device_sim.activate("h100", sanitize=True):
        with phases.phase("quick table", limit_s=0.2):
            run_sizes(plan, [0.0002, 0.0002, 0.0002], parts)  # far more than 0.2 s of work
        assert phases.done[0].status.startswith("stopped")
        assert len(parts.sizes) < 3
        # the device still works after the stop
        x = torch.ones(4, device=device.torch_device())
        assert float((x + 1).sum()) == 8.0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("verify-quick")
    # The device tests' collection is covered by the full dry run above.
    done = cli_zygote.run(["-m", "swapopt.verify", "--quick", "--dry-run", "--skip-device-tests",
                           "--no-progress", "--out", str(out)], cwd=ROOT, env=_env(), timeout=900)
    return done, out


def test_quick_dry_run_runs_every_phase_under_its_limit_and_writes_few_files(quick_run):
    done, out = quick_run
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    (json_path,) = out.glob("sim-h100-*-verify-quick.json")
    assert {json_path.stem + s for s in (".md", "-copies.png", "-preset.json")} <= set(files)
    report = json.loads(json_path.read_text())
    assert report["quick"] is True and report["plan"]["limits"]
    by_name = {p["name"]: p for p in report["phases"]}
    for name in ("calibration", "quick table", "layouts", "end to end"):
        assert by_name[name]["status"] == "ok" and by_name[name]["limit_s"] > 0, by_name[name]
    assert by_name["device tests"]["status"] == "skipped: --skip-device-tests"
    assert by_name["modeled on the calibrated simulator"]["status"].startswith("skipped: left to a CPU machine")
    assert by_name["capacity"]["status"] in ("ok",) or by_name["capacity"]["status"].startswith("skipped: ")
    assert report["modeled_calibration"] is None and report["peers"] == []
    # the quick table on the simulator has a torchao row that stepped, with its proof
    (size,) = report["measured"]["sizes"]
    rows = {r["kind"]: r for r in size["rows"]}
    assert "torchao-offload" in rows
    for r in rows.values():
        assert r["error"] is None and r["step_ms"] > 0, r
        assert r["params_changed"] == r["params_total"] and r["h2d_bytes"] >= r["need_h2d_bytes"]
    assert report["measured"]["layouts"] and report["measured"]["e2e"]
    assert "python -m swapopt.verify --model" in (out / f"{json_path.stem}.md").read_text()


def test_model_adds_the_modeled_side_to_a_quick_report(quick_run, tmp_path):
    done, quick_out = quick_run
    assert done.returncode == 0
    # --model rewrites the report in place: work on a copy, the quick run's own test reads the original.
    out = tmp_path / "report"
    shutil.copytree(quick_out, out)
    (json_path,) = out.glob("sim-h100-*-verify-quick.json")
    before = set(p.name for p in out.iterdir())
    run = cli_zygote.run(["-m", "swapopt.verify", "--model", str(json_path)], cwd=ROOT, env=_env(), timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "with the preset this report's calibration wrote" in run.stdout
    assert set(p.name for p in out.iterdir()) == before  # the same report, rewritten in place
    report = json.loads(json_path.read_text())
    assert report["modeled_calibration"] and report["modeled"]["sizes"] and report["modeled"]["layouts"]
    phase = report["phases"][-1]
    assert phase["name"] == "modeled on the calibrated simulator" and phase["status"] == "ok"
    assert any(n.startswith("modeled side: added") for n in report["notes"])
    from swapopt.verify.report import VerifyReport

    rows = [r for r in VerifyReport.model_validate(report).comparisons() if r.ratio is not None]
    # calibrated on the simulator, modeled by it: single-direction copies read back exactly
    copies = [r for r in rows if r.section == "copies" and "both" not in r.item]
    assert copies and all(r.ratio == pytest.approx(1.0, rel=1e-3) for r in copies)
    assert any(r.section.startswith("quick table") for r in rows)
    text = (out / f"{json_path.stem}.md").read_text()
    assert "## Measured and modeled" in text and "Modeled: not run yet" not in text


def test_model_of_the_committed_h100_report_uses_its_calibration_and_plan(tmp_path):
    from swapopt.verify.report import VerifyReport
    from swapopt.verify.run import modeled_preset, plan_of

    path = ROOT / "bench" / "results" / "cuda-h100-2026-11-26-verify-b.json"
    report = VerifyReport.model_validate_json(path.read_text())
    assert report.label.startswith("cuda-NVIDIA-H100") and not report.dry_run
    plan = plan_of(report)  # written before plans were stored: rebuilt from what the report shows
    assert plan.calibration.copy_sizes == [p.nbytes for p in report.calibration.copies]
    assert plan.layouts == ["llama7b", "moe", "fsdp256", "tiny10k"] and not plan.model_e2e
    preset_path, how = modeled_preset(report, path, None, tmp_path)
    preset = load_preset(preset_path)
    assert "calibration wrote" in how and preset.name == "cuda-NVIDIA-H100-80GB-HBM3-2026-11-26"
    assert preset.h2d_gbps == pytest.approx(report.calibrated_preset["h2d_gbps"])
    _, how = modeled_preset(report, path, "h100", tmp_path)
    assert "--preset" in how


def test_model_refuses_a_report_without_calibration(tmp_path):
    from swapopt.verify.__main__ import main as verify_main

    path = ROOT / "bench" / "results" / "cuda-h100-2026-11-26-verify-b.json"
    data = json.loads(path.read_text())
    data["calibration"] = None
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps(data))
    assert verify_main(["--model", str(bad)]) == 2
    assert verify_main(["--model", str(tmp_path / "missing.json")]) == 2
