"""Real peers on the simulator (swapopt.bench.peers): one row per peer, swapopt's row modeled and below the
resident baseline's device memory, peers that cannot run here reported with their reason, never a crash."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import simdevice
import torch

import device
from swapopt.bench import peers
from swapopt.bench.peers import PEERS, PeerResult, compare

pytestmark = pytest.mark.filterwarnings("ignore")  # peers' packages warn at import (torchao's CUDA kernels, ...)


@pytest.fixture(scope="module")
def rows():
    """One dry-run comparison on a simulated H100 (sanitizer on), shared by the tests below."""
    with simdevice.activate("h100"):
        return {r.name: r for r in compare(steps=1, dry_run=True)}


def test_a_row_per_peer(rows):
    assert list(rows) == list(PEERS)
    for row in rows.values():
        assert isinstance(row, PeerResult)
        if row.failed:  # the peer itself raised in this configuration: its error, no figure
            assert row.available and row.reason and row.step_ms is None
        elif row.available:
            assert row.reason is None
            assert row.step_ms is not None and row.step_ms > 0
            assert row.device_peak_bytes is not None and row.device_peak_bytes > 0
            assert "DOES NOT TRAIN" not in (row.note or ""), row.note
        else:
            assert row.reason, f"{row.name} is unavailable without a reason"
            assert row.step_ms is None and row.device_peak_bytes is None


def test_swapopt_is_modeled_and_below_resident_memory(rows):
    resident, swap = rows["resident"], rows["swapopt"]
    assert resident.available, resident.reason
    assert swap.available, swap.reason
    # The simulator's modeled time: a finite, positive figure from its events (no wall clock here).
    assert 0 < swap.step_ms < 1e4
    assert swap.device_peak_bytes < resident.device_peak_bytes
    assert "bitwise equal to resident AdamW" in swap.note


def test_torchao_offload_runs_on_the_simulator(rows):
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao not installed (pip install torchao)")
    row = rows["torchao-cpu-offload"]
    assert row.available, row.reason
    # States and master params live on the host: device memory below the resident baseline's.
    assert row.device_peak_bytes < rows["resident"].device_peak_bytes
    assert "trains: held-out loss" in row.note
    assert "host CPU Adam step" in row.note  # how its host work is counted is said


def test_missing_packages_are_rows_with_the_import_error(monkeypatch):
    for package in ("torchao", "deepspeed", "xtuner"):
        # `import package...` raises ImportError, also where an earlier test imported it already.
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")] + [package]:
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delenv("SWAPOPT_XTUNER_SRC", raising=False)
    size = peers.DRY_RUN
    start = peers._initial_params(size)
    with simdevice.activate("h100"):
        got = {n: peers.run_peer(n, size, 1, build=False, baseline=None, start=start)[0]
               for n in ("torchao-cpu-offload", "deepspeed-cpu-adam", "xtuner-swapadamw")}
    for name, row in got.items():
        assert not row.available, name
        assert "ImportError" in row.reason or "ModuleNotFoundError" in row.reason, row.reason
    assert "pip install torchao" in got["torchao-cpu-offload"].reason
    assert "pip install deepspeed" in got["deepspeed-cpu-adam"].reason
    assert "SWAPOPT_XTUNER_SRC" in got["xtuner-swapadamw"].reason


def test_a_peer_failing_mid_run_is_a_row_not_a_crash(monkeypatch):
    def broken(params, size):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(peers, "_swapopt", broken)
    size = peers.DRY_RUN
    with simdevice.activate("h100"):
        row, run = peers.run_peer("swapopt", size, 1, build=False, baseline=None, start=peers._initial_params(size))
    # the peer was there and failed: its failure, with its error, not "unavailable"
    assert run is None and row.available and row.failed
    assert row.reason.startswith("RuntimeError: kernel exploded")


def test_no_accelerator_gives_rows_with_the_reason(clean_device_env):
    if device.get_device() != "cpu":
        pytest.skip("an accelerator (or the process-wide simulator) is present")
    got = compare(steps=1, dry_run=True)  # no simulator active, no GPU: the plain CPU
    assert [r.name for r in got] == list(PEERS)
    assert all(not r.available and "no accelerator" in r.reason for r in got)


def test_steps_must_be_positive():
    with pytest.raises(ValueError, match="steps"):
        compare(steps=0, dry_run=True)


def test_cli_writes_md_and_json_named_by_device_and_date(clean_device_env, monkeypatch, tmp_path, capsys):
    canned = [
        PeerResult(name="resident", available=True, step_ms=2.0, device_peak_bytes=4 << 20, note="baseline"),
        PeerResult(name="swapopt", available=True, step_ms=2.5, device_peak_bytes=3 << 20, note="bitwise"),
        PeerResult(name="deepspeed-cpu-adam", available=False, reason="ImportError: no deepspeed"),
    ]
    monkeypatch.setattr(peers, "compare", lambda *, steps, dry_run: canned)
    assert peers.main(["--dry-run", "--steps", "1", "--out", str(tmp_path)]) == 0
    (js,) = tmp_path.glob("sim-h100-*-peers.json")
    (md,) = tmp_path.glob("sim-h100-*-peers.md")
    data = json.loads(js.read_text())
    assert data["device"] == "sim-h100" and js.name.startswith(f"sim-h100-{data['date'][:10]}-peers")
    assert [PeerResult(**r) for r in data["results"]] == canned
    text = md.read_text()
    assert "| swapopt | yes | 2.500 ms | 1.25x | 3.0 MB | 0.75x |" in text
    assert "unavailable: ImportError: no deepspeed" in text
    # A second run never overwrites the first.
    assert peers.main(["--dry-run", "--steps", "1", "--out", str(tmp_path)]) == 0
    assert len(list(tmp_path.glob("sim-h100-*-peers*.json"))) == 2
    assert "deepspeed-cpu-adam" in capsys.readouterr().out


class _FakeSwapAdamW(torch.optim.AdamW):
    """Stands in for XTuner's SwapAdamW: records its keyword arguments; fails in step() with fused=True, as XTuner's
    does on CUDA (its host step tensors)."""

    seen: list[dict] = []

    def __init__(self, params, swap_optimizer_times: int = 16, **kwargs):
        type(self).seen.append(dict(kwargs))
        self.fails = kwargs.get("fused") is True
        super().__init__(params, **{k: v for k, v in kwargs.items() if k != "fused"})

    def step(self, closure=None):
        if self.fails:
            raise RuntimeError("state_steps is on cpu, different from other tensors on cuda:0")
        return super().step(closure)


def test_xtuner_runs_with_its_defaults_and_its_fused_failure_is_its_own(monkeypatch):
    _FakeSwapAdamW.seen = []
    monkeypatch.setattr(peers, "xtuner_swap_adamw", lambda: (_FakeSwapAdamW, "xtuner (a stand-in)"))
    size = peers.DRY_RUN
    start = peers._initial_params(size)
    with simdevice.activate("h100"):
        default, _ = peers.run_peer("xtuner-swapadamw", size, 1, build=False, baseline=None, start=start)
        fused, run = peers.run_peer("xtuner-swapadamw-fused", size, 1, build=False, baseline=None, start=start)
    first, second = _FakeSwapAdamW.seen
    assert "fused" not in first and "foreach" not in first  # its own defaults: nothing forced
    assert second["fused"] is True
    assert default.available and not default.failed and default.step_ms > 0
    assert "its defaults: fused=None" in default.note
    assert run is None and fused.available and fused.failed and fused.step_ms is None
    assert fused.reason.startswith("RuntimeError: state_steps is on cpu")
    text = peers.markdown([default, fused], {"device": "sim-h100", "date": "2026-11-26", "torch": "x",
                                             "size": size.model_dump(), "params": 1, "steps": 1, "time_note": "",
                                             "host": "h"})
    assert "| xtuner-swapadamw-fused | FAILED |" in text and "failed: RuntimeError: state_steps" in text
