"""The simulator-overhead micro-benchmark runs end to end and writes its JSON and Markdown (no timing checked)."""

from __future__ import annotations

import json

import pytest

from device import sim
from swapopt.bench.simops import ITERS, main


def test_simops_writes_json_and_markdown(clean_device_env, tmp_path):
    if sim.active() is not None:  # the process-wide simulator (SWAPOPT_DEVICE=sim) would make the plain rows simulated
        pytest.skip("needs no simulator active at start")
    json_path, md_path = main(["--iters", "2", "--out", str(tmp_path / "sub" / "ovh"), "--label", "test run"])
    assert (json_path, md_path) == (tmp_path / "sub" / "ovh.json", tmp_path / "sub" / "ovh.md")
    report = json.loads(json_path.read_text())
    assert {"device", "torch", "date", "label", "commit", "machine", "repeats", "sim_torch_device", "rows"} <= set(report)
    assert {"nproc", "cpu"} <= set(report["machine"])
    assert [r["loop"] for r in report["rows"]] == list(ITERS)
    for row in report["rows"]:
        assert row["iters"] == 2 and row["aten_ops_per_iter"] >= 1
        assert len(row["plain_repeats_us"]) == len(row["sim_repeats_us"]) == report["repeats"]
        for key in ("plain_us", "sim_us", "plain_ops_s", "sim_ops_s", "sim_us_per_aten_op", "overhead"):
            assert row[key] > 0
    md = md_path.read_text()
    assert "test run" in md and "| loop |" in md and all(f"| {loop}:" in md for loop in ITERS)


def test_compare_table_gives_each_checkouts_median_and_ratio():
    from swapopt.bench.simops import compare_table

    cmp = {"checkouts": {"before": "/b", "after": "/a"}, "rows": [
        {"loop": "mlp", "before": {"median": 60.0, "least": 58.0}, "after": {"median": 45.0, "least": 44.0}},
    ]}
    lines = compare_table(cmp).splitlines()
    assert lines[0] == "| loop | before (us/op) | after (us/op) | after / before |"
    assert lines[2] == "| mlp | 60.0 (58.0) | 45.0 (44.0) | 0.75 |"
