"""What a verify run measures, on a device and in a dry run: sizes, repeats, layouts, configs, time limits.

The device plan is sized to finish within 30 minutes on one GPU or NPU (every phase's share is in the
comments); the dry plan runs the same code paths at sizes the simulator finishes in under a minute on
two CPU cores, so CI keeps the command working. The quick plans (``--quick``) fit a short slot on a shared
device: device tests, calibration, quick table, layouts and one end-to-end config, each phase stopped at its
own time limit, within QUICK_BUDGET_S including start-up; the modeled side is left to a CPU machine
(``--model REPORT.json``).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from swapopt.bench.layout_run import HOST_REPEATS
from swapopt.bench.strategies import ALL_STRATEGIES

MB = 1 << 20


class CalibrationPlan(BaseModel):
    """The probes of `calibrate.measure`."""

    copy_sizes: list[int]  # bytes per copy
    copy_target_bytes: int  # each (size, direction) run copies about this much: repeats = target / size
    adamw_numels: list[int]  # params of the fused AdamW step probe (one tensor each)
    matmul_n: int  # n x n x n bf16 matmul
    matmul_repeats: int
    launches: int  # back-to-back tiny kernels timed by events
    # params of the host-cost probe (a resident fused AdamW step over small params): enough that their per-tensor
    # cost dwarfs the step's fixed launches
    host_probe_tensors: int = 1000
    repeats: int  # timed repeats of each AdamW and matmul probe (median)


class VerifyPlan(BaseModel):
    dry_run: bool
    calibration: CalibrationPlan
    # The modeled side runs the calibration probes on the simulator: its ops are real CPU work, so the
    # large copies are capped (rates are reported per size, so the capped sizes still line up).
    model_copy_max_bytes: int
    model_adamw_max_numel: int
    model_matmul_n: int  # the matmul's size on the simulator: its rate, not its time, is compared
    bench_sizes: list[float] | None  # billions of params; None: the largest up to 1B that fits (as the bench)
    strategies: list[str] | None = None  # quick-table strategies; None: BenchConfig's default (all but the 8-bit rows)
    bench_times: list[int] = Field(default_factory=lambda: [16, 64])
    bench_slots: list[int] = Field(default_factory=lambda: [3])
    reference_times: list[int] = Field(default_factory=lambda: [16])
    layouts: list[str] = Field(default_factory=lambda: ["llama7b", "moe", "fsdp256", "tiny10k"])
    layout_times: list[int] = Field(default_factory=lambda: [16, 64])
    layout_max_numel: int | None = None  # None: what fits the device (the bench's default)
    # Each layout chunk count also with the flat chunk update on (swapopt.flat), in rows of its own: which of the
    # two costs the host less per tensor is a device's answer, not the simulator's (Note [flat chunk update]).
    layout_flat: bool = False
    layout_host_repeats: int = HOST_REPEATS  # counted steps per layout row, whose median gives its host figures
    # Only the first this many tensors of each layout (None: all): the dry run keeps a layout's shapes but not its
    # hundreds of tensors, each of which costs the simulator host time per op.
    layout_tensor_limit: int | None = None
    e2e: list[str] = Field(default_factory=list)  # engine config specs ('name:key=value:...')
    e2e_steps: int = 5  # one synchronized window (swapopt.bench.e2e): at least 5
    e2e_warmup: int = 2
    # The modeled side of the bench rows runs on the simulator at no more than these sizes; larger measured
    # rows are compared against a smaller modeled run scaled by state bytes (said in the row).
    model_bench_size: float = 0.1
    model_layout_max_numel: int = 16_000_000
    model_e2e: bool = False  # the simulator runs a forward as real CPU work: minutes per llm_1b step
    peer_steps: int = 5
    device_tests_timeout_s: int = 600
    # Seconds each phase may run before it is stopped (and reported so; the later phases still run), by phase:
    # "device tests", "calibration", "quick table", "layouts", "end to end", "capacity". None: no limit.
    limits: dict[str, float] | None = None


DEVICE_PLAN = VerifyPlan(
    dry_run=False,
    calibration=CalibrationPlan(
        copy_sizes=[1 * MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB, 1024 * MB],
        copy_target_bytes=4 << 30,  # about 80 ms per run at 55 GB/s: 4 runs x 6 sizes, a few seconds
        adamw_numels=[1_000_000, 10_000_000, 100_000_000],
        matmul_n=8192,
        matmul_repeats=10,
        launches=2000,
        repeats=5,
    ),
    model_copy_max_bytes=1024 * MB,
    model_adamw_max_numel=20_000_000,
    # Compute-bound on the simulated device at any calibrated rate under ~1,500 TFLOP/s: a quarter second of CPU where
    # the host has AVX-512, about a minute where it has AVX2 alone (torch's CPU bf16 GEMM, which the simulator runs).
    model_matmul_n=2048,
    bench_sizes=None,
    # every strategy, torchao's 8-bit rows included (Note [low-bit rows] in swapopt.bench.strategies); the modeled
    # side leaves those out above their simulator size (swapopt.verify.bench_runs.bench_config)
    strategies=list(ALL_STRATEGIES),
    # llm_1b at full width (its own config); prefetch on so the overlap variant runs as it would train.
    e2e=["llm_100m", "llm_1b:optim.prefetch=true"],
    layout_flat=True,
)

DRY_PLAN = VerifyPlan(
    dry_run=True,
    calibration=CalibrationPlan(
        copy_sizes=[1 * MB, 4 * MB],
        copy_target_bytes=16 * MB,
        adamw_numels=[100_000, 400_000],
        # Launch-bound on the simulated h100 (the bf16 rate is then kept from the base preset, and the report
        # says so): the simulator runs torch's CPU bf16 GEMM, which on a host without AVX-512 takes about 7 s at
        # 1024^3 (a minute at 2048^3; a 2-core AMD EPYC with AVX2 alone), 1 s at 512^3.
        matmul_n=512,
        matmul_repeats=1,
        launches=200,
        host_probe_tensors=200,
        repeats=1,  # the simulator's times are deterministic
    ),
    model_copy_max_bytes=4 * MB,
    model_adamw_max_numel=400_000,
    model_matmul_n=512,
    bench_sizes=[0.0002],
    strategies=["resident", "swapopt"],
    bench_times=[4],
    reference_times=[4],
    layouts=["llama7b"],
    layout_times=[4],
    layout_max_numel=200_000,
    layout_tensor_limit=12,
    layout_flat=True,
    # Two counted steps: a dry run checks that the host figures are made, not how steady they are. On the simulator
    # this machine's reference Python is timed between counted steps (least of 3 runs), which at the dry sizes
    # costs more than the steps.
    layout_host_repeats=2,
    e2e=["tiny:train.batch=1:train.seq_len=16:model.dim=32:model.n_layers=1"],
    e2e_steps=5,
    e2e_warmup=1,
    model_bench_size=0.0002,
    model_layout_max_numel=200_000,
    model_e2e=True,
    peer_steps=1,
    device_tests_timeout_s=300,
)

# Seconds from the start of the process to the last file written, on one H100 (device start-up, the interpreter
# and torch's import before verify starts included, QUICK_STARTUP_S of it).
QUICK_BUDGET_S = 465
QUICK_STARTUP_S = 30
# Each phase's limit. Measured on one H100 (2026-11-26, at commit e190371): device tests 13 s, calibration 6 s,
# quick table at 0.5B most of a minute with pinning, layouts at 300M params and two configs end to end 158 s
# together; the limits below are that with room, and sum with start-up to QUICK_BUDGET_S. The quick table's has 60 s
# more for torchao's two 8-bit rows (not yet measured on a device: their first step compiles torchao's update once per
# param shape, the swapped row reusing the resident row's compiled code), the layouts' 45 s more for their flat-update
# rows (a swapopt row each, beside each direct-step row). On one H100 (2026-11-27, at 1d80803) the quick plan took:
# device tests 12 s, calibration 5 s, quick table 100 s, layouts 63 s, end to end 11 s; 191 s in all.
QUICK_LIMITS = {"device tests": 45.0, "calibration": 30.0, "quick table": 150.0, "layouts": 120.0,
                "end to end": 60.0, "capacity": 30.0}

QUICK_DEVICE_PLAN = DEVICE_PLAN.model_copy(update={
    "bench_sizes": [0.5],
    "reference_times": [16],
    # layouts cut to 100M params (tensor counts kept, swapopt.bench.layout_run): the moe layout's 3,299 tensors
    # are what it is about
    "layout_max_numel": 100_000_000,
    "e2e": ["llm_100m:optim.prefetch=true"],
    "e2e_warmup": 2,
    "limits": QUICK_LIMITS,
    "device_tests_timeout_s": int(QUICK_LIMITS["device tests"]),
})

QUICK_DRY_PLAN = DRY_PLAN.model_copy(update={
    # the quick table with every strategy the simulator runs, torchao's included
    "strategies": ["resident", "swapopt", "serial", "one-in-flight", "whole", "host-step", "torchao-offload"],
    # two CPU cores in CI: generous, so only a broken phase reaches them
    "limits": {name: 240.0 for name in QUICK_LIMITS},
})
