"""Simulator presets as JSON files: a calibrated preset written on a device, loaded wherever a preset name goes.

A file holds every field of SimPreset by its own name, read from the dataclass itself rather than from a
list kept here, so a field added to SimPreset is written and read back without touching this module. On
load, fields the file lacks take the class default (a file written before the field existed still loads),
and keys the class does not know are dropped with a warning (a file from a newer swapopt still loads,
saying what it ignored). A file that names no figure the class requires is refused with the names.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from loguru import logger

from device.sim.preset_spec import SimPreset

# Written into every file so that a JSON file of something else is refused with a clear message.
FORMAT = "swapopt-sim-preset"
VERSION = 1


def looks_like_path(preset: str | os.PathLike[str]) -> bool:
    """Whether a --sim / SWAPOPT_SIM_PRESET value names a file rather than a preset: a path object, a
    name ending in .json, or one with a directory separator."""
    if isinstance(preset, os.PathLike):
        return True
    text = str(preset)
    return text.lower().endswith(".json") or os.sep in text or "/" in text


def preset_to_dict(preset: SimPreset) -> dict[str, Any]:
    """Every dataclass field of `preset` by name, plus the format marker."""
    return {"format": FORMAT, "version": VERSION, **dataclasses.asdict(preset)}


def preset_from_dict(data: dict[str, Any], where: str = "preset") -> SimPreset:
    """The SimPreset a dict of fields describes (see the module docstring for missing and unknown keys)."""
    if data.get("format") != FORMAT:
        raise ValueError(f"{where} is not a simulator preset file (no \"format\": \"{FORMAT}\")")
    known = {f.name: f for f in dataclasses.fields(SimPreset)}
    body = {k: v for k, v in data.items() if k not in ("format", "version")}
    unknown = sorted(set(body) - set(known))
    if unknown:
        logger.warning("{}: ignoring keys this swapopt's SimPreset does not have: {}", where, ", ".join(unknown))
    required = [
        name for name, f in known.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    missing = [name for name in required if name not in body]
    if missing:
        raise ValueError(f"{where} lacks simulator preset fields: {', '.join(missing)}")
    values = {k: v for k, v in body.items() if k in known}
    # JSON has no int/float distinction for whole numbers: byte counts must stay ints for the allocator model.
    if "capacity_bytes" in values:
        values["capacity_bytes"] = int(values["capacity_bytes"])
    try:
        return SimPreset(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def save_preset(preset: SimPreset, path: str | os.PathLike[str]) -> Path:
    """Write `preset` to `path` as JSON (parent folders created); return the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(preset_to_dict(preset), indent=1, sort_keys=False) + "\n")
    return target


def load_preset(path: str | os.PathLike[str]) -> SimPreset:
    """Read a preset file written by save_preset (ValueError naming the file when it is not one)."""
    source = Path(path)
    try:
        data = json.loads(source.read_text())
    except FileNotFoundError:
        raise ValueError(f"simulator preset file {str(source)!r} does not exist") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"simulator preset file {str(source)!r} is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"simulator preset file {str(source)!r} does not hold a JSON object")
    return preset_from_dict(data, where=f"simulator preset file {str(source)!r}")

