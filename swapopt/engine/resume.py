"""Checks run before resuming, so a bad checkpoint is a one-line message instead of a DCP traceback.

A step directory holds ``trainer.json`` (step, world size, the config it was saved with), DCP's
``.metadata`` and the shard files it names. Everything here reads only those small files and the shard
sizes: no model is built, nothing is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from swapopt.engine.config import ConfigError, EngineConfig

META = "trainer.json"
DCP_METADATA = ".metadata"


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory (holding trainer.json), or a checkpoint_dir whose latest step is taken."""
    path = Path(path)
    if (path / META).is_file():
        return path
    steps = step_dirs(path)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {path} (expected {META} or step_*/{META})")
    return steps[-1]


def step_dirs(root: Path) -> list[Path]:
    """Complete-looking step directories under ``root``, oldest first (temp dirs start with a dot)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / META).is_file())


def bad_file(step_dir: Path) -> str | None:
    """Why ``step_dir`` cannot be loaded (naming the file), or None when every shard DCP needs is whole."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = step_dir / META
    try:
        json.loads(meta.read_text())
    except (OSError, ValueError) as err:
        return f"{meta} is unreadable ({type(err).__name__})"
    if not (step_dir / DCP_METADATA).is_file():
        return f"{step_dir / DCP_METADATA} is missing"
    try:
        storage = FileSystemReader(str(step_dir)).read_metadata().storage_data
    except Exception as err:  # noqa: BLE001 - a truncated pickle raises anything from EOFError to UnpicklingError
        return f"{step_dir / DCP_METADATA} is unreadable ({type(err).__name__})"
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = step_dir / name
        if not shard.is_file():
            return f"{shard} is missing"
        have = shard.stat().st_size
        if have < size:
            return f"{shard} is truncated ({have:,} of {size:,} bytes)"
    return None


def _previous_good(step_dir: Path) -> Path | None:
    earlier = [p for p in step_dirs(step_dir.parent) if p.name < step_dir.name]
    return next((p for p in reversed(earlier) if bad_file(p) is None), None)


def config_differences(saved: dict[str, Any], cfg: EngineConfig) -> list[str]:
    """``model.dim: checkpoint 128, config 64`` for every model key that changes parameter shapes."""
    current = cfg.model_dump(mode="json")["model"]
    old = saved.get("model", {})
    return [f"model.{k}: checkpoint {old.get(k)!r}, config {current.get(k)!r}"
            for k in sorted(set(old) | set(current)) if old.get(k) != current.get(k)]


def check_resume(cfg: EngineConfig) -> tuple[Path, int]:
    """(step directory, its step) after checking that it loads into ``cfg``; ConfigError (one line) otherwise."""
    try:
        step_dir = resolve_checkpoint(cfg.train.resume)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
    problem = bad_file(step_dir)
    if problem is not None:
        previous = _previous_good(step_dir)
        hint = f"; resume from the previous one: --resume {previous}" if previous else "; no earlier step_* is intact"
        raise ConfigError(f"checkpoint {step_dir} cannot be loaded: {problem}{hint}")
    meta = json.loads((step_dir / META).read_text())
    diffs = config_differences(meta.get("config", {}), cfg)
    if diffs:
        raise ConfigError(f"checkpoint {step_dir} was saved with a different model config: {'; '.join(diffs)} "
                          f"(its config is in {step_dir / META}; pass the same model.* keys as that run)")
    return step_dir, int(meta["step"])
