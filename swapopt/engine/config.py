"""Engine configuration: plain pydantic models, loaded from mmengine-style config files.

A config file (Python with plain variables, or YAML) has up to six top-level keys, each a dict validated by
the model of the same name below: ``model``, ``data``, ``optim``, ``lr``, ``train``, ``rl``. Every model
forbids unknown keys, so a typo fails at start with a message naming the key.

    cfg = load_config("configs/tiny.py", ["optim.swap_optimizer=false", "train.steps=3"])
"""

from __future__ import annotations

import ast
import difflib
import inspect
import runpy
from pathlib import Path
from typing import Any, Iterable, Literal, Optional

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from swapopt import SwapConfig


class ConfigError(ValueError):
    """A bad config: the message names the offending key (``optim.lr``, ``train.stpes``...)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    """Our decoder-only LM (RMSNorm, RoPE, SwiGLU, SDPA), or a Hugging Face causal LM from ``hf_path``."""

    vocab_size: int = Field(default=256, ge=2)  # byte-level tokens
    dim: int = Field(default=128, ge=8)
    n_layers: int = Field(default=4, ge=1)
    n_heads: int = Field(default=4, ge=1)
    ffn_dim: Optional[int] = Field(default=None, ge=1)  # None: about 8/3 * dim, rounded up to 32
    max_seq_len: int = Field(default=2048, ge=1)
    rope_theta: float = Field(default=10000.0, gt=0)
    norm_eps: float = Field(default=1e-5, gt=0)
    tie_embeddings: bool = False
    hf_path: Optional[str] = None  # local directory of a Hugging Face causal LM (needs `transformers`)
    # The params' dtype. "bfloat16" with optim.master_weights=true: bf16 params on the device, their fp32 masters
    # and the optimizer's states in pinned host memory (Note [master weights] in swapopt.masters).
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _heads_divide_dim(self) -> "ModelConfig":
        if self.hf_path is None and self.dim % (2 * self.n_heads):
            raise ValueError(f"model.dim ({self.dim}) must be a multiple of 2 * model.n_heads ({self.n_heads})")
        return self

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return -(-(8 * self.dim // 3) // 32) * 32


class DataConfig(_Strict):
    """Byte-level tokens from a text file; None means the corpus shipped with swapopt."""

    path: Optional[str] = None


class AdamWConfig(SwapConfig):
    """The optimizer (XTuner style): torch's AdamW by default, wrapped in a SwapOptimizer when asked.

    ``type`` names any ``torch.optim`` optimizer; its constructor gets the keys below that it accepts.
    The swap knobs (``swap_optimizer``, ``swap_optimizer_times``, ``chunk_mb``, ``slots``,
    ``resident_mb``, ``overlap_forward``, ``prefetch``) are inherited from :class:`swapopt.SwapConfig`
    (``resident_mb: auto`` keeps what the device's spare memory holds resident, measured at each step).

    ``overlap_forward`` (default False; only with ``swap_optimizer=True``): the optimizer's updates run on
    their own stream, in forward order, and each module's forward waits only for its own params, so the
    swap step hides under the next forward instead of delaying it. The engine attaches the optimizer to the
    model (after FSDP2 sharding) and waits for pending updates before checkpoints and offload. Losses and
    params are bitwise those with it off; it pays off when the forward takes about as long as the swap step.

    ``prefetch`` (default False; only with ``swap_optimizer=True``): the first ``slots - 1`` chunks of each
    step are swapped in right after the forward, under the loss and the backward, so the first update starts
    at once (the pipeline fill no longer delays it). The engine attaches the optimizer to the model for it.
    Bitwise the same results; the staging is held from the forward to the end of the step (a prefetch
    budget of slots x slot bytes on top of the step's (slots + 1) x chunk). ``overlap_forward`` or
    ``prefetch`` with ``swap_optimizer=False`` is ignored with a warning.
    """

    type: str = "AdamW"
    lr: float = Field(default=1e-3, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.1, ge=0)
    foreach: Optional[bool] = None
    fused: Optional[bool] = None
    # The unswapped recipe master_weights reproduces: fp32 masters of the bf16 params and the optimizer's states on
    # the device (swapopt.engine.device_masters). Only with swap_optimizer=false, no checkpoints and no RL: it is
    # what the summary of a master-weights job compares with (train.compare_resident).
    device_masters: bool = False

    @field_validator("type")
    @classmethod
    def _known_optimizer(cls, value: str) -> str:
        klass = getattr(torch.optim, value, None)
        if not (inspect.isclass(klass) and issubclass(klass, torch.optim.Optimizer)):
            raise ValueError(f"unknown optimizer {value!r}: expected a torch.optim class name such as 'AdamW'")
        return value

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The torch optimizer over ``params``, wrapped by ``SwapConfig.wrap`` (unchanged when swapping is off).

        Raises ConfigError naming ``optim.type`` when swapping is on and the swap engine refuses the optimizer.
        """
        klass = getattr(torch.optim, self.type)
        accepted = inspect.signature(klass.__init__).parameters
        kwargs = {k: v for k, v in self.model_dump(exclude={"type", *SwapConfig.model_fields}).items()
                  if k in accepted and not (v is None and k in ("foreach", "fused"))}
        if self.device_masters:
            from swapopt.engine.device_masters import DeviceMasters

            return DeviceMasters(params, lambda masters: klass(masters, **kwargs))  # type: ignore[return-value]
        optimizer = klass(params, **kwargs)
        _check_npu_kernels(optimizer)
        try:
            return self.wrap(optimizer)
        except (TypeError, ValueError, NotImplementedError) as err:
            raise ConfigError(f"optim.type: swap_optimizer=True cannot wrap {self.type}: {err}") from err


def _check_npu_kernels(optimizer: torch.optim.Optimizer) -> None:
    """On NPU, refuse ``optim.fused=true`` for optimizers whose fused kernel torch_npu lacks: they would
    step through its synchronous CPU fallback (swapopt.npu)."""
    import device
    from swapopt import npu

    if device.get_device() != "npu":
        return
    kernels = npu.cpu_fallback_kernels(optimizer)
    if kernels:
        raise ConfigError(f"optim.fused: {npu.fallback_message(optimizer, kernels)}; set optim.fused=false")


class LRConfig(_Strict):
    """Linear warmup to ``optim.lr`` over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``."""

    warmup_steps: int = Field(default=10, ge=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)


class TrainConfig(_Strict):
    steps: int = Field(default=100, ge=1)
    batch: int = Field(default=8, ge=1)  # sequences per rank and step
    seq_len: int = Field(default=128, ge=2)
    seed: int = 0
    grad_clip: Optional[float] = Field(default=1.0, gt=0)  # max global grad norm; None: no clipping
    gradient_checkpointing: bool = False
    checkpoint_dir: Optional[str] = None
    checkpoint_interval: int = Field(default=0, ge=0)  # steps between DCP saves (0: only at the end)
    resume: Optional[str] = None  # a checkpoint directory (one step) or a checkpoint_dir (latest step)
    metrics_path: Optional[str] = None  # JSONL, one line per step
    # steps between printed lines; also how often metrics are read from the device (the only host waits of a run
    # besides checkpoints, rollouts and the end) and written to metrics_path
    log_interval: int = Field(default=10, ge=1)
    device: Literal["auto", "cuda", "npu", "cpu", "sim"] = "auto"
    sim_preset: str = "h100"  # simulator preset when no accelerator is found (or device="sim")
    sim_capacity_mb: Optional[float] = Field(default=None, gt=0)
    # >0: afterwards run this many steps with swapping off (for master_weights: the bf16 recipe with fp32 masters on
    # the device) and compare peaks; with at least 6, step periods too (a synchronized window after the first step)
    compare_resident: int = Field(default=0, ge=0)
    save_on_interrupt: bool = False  # Ctrl-C: write a checkpoint of the last finished step before exiting
    host_ram_check: bool = True  # on the simulator/CPU: refuse a job whose estimated host RAM exceeds what is free


class RLConfig(_Strict):
    """RL colocation: every ``rollout_every`` steps offload the optimizer, run a stand-in rollout that
    holds ``rollout_buffer_mb`` of device memory, then onload and keep training."""

    rollout_every: int = Field(default=5, ge=1)
    rollout_buffer_mb: float = Field(default=64.0, gt=0)
    empty_cache: bool = True


class EngineConfig(_Strict):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: AdamWConfig = AdamWConfig()
    lr: LRConfig = LRConfig()
    train: TrainConfig = TrainConfig()
    rl: Optional[RLConfig] = None

    @model_validator(mode="after")
    def _device_masters_alone(self) -> "EngineConfig":
        if self.optim.device_masters:
            clash = [what for what, on in (("optim.swap_optimizer=true", self.optim.swap_optimizer),
                                           ("optim.master_weights=true", self.optim.master_weights),
                                           ("train.checkpoint_dir", self.train.checkpoint_dir),
                                           ("rl", self.rl is not None)) if on]
            if clash:
                raise ValueError(f"optim.device_masters=true is the unswapped recipe the summary compares with; it "
                                 f"takes no {', '.join(clash)}")
        return self


def parse_cfg_options(options: Iterable[str]) -> dict[str, Any]:
    """``["optim.lr=3e-4", "train.steps=3"]`` -> ``{"optim.lr": 0.0003, "train.steps": 3}``.

    Values are Python literals (numbers, lists, tuples, quoted strings), YAML scalars (true, false, null),
    or else plain strings.
    """
    parsed: dict[str, Any] = {}
    for option in options:
        key, sep, text = option.partition("=")
        if not sep or not key:
            raise ConfigError(f"--cfg-options expects key=value, got {option!r}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = yaml.safe_load(text) if text else ""
        parsed[key.strip()] = value
    return parsed


def _load_file(path: Path) -> Any:
    """Parse ``path`` with mmengine.Config when installed (``_base_`` inheritance), else plainly; any parse
    failure becomes a one-line ConfigError naming the file and the position."""
    try:
        from mmengine import Config
    except ImportError:
        Config = None
    try:
        if Config is not None:
            return Config.fromfile(str(path))
        if path.suffix in (".yaml", ".yml"):
            return yaml.safe_load(path.read_text()) or {}
        return runpy.run_path(str(path))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}:{where}: YAML syntax error: {problem}") from None
    except SyntaxError as err:
        raise ConfigError(f"{path}: line {err.lineno}: Python syntax error: {err.msg}") from None
    except Exception as err:  # noqa: BLE001 - mmengine wraps parse errors in its own types
        text = " ".join(str(err).split())
        raise ConfigError(f"{path}: cannot read config: {type(err).__name__}: {text}") from None


def _read_file(path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """The file's top-level keys with ``options`` merged in: through mmengine.Config when installed
    (``_base_`` inheritance and the rest), else plain Python variables or YAML."""
    if path.suffix not in (".py", ".yaml", ".yml"):
        raise ConfigError(f"config file must be .py, .yaml or .yml: {path}")
    loaded = _load_file(path)
    if not isinstance(loaded, dict):  # mmengine's Config
        loaded.merge_from_dict(options)
        return loaded.to_dict()
    raw = loaded
    if "_base_" in raw:
        raise ConfigError(f"{path} inherits with _base_, which needs mmengine: pip install 'swapopt[mmengine]'")
    raw = {k: v for k, v in raw.items() if not k.startswith("_") and not inspect.ismodule(v) and not callable(v)}
    for dotted, value in options.items():
        *parents, leaf = dotted.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return raw


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The valid key names of the section that holds ``loc`` (``("optim", "lrr")`` -> AdamWConfig's fields)."""
    model: Any = EngineConfig
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        annotation = field.annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]  # Optional[RLConfig]
        model = next((c for c in candidates if inspect.isclass(c) and issubclass(c, BaseModel)), None)
        if model is None:
            return []
    return list(getattr(model, "model_fields", {}))


def suggest(key: str, valid: Iterable[str]) -> str:
    """' (did you mean X?)' for the nearest valid key, or ''."""
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _describe(err: ValidationError) -> str:
    """One line naming every bad key; an unknown key gets the nearest valid one suggested."""
    parts = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not str(p).startswith("function-"))
        key = ".".join(str(p) for p in loc) or "<config>"
        if e["type"] == "extra_forbidden":
            prefix = ".".join(str(p) for p in loc[:-1])
            hint = suggest(str(loc[-1]), _fields_at(loc))
            if hint:
                hint = f" (did you mean {prefix + '.' if prefix else ''}{hint[len(' (did you mean '):]}"
            parts.append(f"{key}: unknown key{hint}")
            continue
        got = "" if e["type"] == "missing" else f" (got {e.get('input')!r})"
        parts.append(f"{key}: {e['msg']}{got}")
    return "bad config: " + "; ".join(parts)


def validate(raw: dict[str, Any]) -> EngineConfig:
    """Validate a nested dict; raise ConfigError naming every bad key."""
    try:
        return EngineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def load_config(path: str | Path, cfg_options: Iterable[str] | dict[str, Any] = ()) -> EngineConfig:
    """Read ``path``, apply ``key=value`` overrides (dotted keys), validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    options = cfg_options if isinstance(cfg_options, dict) else parse_cfg_options(cfg_options)
    return validate(_read_file(path, options))
