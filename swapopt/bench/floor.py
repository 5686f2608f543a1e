"""The link floor: swapopt's step against the least time its bytes can cross the link, per layout, chunk
count and link sharing rule (Note [link sharing] in device/sim/presets.py).

Two floors per row, both copy latencies aside:
- the cap floor, (H2D bytes + D2H bytes) / the link's cap with both directions busy, and no less than
  either direction alone at its rate: what a link that splits the cap evenly allows;
- the rule floor, the least time under the preset's sharing rule: the cap floor under "first" (taking turns
  at launching first splits the cap), more under a fixed rule, where the favoured direction keeps its full
  rate whenever it is busy and the other gets only the rest meanwhile; under "sized" (the calibrated presets'
  rule) both directions at the rates the preset's table gives the row's chunk copies with both busy, then the
  rest alone (SimPreset.link_floor_us).

Runs on the simulator only: the rule is the simulator's (`--rules` sets it per run). Each row also checks
the peak extra device memory against (slots + 1) x the largest chunk and that the swapped params are
bitwise those of the same AdamW run resident, after the same steps.

    python -m swapopt.bench.floor --out bench/results --name sim-h100-2026-11-25-layouts-floor
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from loguru import logger
from pydantic import BaseModel

from device import sim
from device.sim.presets import LINK_SHARING_RULES, SimPreset
from swapopt.bench.layouts import Layout, get_layout, make_layout_params, scale_to_fit
from swapopt.bench.layout_run import SIM_MAX_NUMEL
from swapopt.bench.measure import time_steps
from swapopt.bench.model import clone_params
from swapopt.bench.strategies import AdamWSpec, make_strategy

DEFAULT_LAYOUTS = ("llama7b", "moe", "fsdp256")
DEFAULT_TIMES = (16, 64)
DEFAULT_RULES = ("sized", "first", "d2h")
FLOOR_TARGET = 1.05  # step / floor the issue asks for


class FloorRow(BaseModel):
    layout: str
    tensors: int
    numel: int
    scale: int
    rule: str  # the link sharing rule the simulator ran under
    times: int
    slots: int
    chunks: int
    step_ms: float
    cap_floor_ms: float
    rule_floor_ms: float
    peak_extra_bytes: int
    slot_bytes: int  # the largest chunk's slot bytes: the cap is (slots + 1) x this
    bitwise: bool | None = None  # params equal to the resident run's after the same steps (None: not checked)

    @property
    def cap_ratio(self) -> float:
        return self.step_ms / self.cap_floor_ms

    @property
    def rule_ratio(self) -> float:
        return self.step_ms / self.rule_floor_ms

    @property
    def cap_bytes(self) -> int:
        return (self.slots + 1) * self.slot_bytes


class FloorResult(BaseModel):
    device: str
    torch: str
    date: str
    preset: dict  # the base preset's figures (its rule replaced per row)
    rows: list[FloorRow]
    before: list[FloorRow] = []  # the same rows from an earlier engine, when merged in
    before_note: str = ""
    notes: list[str] = []  # said under the table


def floors_ms(preset: SimPreset, h2d_bytes: int, d2h_bytes: int, copy_bytes: int | None = None) -> tuple[float, float]:
    """(cap floor, rule floor) in ms for these bytes on this preset (module docstring); `copy_bytes`, the size of
    the chunk copies, picks the rates of a "sized" preset's table (None: the least floor over its sizes)."""
    even = dataclasses.replace(preset, link_sharing="first")
    rule = preset.link_floor_us(h2d_bytes, d2h_bytes, copy_bytes if preset.link_sharing == "sized" else None)
    return even.link_floor_us(h2d_bytes, d2h_bytes) / 1e3, rule / 1e3


def _bitwise(params: list[torch.nn.Parameter], ref: list[torch.nn.Parameter], steps: int) -> bool:
    resident = make_strategy("resident", ref, AdamWSpec(impl="fused"))
    for _ in range(steps):
        resident.step()
    resident.close()
    return all(torch.equal(p.detach(), q.detach()) for p, q in zip(params, ref))


def measure(
    shape: Layout, times: int, rule: str, base: SimPreset, slots: int = 3, check_bitwise: bool = True
) -> FloorRow:
    """One swapopt row on a simulator running `base` under sharing rule `rule`."""
    preset = dataclasses.replace(base, link_sharing=rule)
    with sim.activate(preset, sanitize=False):
        params = make_layout_params(shape)
        ref = clone_params(params) if check_bitwise else None
        strategy = make_strategy("swapopt", params, AdamWSpec(impl="fused"), times=times, slots=slots)
        warmup, repeats = 1, 2  # the step after the first is the steady one; the model is deterministic
        timing = time_steps(strategy, warmup=warmup, repeats=repeats)
        chunks = strategy.opt.swap_stats().chunks
        slot_bytes = strategy.opt.operate.slot_bytes
        strategy.close()
        state_bytes = 8 * shape.numel  # exp_avg + exp_avg_sq, fp32, each way
        cap_floor, rule_floor = floors_ms(preset, state_bytes, state_bytes, slot_bytes)
        same = _bitwise(params, ref, warmup + repeats) if ref is not None else None
    return FloorRow(
        layout=shape.name, tensors=shape.count, numel=shape.numel, scale=shape.scale, rule=rule, times=times,
        slots=slots, chunks=chunks, step_ms=timing.step_ms, cap_floor_ms=cap_floor, rule_floor_ms=rule_floor,
        peak_extra_bytes=timing.peak_extra_bytes, slot_bytes=slot_bytes, bitwise=same,
    )


def run_floor(
    layouts: Sequence[str | Layout] = DEFAULT_LAYOUTS,
    times: Sequence[int] = DEFAULT_TIMES,
    rules: Sequence[str] = DEFAULT_RULES,
    max_numel: int = SIM_MAX_NUMEL,
    base: str | SimPreset = "h100",
    check_bitwise: bool = True,
) -> list[FloorRow]:
    preset = sim.PRESETS[base] if isinstance(base, str) else base
    rows = []
    for layout in layouts:
        shape = get_layout(layout) if isinstance(layout, str) else layout
        if shape.numel > max_numel:
            shape = scale_to_fit(shape, max_numel)
        for rule in rules:
            for t in times:
                rows.append(measure(shape, t, rule, preset, check_bitwise=check_bitwise))
                r = rows[-1]
                logger.info("{} {} t={}: {:.3f} ms, {:.3f}x cap floor, {:.3f}x rule floor", r.layout, rule, t,
                            r.step_ms, r.cap_ratio, r.rule_ratio)
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def markdown(res: FloorResult) -> str:
    p = res.preset
    out = [
        f"# swapopt benchmark: the link floor ({res.device})",
        "",
        f"device `sim`, torch {res.torch}, {res.date}, AdamW (fused) fp32 states, 3 slots. Simulator preset "
        f"{p['name']}: H2D {p['h2d_gbps']} GB/s, D2H {p['d2h_gbps']} GB/s, both at once {p['duplex_gbps']} GB/s, "
        f"copy latency {p['copy_latency_us']} us, launch {p['launch_us']} us; times are modeled (deterministic), "
        "each the step after the first.",
        "",
        "Cap floor = (H2D bytes + D2H bytes) / the cap with both directions busy (no less than one direction "
        "alone); rule floor = the least time under the row's sharing rule: under `sized` both directions at the "
        "rates the preset's table gives the row's chunk copies with both busy, then the rest alone; the cap "
        "floor under `first` (the copy launched first keeps its rate), and under `d2h` (D2H always keeps its "
        "rate, H2D gets the rest) "
        "D2H's bytes at its rate, H2D getting cap - that meanwhile, then the rest of H2D's bytes alone "
        f"({_fixed_rule_factor(p):.3f}x the cap floor here). Target: step <= {FLOOR_TARGET}x the floor. "
        "Peak = extra device memory of a step, against (slots + 1) x the largest chunk. Bitwise = params equal "
        "to resident fused AdamW's after the same three steps.",
        "",
    ]
    before = {(b.layout, b.rule, b.times): b for b in res.before}
    if res.before:
        out += [f"Before: {res.before_note}", ""]
    head = "| layout | rule | t | chunks | step ms | cap floor ms | step / cap floor | rule floor ms | step / rule floor |"
    sep = "|---|---|---:|---:|---:|---:|---:|---:|---:|"
    if before:
        head += " before: chunks | before: step ms | before: / cap floor | before: / rule floor |"
        sep += "---:|---:|---:|---:|"
    head += " peak MiB | cap MiB | bitwise |"
    sep += "---:|---:|---|"
    out += [head, sep]
    for r in res.rows:
        line = (
            f"| {r.layout} ({r.tensors:,} tensors, {r.numel / 1e6:.1f} M params"
            f"{'' if r.scale == 1 else f', dims / {r.scale}'}) | {r.rule} | {r.times} | {r.chunks} | "
            f"{r.step_ms:.3f} | {r.cap_floor_ms:.3f} | {r.cap_ratio:.3f} | {r.rule_floor_ms:.3f} | {r.rule_ratio:.3f} |"
        )
        if before:
            b = before.get((r.layout, r.rule, r.times))
            line += (
                f" {b.chunks} | {b.step_ms:.3f} | {b.cap_ratio:.3f} | {b.rule_ratio:.3f} |" if b else " - | - | - | - |"
            )
        bitwise = "-" if r.bitwise is None else ("yes" if r.bitwise else "NO")
        line += f" {_mib(r.peak_extra_bytes)} | {_mib(r.cap_bytes)} | {bitwise} |"
        out.append(line)
    out += ["", "Targets:", ""]
    for r in res.rows:
        checks = [
            f"step / rule floor {r.rule_ratio:.3f} <= {FLOOR_TARGET} {'met' if r.rule_ratio <= FLOOR_TARGET else 'MISSED'}",
            f"step / cap floor {r.cap_ratio:.3f} <= {FLOOR_TARGET} {'met' if r.cap_ratio <= FLOOR_TARGET else 'MISSED'}",
            f"peak {_mib(r.peak_extra_bytes)} <= {_mib(r.cap_bytes)} MiB "
            f"{'met' if r.peak_extra_bytes <= r.cap_bytes else 'MISSED'}",
        ]
        if r.bitwise is not None:
            checks.append(f"bitwise {'met' if r.bitwise else 'MISSED'}")
        out.append(f"- {r.layout} {r.rule} t={r.times}: " + "; ".join(checks))
    out.append("")
    if res.notes:
        out += ["## Notes", "", *(f"- {n}" for n in res.notes), ""]
    return "\n".join(out)


def _fixed_rule_factor(p: dict) -> float:
    preset = SimPreset(**{**p, "link_sharing": "d2h"})
    b = 1e9
    return preset.link_floor_us(b, b) / dataclasses.replace(preset, link_sharing="first").link_floor_us(b, b)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m swapopt.bench.floor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS))
    ap.add_argument("--times", default=",".join(map(str, DEFAULT_TIMES)))
    ap.add_argument("--rules", default=",".join(DEFAULT_RULES), help=f"of {', '.join(LINK_SHARING_RULES)}")
    ap.add_argument("--max-params", type=float, default=SIM_MAX_NUMEL)
    ap.add_argument("--preset", default="h100")
    ap.add_argument("--no-bitwise", action="store_true")
    ap.add_argument("--before", type=Path, help="a JSON of this bench from an earlier engine, shown beside")
    ap.add_argument("--before-note", default="", help="what the --before run was")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--name", default=None, help="file stem (default sim-<preset>-<date>-layouts-floor)")
    ap.add_argument("--render", type=Path, help="re-render the Markdown of a JSON written by this bench")
    args = ap.parse_args(argv)
    if args.render is not None:
        res = FloorResult.model_validate_json(args.render.read_text())
        args.render.with_suffix(".md").write_text(markdown(res))
        return 0
    rules = [r for r in args.rules.split(",") if r]
    unknown = [r for r in rules if r not in LINK_SHARING_RULES]
    if unknown:
        print(f"unknown rule(s) {', '.join(unknown)}; choices: {', '.join(LINK_SHARING_RULES)}", file=sys.stderr)
        return 2
    base = sim.PRESETS[args.preset]
    now = dt.datetime.now(dt.timezone.utc)
    rows = run_floor(
        [x for x in args.layouts.split(",") if x], [int(t) for t in args.times.split(",") if t], rules,
        int(args.max_params), base, check_bitwise=not args.no_bitwise,
    )
    res = FloorResult(
        device=f"sim-{base.name}", torch=torch.__version__, date=now.strftime("%Y-%m-%d %H:%M UTC"),
        preset={k: v for k, v in dataclasses.asdict(base).items() if k not in ("sources", "measured")}, rows=rows,
    )
    if args.before is not None:
        res.before = FloorResult.model_validate_json(args.before.read_text()).rows
        res.before_note = args.before_note
    stem = args.name or f"sim-{base.name}-{now:%Y-%m-%d}-layouts-floor"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(res.model_dump(), indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
