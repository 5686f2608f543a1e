"""XTuner v1 integration: XTuner's own ``AdamWConfig(swap_optimizer=True)`` builds a swapping AdamW.

Drop-in route (XTuner configs stay as they are)::

    import swapopt.integrations.xtuner as sx
    sx.use_swapopt()        # in every process that builds the optimizer: the launcher, and each Ray worker's
                            # start-up (worker_process_setup_hook), since workers get pickled config objects,
                            # not the config file (see docs/xtuner.md)
    from xtuner.v1.config import AdamWConfig
    optim_cfg = AdamWConfig(lr=6e-5, swap_optimizer=True, swap_optimizer_times=16)

``use_swapopt()`` is idempotent and may run before or after XTuner's modules (or config instances) exist: it
patches XTuner's ``AdamWConfig`` class in place, so every import of it sees the change. It

- keeps XTuner's fields, types and defaults (``swap_optimizer: Optional[bool] = False``) and adds the knobs
  ``swap_optimizer_times`` (chunks per step), ``chunk_mb`` (fixed chunk budget, MiB, overrides it), ``slots``
  (device staging buffers) and ``resident_mb`` (states that fit stay on the device), validated like
  ``swapopt.SwapConfig``;
- makes ``build(model)`` with ``swap_optimizer`` truthy return ``swapopt.SwapOptimizer`` around the exact
  ``torch.optim.AdamW`` XTuner's own build makes with the flag off (same params, group, logging); with the
  flag off XTuner's build runs untouched;
- when XTuner's ``TrainEngine`` is importable, makes ``put_optimizer_to_device`` offload / onload swapopt's
  optimizer (so with ``resident_mb > 0`` no optimizer byte stays on the device during rollout) and makes
  ``load_dcp`` refuse multi-rank checkpoints written by XTuner's own ``SwapAdamW`` (see
  ``check_optimizer_shards``), which would otherwise load with no moments and no error.

Explicit route: ``from swapopt.integrations.xtuner import AdamWConfig`` (a subclass of XTuner's class when
``xtuner.v1`` is importable, a pydantic model with the same fields otherwise), same fields and defaults. It
builds swapopt wherever the config object goes, but patches nothing in XTuner's engine: without
``use_swapopt()`` a multi-rank ``SwapAdamW`` checkpoint loads with wrong moments and no error, and XTuner's RL
offload (skipped when ``swap_optimizer`` is set) leaves resident states on the device.

Neither route makes a swapopt checkpoint load into XTuner's own ``SwapAdamW``: that optimizer asks for a
``max_exp_avg_sq`` entry per param, which swapopt (like torch's AdamW) does not write.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any, Optional, Tuple

import torch
from loguru import logger
from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo

from swapopt.switch import SwapConfig
from swapopt.offload import offload as _offload, onload as _onload
from swapopt.optimizer import SwapOptimizer

try:
    from xtuner.v1.config import AdamWConfig as _XTunerAdamWConfig
except ImportError:  # XTuner v1 is not on the package registry; most installs take this path
    _XTunerAdamWConfig = None

XTUNER_AVAILABLE = _XTunerAdamWConfig is not None

__all__ = ["XTUNER_AVAILABLE", "AdamWConfig", "SwapoptCheckpointError", "check_optimizer_shards", "use_swapopt"]

# The knobs added to XTuner's config: name -> (annotation, field), declared once, in SwapConfig.
_KNOBS: dict[str, tuple[Any, Any]] = {
    name: (SwapConfig.model_fields[name].annotation, copy.copy(SwapConfig.model_fields[name]))
    for name in ("swap_optimizer_times", "chunk_mb", "slots", "resident_mb")
}
_PATCHED = "__swapopt_patched__"


class _AdamWFields(BaseModel):
    """XTuner v1's ``OptimConfig`` + ``AdamWConfig`` fields and defaults, for installs without XTuner."""

    model_config = ConfigDict(extra="forbid")

    lr: float = 1e-5
    max_grad_norm: float = 1.0
    skip_grad_norm_threshold: Optional[float] = None
    weight_decay: float = 0.01
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    foreach: Optional[bool] = None
    swap_optimizer: Optional[bool] = False

    def build(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """XTuner's plain branch: AdamW over the trainable params, one group."""
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, foreach=self.foreach
        )


def _knob(cfg: BaseModel, name: str) -> Any:
    # An instance made before use_swapopt() added the field has no value for it: use the default.
    return cfg.__dict__.get(name, _KNOBS[name][1].default)


def _swap_build(original):
    @functools.wraps(original)
    def build(self, model):
        if not self.swap_optimizer:
            return original(self, model)
        # XTuner's own build with the flag off is the AdamW it would step without swapping: same params, group
        # and logging. Wrapping that (instead of rebuilding the param list here) keeps bitwise parity with it.
        inner = original(self.model_copy(update={"swap_optimizer": False}), model)
        return SwapOptimizer(inner, **{name: _knob(self, name) for name in _KNOBS})

    build.__swapopt_original__ = original
    return build


def _add_knobs(cls: type) -> None:
    fields = cls.__pydantic_fields__
    added = False
    for name, (annotation, field) in _KNOBS.items():
        if name not in fields:
            fields[name] = FieldInfo.merge_field_infos(FieldInfo.from_annotation(annotation), field)
            cls.__annotations__[name] = annotation
            added = True
    if added:
        # Rebuild the validator so the new fields are accepted and checked (extra="forbid" refused them).
        cls.model_rebuild(force=True)


class SwapoptCheckpointError(RuntimeError):
    """A checkpoint that would load wrong (silently) into this optimizer."""


def check_optimizer_shards(checkpoint_id: str | os.PathLike) -> None:
    """Raise ``SwapoptCheckpointError`` when a DCP checkpoint's ``optimizer.state.<fqn>.*`` tensors do not have
    the global size of ``model.<fqn>``, or do not cover it.

    XTuner's own ``SwapAdamW`` (up to at least commit b934f46) saves each rank's local shard as if it were the
    whole state, and XTuner's load planner skips torch's size check: on more than one rank the moments then
    load as nothing, with no error. One-rank checkpoints have matching sizes and pass.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(os.fspath(checkpoint_id)).read_metadata().state_dict_metadata
    tensors = {k: v for k, v in meta.items() if isinstance(v, TensorStorageMetadata)}
    bad, checked = [], 0
    for key, md in tensors.items():
        if not key.startswith("optimizer.state."):
            continue
        fqn, _, _state = key[len("optimizer.state."):].rpartition(".")
        param = tensors.get(f"model.{fqn}")
        if param is None or md.size.numel() <= 1 < param.size.numel():  # scalars such as ``step``
            continue
        checked += 1
        covered = sum(torch.Size(c.sizes).numel() for c in md.chunks)
        if md.size != param.size or covered != md.size.numel():
            bad.append(f"{key} {list(md.size)} (chunks cover {covered}) vs model.{fqn} {list(param.size)}")
    if bad:
        raise SwapoptCheckpointError(
            f"{os.fspath(checkpoint_id)}: {len(bad)} of {checked} optimizer states do not match their param's "
            f"global size, e.g. {bad[0]}. This is a multi-rank checkpoint written by XTuner's own SwapAdamW, which "
            "saved one rank's shards as whole states; loading it would leave the Adam moments unset. To continue, "
            "load the model only and restart the moments (load_dcp(..., load_states=False), XTuner's "
            "`load_optimizer_states=False`), or resume from a checkpoint saved with XTuner's plain AdamW or swapopt."
        )


def _engine_hooks(engine_cls: type) -> None:
    put = engine_cls.put_optimizer_to_device
    load = engine_cls.load_dcp

    @functools.wraps(put)
    def put_optimizer_to_device(self, device):
        opt = getattr(self, "optimizer", None)
        if not isinstance(opt, SwapOptimizer):
            return put(self, device)
        # XTuner skips its offload when swap_optimizer is set; swapopt's offload also moves resident states
        # and device scalars to pinned memory, so the rollout sees no optimizer byte on the device.
        if torch.device(device).type == "cpu":
            _offload(opt, empty_cache=False)  # the worker empties the cache right after
        else:
            _onload(opt)
        return False  # XTuner's "already CPU-resident" path: its log line and empty_cache stay as they are

    @functools.wraps(load)
    def load_dcp(self, weights_dir, load_states: bool = True, load_args: bool = True, *args, **kwargs):
        if load_states:
            check_optimizer_shards(weights_dir)
        return load(self, weights_dir, load_states, load_args, *args, **kwargs)

    engine_cls.put_optimizer_to_device = put_optimizer_to_device
    engine_cls.load_dcp = load_dcp


def use_swapopt(config_cls: type | None = None, engine_cls: type | None = None) -> None:
    """Make XTuner's ``AdamWConfig(swap_optimizer=True)`` build swapopt; idempotent.

    ``config_cls`` / ``engine_cls`` default to ``xtuner.v1.config.optim.AdamWConfig`` and
    ``xtuner.v1.engine.train_engine.TrainEngine`` (pass a fork's classes to patch those instead). The engine
    hooks are skipped when the engine cannot be imported (it needs ray and XTuner's kernels); the config
    patch is not optional.
    """
    if config_cls is None:
        try:
            from xtuner.v1.config.optim import AdamWConfig as config_cls
        except ImportError as e:
            raise ImportError(
                f"use_swapopt() patches XTuner v1's AdamWConfig, but `xtuner.v1.config` could not be imported ({e}). "
                "Install XTuner v1 from its repository (pip install -e <checkout of InternLM/xtuner>) or put a "
                "checkout on PYTHONPATH, or use `from swapopt.integrations.xtuner import AdamWConfig` instead."
            ) from e
        if engine_cls is None:
            try:
                from xtuner.v1.engine.train_engine import TrainEngine as engine_cls
            except ImportError as e:
                logger.debug("XTuner's TrainEngine is not importable ({}); patching its AdamWConfig only", e)
    if not config_cls.__dict__.get(_PATCHED, False):
        _add_knobs(config_cls)
        config_cls.build = _swap_build(config_cls.build)
        setattr(config_cls, _PATCHED, True)
    if engine_cls is not None and not engine_cls.__dict__.get(_PATCHED, False):
        _engine_hooks(engine_cls)
        setattr(engine_cls, _PATCHED, True)


_Base: Any = _XTunerAdamWConfig if XTUNER_AVAILABLE else _AdamWFields


class AdamWConfig(_Base):
    """XTuner's ``AdamWConfig`` (same defaults: ``swap_optimizer=False``) with swapopt's knobs, swapping when
    ``swap_optimizer`` is on, without ``use_swapopt()``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    swap_optimizer: Optional[bool] = False
    swap_optimizer_times: int = _KNOBS["swap_optimizer_times"][1]
    chunk_mb: Optional[float] = _KNOBS["chunk_mb"][1]
    slots: int = _KNOBS["slots"][1]
    resident_mb: float = _KNOBS["resident_mb"][1]


# The explicit class builds swapopt whether or not use_swapopt() is ever called. Its knobs are declared above,
# so only the build is wrapped; it wraps the base build (XTuner's or the stand-in fields'), not a patched one.
AdamWConfig.build = _swap_build(getattr(_Base.build, "__swapopt_original__", _Base.build))
setattr(AdamWConfig, _PATCHED, True)
