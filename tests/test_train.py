"""The main job's CLI: a short run on the simulator, bad configs, and bitwise resume under torchrun (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cli_zygote
from swapopt.train import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.py")
SMALL = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=16", "train.batch=2",
         "train.seq_len=16", "train.compare_resident=0", "lr.warmup_steps=1"]


def losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_main_job_short_run_reports_swap_and_resident_peaks(clean_device_env, tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    rc = main([TINY, "--cfg-options", "train.steps=3", "train.compare_resident=2", "train.log_interval=1",
               f"train.metrics_path={metrics}"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "no accelerator found: running on the simulated h100 device" in out
    assert "step     3  loss" in out and "swap in" in out and "(modeled)" in out
    assert "  losses of the first 2 steps bitwise equal to the resident baseline: True" in out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["swap_bytes"] > 0 and r["mem_peak_bytes"] > 0 for r in rows)
    swap_peak = float(out.split("peak device memory, swap_optimizer=True: ")[1].split(" MiB")[0])
    resident_peak = float(out.split("(swap_optimizer=False), 2 steps, peak device memory: ")[1].split(" MiB")[0])
    assert swap_peak < resident_peak


def test_master_weights_job_compares_with_the_bf16_recipe_with_masters_on_the_device(clean_device_env, capsys):
    # tiny.py's width: in a narrower model the staging, not the states, decides the peak. Six steps: a step period
    # is taken over the five after the first.
    rc = main([str(ROOT / "configs" / "tiny_masters.py"), "--cfg-options", "train.batch=2", "train.seq_len=16",
               "lr.warmup_steps=1", "train.steps=6", "train.compare_resident=6"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    masters = float(out.split("master_weights=True (bfloat16 params): ")[1].split(" MiB")[0])
    label = "resident recipe (bfloat16 params, fp32 masters and states on the device, swap_optimizer=False)"
    recipe = float(out.split(f"{label}, 6 steps, peak device memory: ")[1].split(" MiB")[0])
    assert masters < recipe
    assert "fp32 params" not in out  # no fp32 job as the baseline
    # the recipe it reproduces: the same numbers, bitwise
    assert "losses of the first 6 steps bitwise equal to the resident recipe: True" in out
    periods = [float(line.split("step period: ")[1].split(" ms")[0]) for line in out.splitlines()
               if "step period: " in line and "(modeled, steps 2-6:" in line]
    assert len(periods) == 2 and all(p > 0 for p in periods)
    ratio = float(out.split("this job's step period is ")[1].split("x the resident recipe's")[0])
    # The periods are printed to 0.1 ms and the ratio to 0.01, each from the unrounded periods: the ratio must lie
    # within what the printed periods allow, no wider.
    half = 0.05
    assert (periods[0] - half) / (periods[1] + half) - 0.005 <= ratio <= (periods[0] + half) / (periods[1] - half) + 0.005


def test_device_masters_is_the_unswapped_recipe_only():
    from swapopt.engine.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="device_masters"):
        load_config(TINY, [*SMALL, "optim.device_masters=true", "optim.swap_optimizer=true"])
    cfg = load_config(str(ROOT / "configs" / "tiny_masters.py"),
                      [*SMALL, "optim.swap_optimizer=false", "optim.master_weights=false", "optim.device_masters=true"])
    assert cfg.optim.device_masters and cfg.model.dtype == "bfloat16"


def _summary(opts: list[str]) -> tuple[dict, list[dict]]:
    import io

    from rich.console import Console

    from swapopt.engine.config import load_config
    from swapopt.engine.preflight import plan_device
    from swapopt.train import device_context, run

    cfg = load_config(TINY, [*SMALL, *opts])
    with device_context(cfg, plan_device(cfg)):
        return run(cfg, Console(file=io.StringIO()), modeled=True), []


@pytest.mark.parametrize("steps", [5, 6])
def test_step_period_needs_a_synchronized_window_of_five_steps_after_the_first(clean_device_env, tmp_path, steps):
    metrics = tmp_path / "m.jsonl"
    summary, _ = _summary([f"train.steps={steps}", "optim.overlap_forward=true",
                           "train.log_interval=100", f"train.metrics_path={metrics}"])
    if steps == 5:  # four steps after the first: too few for a period
        assert "period_ms" not in summary
        return
    assert summary["period_steps"] == (2, 6)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    # with overlap each step's own events end before its update does: the window counts the updates too
    window = [r["step_ms"] for r in rows[1:]]
    assert summary["period_ms"] >= sum(window) / len(window)


@pytest.mark.parametrize("options, key", [
    (["optim.swap_optimizr=true"], "optim.swap_optimizr"),
    (["train.steps=three"], "train.steps"),
    (["optim.type=LBFGS"], "optim.type"),
])
def test_bad_config_fails_at_start_naming_the_key_and_writes_nothing(clean_device_env, tmp_path, capsys,
                                                                     options, key):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "keep.txt").write_text("untouched")
    rc = main([TINY, "--cfg-options", *SMALL, f"train.checkpoint_dir={ckpt}", "train.checkpoint_interval=1",
               *options])
    out = capsys.readouterr().out
    assert rc == 2
    assert key in out and "error:" in out
    assert [p.name for p in ckpt.iterdir()] == ["keep.txt"]


def test_missing_resume_dir_fails_at_start(clean_device_env, tmp_path, capsys):
    assert main([TINY, "--resume", str(tmp_path / "nowhere")]) == 2
    assert "no checkpoint in" in capsys.readouterr().out


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SWAPOPT_DEVICE"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "swapopt.train", TINY, *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # Under torchrun the result lines come from rank 0 only, and every log line names its rank.
    assert done.stdout.count("done: ") == 1
    logs = [line for line in done.stderr.splitlines() if " | INFO    | " in line]
    assert logs and all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in logs), done.stderr
    return done


@pytest.mark.slow
def test_torchrun_two_ranks_resume_continues_bitwise(tmp_path):
    straight, resumed, ckpt = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    # Two torchrun jobs (each starts three interpreters): 4 steps that save a checkpoint after step 2 on the way, and
    # one resumed from that checkpoint, whose steps 3 and 4 must be the first job's bit for bit.
    run = _torchrun("--cfg-options", *SMALL, "train.steps=4", f"train.checkpoint_dir={ckpt}",
                    "train.checkpoint_interval=2", f"train.metrics_path={straight}")
    assert "world size 2" in run.stdout and "simulated" in run.stdout
    # Rank r trains on device r (torchrun's LOCAL_RANK), not every rank on the first device it touched.
    placed = sorted(line.split("] ", 1)[0] + "] " + line.rsplit("params on ", 1)[1]
                    for line in run.stderr.splitlines() if ": params on " in line)
    assert placed == ["[rank 0] sim:0", "[rank 1] sim:1"], run.stderr
    assert (ckpt / "step_00000002" / "trainer.json").is_file()
    _torchrun("--resume", str(ckpt / "step_00000002"), "--cfg-options", *SMALL, "train.steps=4",
              f"train.metrics_path={resumed}")
    assert len(losses(straight)) == 4
    assert losses(resumed) == losses(straight)[2:]


def test_resident_baseline_runs_out_of_memory_where_swapping_fits(clean_device_env, capsys):
    # tiny.py peaks at about 12.5 MiB with swapping and 16.1 MiB resident on the simulated device (whose
    # attention takes torch's math SDPA path, as a backend without fused kernels does).
    rc = main([TINY, "--cfg-options", "train.steps=2", "train.compare_resident=2", "train.sim_capacity_mb=14"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "done: 2 steps" in out
    assert "resident baseline (swap_optimizer=False): out of device memory" in out


def test_llm_1b_that_cannot_fit_host_ram_is_refused_before_anything_is_built(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SWAPOPT_DEVICE"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    argv = ["-m", "swapopt.train", str(ROOT / "configs" / "llm_1b.py"), "--cfg-options",
            "model.dim=8192", "model.n_heads=64", "model.n_layers=160"]  # 65B params: 1 TB of host RAM
    done = cli_zygote.run(argv, cwd=tmp_path, env=env, timeout=300)  # a start-up check: forked (tests/cli_zygote.py)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: this job needs about ")
    assert "train.host_ram_check=false" in lines[0]
    assert list(tmp_path.iterdir()) == []  # work_dirs/llm_1b not created


def test_host_ram_check_key_overrides_the_refusal():
    from swapopt.engine.config import ConfigError, load_config
    from swapopt.engine.preflight import Estimate, check_fits

    est = Estimate(n_params=10**9, host_bytes=20 * 2**30, available_bytes=8 * 2**30, step_flops=1e12, cpu_flops=1e10)
    with pytest.raises(ConfigError, match="host_ram_check"):
        check_fits(load_config(TINY), est)
    check_fits(load_config(TINY, ["train.host_ram_check=false"]), est)
    check_fits(load_config(TINY), est.model_copy(update={"available_bytes": 32 * 2**30}))


def test_estimate_counts_params_exactly_and_scales_with_the_job():
    from swapopt.engine.config import load_config
    from swapopt.engine.model import build_model
    from swapopt.engine.preflight import count_params, estimate

    cfg = load_config(TINY)
    n = count_params(cfg)
    assert n == sum(p.numel() for p in build_model(cfg.model, 0).parameters())
    small, big = estimate(cfg, n), estimate(load_config(TINY, ["train.batch=32"]), n)
    assert small.host_bytes >= 16 * n and big.host_bytes > small.host_bytes
    assert big.step_flops == pytest.approx(4 * small.step_flops) and small.cpu_flops > 0


def test_numpy_is_a_dependency_and_outputs_are_ignored():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps)
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "work_dirs/" in ignored and "*.jsonl" in ignored


def test_progress_bar_shows_an_eta(clean_device_env):
    import io

    from rich.console import Console

    from swapopt.engine.config import load_config
    from swapopt.engine.preflight import plan_device
    from swapopt.train import device_context, run

    cfg = load_config(TINY, [*SMALL, "train.steps=3"])
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=150)
    with device_context(cfg, plan_device(cfg)):
        summary = run(cfg, console, modeled=True)
    assert len(summary["losses"]) == 3
    assert "eta" in buffer.getvalue()


@pytest.mark.parametrize("at_step", [1, 3])
def test_ctrl_c_held_in_the_optimizer_step_still_writes_that_steps_metrics_line(clean_device_env, tmp_path, at_step):
    # Ctrl-C during the optimizer step is held and raised when that critical section ends. The step is then
    # counted and checkpointed (save_on_interrupt), so its metrics line must be in the file too.
    import contextlib
    import io

    from rich.console import Console

    from swapopt.engine.config import load_config
    from swapopt.engine.preflight import plan_device
    from swapopt.train import Interrupted, device_context, run

    class HeldInterrupt:
        torn = False
        calls = 0

        @contextlib.contextmanager
        def critical(self):
            self.calls += 1
            yield
            # Calls alternate: the engine's optimizer step, then the loop's bookkeeping. The engine's section of
            # step ``at_step`` ends with the interrupt.
            if self.calls == 2 * at_step - 1:
                raise KeyboardInterrupt

        def acknowledge(self):
            pass

    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    cfg = load_config(TINY, [*SMALL, "train.steps=10", f"train.metrics_path={metrics}", f"train.checkpoint_dir={ckpt}",
                             "train.checkpoint_interval=1000", "train.save_on_interrupt=true"])
    guard = HeldInterrupt()
    with device_context(cfg, plan_device(cfg)), pytest.raises(Interrupted) as stop:
        run(cfg, Console(file=io.StringIO()), modeled=True, guard=guard)
    assert stop.value.step == at_step
    assert stop.value.checkpoint == ckpt / f"step_{at_step:08d}"
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, at_step + 1))


def test_metrics_lines_are_written_in_batches_each_step_once_and_up_to_every_checkpoint(clean_device_env, tmp_path,
                                                                                       monkeypatch):
    # Reading a step's metrics waits for the device, so the loop reads them at the log interval; a checkpoint
    # still finds the line of every step it holds in the file, and nothing after it.
    import io

    from rich.console import Console

    from swapopt.engine.config import load_config
    from swapopt.engine.preflight import plan_device
    from swapopt.engine.trainer import TrainEngine
    from swapopt.train import device_context, run

    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    seen: list[tuple[int, list[int]]] = []
    save = TrainEngine.save_checkpoint

    def recording_save(engine, root=None):
        seen.append((engine.step, [json.loads(line)["step"] for line in metrics.read_text().splitlines()]))
        return save(engine, root)

    monkeypatch.setattr(TrainEngine, "save_checkpoint", recording_save)
    cfg = load_config(TINY, [*SMALL, "train.steps=7", "train.log_interval=3", f"train.metrics_path={metrics}",
                             f"train.checkpoint_dir={ckpt}", "train.checkpoint_interval=5"])
    with device_context(cfg, plan_device(cfg)):
        summary = run(cfg, Console(file=io.StringIO()), modeled=True)
    assert seen == [(5, [1, 2, 3, 4, 5]), (7, list(range(1, 8)))]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert summary["losses"] == [r["loss"] for r in rows]
    assert all(r["forward_ms"] > 0 and r["swap_ms"] > 0 for r in rows)


@pytest.mark.parametrize("opts", [["train.gradient_checkpointing=true"],
                                  ["train.gradient_checkpointing=false", "optim.swap_optimizer=false"]])
def test_start_up_estimate_counts_the_ops_a_step_runs(sim, opts):
    # On the simulator a small model's step costs its aten ops times the host cost of one op, far more than
    # its FLOPs: the estimate's op count must be that of a real step (counts are deterministic).
    from swapopt import internals
    from swapopt.engine.config import load_config
    from swapopt.engine.preflight import count_step_ops
    from swapopt.engine.trainer import TrainEngine

    cfg = load_config(TINY, opts + ["train.compare_resident=0"])
    engine = TrainEngine(cfg)
    engine.train_step()  # the first step creates the states
    with internals.counting_ops() as ran:
        engine.train_step()
    estimated = count_step_ops(cfg)
    assert 0.75 * ran[0] <= estimated <= 1.1 * ran[0], (estimated, ran[0])
