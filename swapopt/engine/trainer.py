"""TrainEngine (XTuner style): model, FSDP2 sharding, optimizer, one train step, DCP checkpoints, RL offload.

Swapping is one config key: ``optim.swap_optimizer=True`` makes ``AdamWConfig.build`` wrap the torch optimizer
in a SwapOptimizer; nothing else in the engine changes, because the wrapper shares ``param_groups`` and
``state`` with the optimizer it wraps (LR schedule, grad clipping and DCP work unchanged).
``optim.overlap_forward=True`` also attaches it to the model, so its updates run under the next forward; the
engine then orders everything that reads params outside a forward (checkpoints, offload) after the update.
``optim.prefetch=True`` attaches it too: its forward hook starts each step's first swap-ins under the backward.

A train step never makes the host wait for the device: its metrics (loss, grad norm, timings, swap traffic) are
kept as device tensors and events in a :class:`StepMetrics` and read when someone looks at them, which the
CLI does at the log interval, before checkpoints and on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ContextManager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from loguru import logger
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import device
import swapopt
from swapopt import SwapOptimizer
from swapopt.engine.config import EngineConfig
from swapopt.engine.data import ByteBatches, load_tokens
from swapopt.engine.model import build_model, logits_of, transformer_blocks
from swapopt.engine.resume import META, resolve_checkpoint
from swapopt.engine.schedule import lr_at

_BACKENDS = {"cuda": "nccl", "npu": "hccl"}  # cpu and the simulator: gloo
# A train-step period is taken over at least this many steps between two synchronized marks
# (TrainEngine.synchronized_mark): with overlap the host runs ahead of the device, so one step's own events
# under-report what a step costs, and a short window is dominated by where its ends fall.
PERIOD_MIN_STEPS = 5


def init_distributed(device_type: str) -> tuple[int, int]:
    """(rank, world size); joins the torchrun process group when launched with more than one process, after
    making this rank's device (LOCAL_RANK) current. Call it before anything asks for the current device:
    torch.cuda and torch_npu make device 0 current on the first query, so every rank would build on it."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        simulated = device.is_simulated()
        module = device.get_torch_device_module()
        if device_type in _BACKENDS or simulated:
            module.set_device(local_rank)
        dist.init_process_group("gloo" if simulated else _BACKENDS.get(device_type, "gloo"))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_model(model: torch.nn.Module, torch_device: torch.device) -> None:
    """FSDP2: each transformer block is a unit, the root takes the rest. On accelerators parameters are
    gathered in bf16 and gradients reduced in fp32 (the sharded master parameters stay fp32); on CPU and the
    simulator everything stays fp32."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.6 keeps FSDP2 under _composable
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(torch_device.type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if torch_device.type != "cpu":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def elapsed_ms(start: Any, end: Any) -> float:
    """Milliseconds between two marks of ``TrainEngine`` (events, or wall-clock floats on plain CPU)."""
    return _elapsed_ms(start, end)


def _elapsed_ms(start: Any, end: Any) -> float:
    """Milliseconds between two marks: wall-clock floats on plain CPU, else device events (waits for ``end``)."""
    if isinstance(start, float):
        return (end - start) * 1e3
    end.synchronize()
    return start.elapsed_time(end)


class StepMetrics(Mapping[str, Any]):
    """The metrics of one finished train step, read lazily.

    Reading the loss or a duration makes the host wait for the device; doing that every step would keep the
    host from queueing the next step ahead (and, with ``overlap_forward``, from hiding the update under it).
    So the step keeps device tensors and events here, and the first key lookup (or :meth:`resolve`) turns them
    into plain numbers, once. ``step`` is known without waiting."""

    def __init__(self, *, step: int, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor | None, start: Any,
                 forward_end: Any, optim_start: Any, end: Any, mem_peak_bytes: int | None, tokens: int,
                 swap: tuple[Any, Any, Any] | None) -> None:
        self.step = step
        # The compute stream's mark where the step began (an event; the wall clock on plain CPU): start to start
        # of consecutive steps is the train-step period, however the update overlapped.
        self.start = start
        self._pending: dict[str, Any] | None = dict(
            lr=lr, loss=loss, grad_norm=grad_norm, start=start, forward_end=forward_end, optim_start=optim_start,
            end=end, mem_peak_bytes=mem_peak_bytes, tokens=tokens, swap=swap)
        self._values: dict[str, Any] | None = None

    @property
    def resolved(self) -> bool:
        return self._values is not None

    def resolve(self) -> dict[str, Any]:
        """The metrics as a plain dict (a JSONL line); waits for this step's device work the first time."""
        if self._values is None:
            p = self._pending
            step_s = _elapsed_ms(p["start"], p["end"]) / 1e3
            grad_norm = p["grad_norm"]
            values: dict[str, Any] = {
                "step": self.step,
                "loss": p["loss"].item(),
                "lr": p["lr"],
                "grad_norm": None if grad_norm is None else grad_norm.item(),
                "tokens_per_s": p["tokens"] / step_s,
                "step_ms": step_s * 1e3,
                "forward_ms": _elapsed_ms(p["start"], p["forward_end"]),  # with overlap: waits for the update
                "optim_ms": _elapsed_ms(p["optim_start"], p["end"]),
                "mem_peak_bytes": p["mem_peak_bytes"],
            }
            if p["swap"] is not None:
                stats, swap_start, swap_end = p["swap"]
                swap_ms = None if swap_start is None or swap_end is None else _elapsed_ms(swap_start, swap_end)
                # Rates per direction: H2D and D2H run at once on a full-duplex link, so their sum is no link rate.
                values.update(swap_bytes=stats.h2d_bytes + stats.d2h_bytes, swap_h2d_bytes=stats.h2d_bytes,
                              swap_d2h_bytes=stats.d2h_bytes, swap_ms=swap_ms,
                              h2d_gbps=stats.h2d_bytes / swap_ms / 1e6 if swap_ms else None,
                              d2h_gbps=stats.d2h_bytes / swap_ms / 1e6 if swap_ms else None)
            self._values, self._pending = values, None  # drop the device tensors and events
        return self._values

    def __getitem__(self, key: str) -> Any:
        return self.resolve()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.resolve())

    def __len__(self) -> int:
        return len(self.resolve())

    def __repr__(self) -> str:
        return f"StepMetrics({self._values!r})" if self.resolved else f"StepMetrics(step={self.step}, unresolved)"


class TrainEngine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        tcfg = cfg.train
        self.device_type = device.get_device()
        self.rank, self.world_size = init_distributed(self.device_type)  # first: it picks this rank's device
        self.torch_device = device.torch_device()
        self.device_module = device.get_torch_device_module()

        dtype = getattr(torch, cfg.model.dtype)
        model = build_model(cfg.model, tcfg.seed, tcfg.gradient_checkpointing).to(self.torch_device, dtype=dtype)
        if self.world_size > 1:
            shard_model(model, self.torch_device)
        self.model = model.train()
        # Which device each rank's params landed on: one line per rank, so a launch where ranks share a
        # device shows it at once.
        on = next(iter(model.parameters()), torch.empty(0, device=self.torch_device)).device
        logger.info("rank {} of {}: params on {}", self.rank, self.world_size, on)
        self.optimizer = cfg.optim.build(self.model.parameters())
        self.swapping = isinstance(self.optimizer, SwapOptimizer)
        self.overlap = self.swapping and cfg.optim.overlap_forward
        if self.swapping and (cfg.optim.overlap_forward or cfg.optim.prefetch):
            # Forward pre-hooks make each module wait for its own params' updates only (overlap_forward), and a
            # forward hook on the model prefetches the step's first chunks (prefetch); on FSDP2 they must see
            # the sharded model, so this comes after fully_shard.
            self.optimizer.attach(self.model)
        # Batches are built in pinned host memory on accelerators (and the simulator), so their copy is
        # asynchronous and building the next one never waits for the device.
        self._pin_batches = self.device_type != "cpu"
        self.data = ByteBatches(load_tokens(cfg.data.path), tcfg.batch, tcfg.seq_len, tcfg.seed,
                                self.rank, self.world_size)
        self.step = 0  # completed steps
        self.last_metrics: StepMetrics | None = None  # metrics of step ``self.step``, set with it
        # The part of a step that changes params and states runs inside this (the CLI's Ctrl-C guard).
        self.critical: Callable[[], ContextManager[None]] = contextlib.nullcontext
        self.n_params = sum(p.numel() for p in self.model.parameters())  # DTensor numel is the global one
        if tcfg.resume:
            self.load_checkpoint(tcfg.resume)

    # -- one step --------------------------------------------------------------------------------------
    def _mark(self) -> Any:
        """A point on the compute stream: a timing event on accelerators and the simulator (modeled time
        there), the wall clock on plain CPU. Events keep the device free-running: nothing waits for them
        until the step's metrics are read."""
        if self.device_type == "cpu":
            return time.perf_counter()
        event = self.device_module.Event(enable_timing=True)
        event.record()
        return event

    def _reset_peak_memory(self) -> None:
        reset = getattr(self.device_module, "reset_peak_memory_stats", None)  # torch.cpu has none
        if reset is not None:
            reset()

    def _peak_memory(self) -> int | None:
        # The caching allocator counts at launch, on the host: reading it does not wait for the device.
        peak = getattr(self.device_module, "max_memory_allocated", None)
        return int(peak()) if peak is not None else None

    def _swap_record(self) -> tuple[Any, Any, Any] | None:
        """This step's swap counters and its entry and last swap-out events, read later by StepMetrics.
        ``swap_stats()`` would wait for that swap-out now; the counters are host numbers and the events are
        new objects every step, so keeping them defers the wait without mixing steps up."""
        if not self.swapping:
            return None
        return (self.optimizer.swap_stats(wait=False), *self.optimizer.operate.last_step_events())

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.data.windows(self.step, pin_memory=self._pin_batches)
        windows = windows.to(self.torch_device, non_blocking=self._pin_batches)
        return windows[:, :-1], windows[:, 1:]

    def train_step(self) -> StepMetrics:
        """One step: forward, backward, clipping, optimizer step. Queues the work and returns without waiting
        for the device; the returned metrics are read lazily (see StepMetrics)."""
        tcfg = self.cfg.train
        lr = lr_at(self.step, tcfg.steps, self.cfg.optim.lr, self.cfg.lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = self._batch()
        self._reset_peak_memory()

        start = self._mark()
        logits = logits_of(self.model(inputs))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        forward_end = self._mark()
        loss.backward()
        grad_norm = None
        if tcfg.grad_clip is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tcfg.grad_clip)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
                grad_norm = grad_norm.full_tensor()
        loss = loss.detach()
        if self.world_size > 1:  # queued now, in the same order on every rank; read later
            dist.all_reduce(loss)
            loss = loss / self.world_size
        # The step, its counter and its metrics are one unit: a Ctrl-C held during the optimizer step is raised
        # only once ``last_metrics`` describes the step just counted, so the line for it can always be written.
        with self.critical():
            optim_start = self._mark()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            end = self._mark()
            self.step += 1
            self.last_metrics = StepMetrics(
                step=self.step, lr=lr, loss=loss, grad_norm=grad_norm, start=start, forward_end=forward_end,
                optim_start=optim_start,
                end=end, mem_peak_bytes=self._peak_memory(), swap=self._swap_record(),
                tokens=self.world_size * tcfg.batch * tcfg.seq_len)
        return self.last_metrics

    def wait_for_update(self) -> None:
        """Order the current stream after pending optimizer updates (``overlap_forward``): call before reading
        params outside a forward. A no-op otherwise."""
        if self.overlap:
            self.optimizer.wait_for_update()

    def synchronized_mark(self) -> Any:
        """A mark taken once every step queued so far is done on the device, its update and swap-outs included
        (the host waits for them). Two such marks bracket a window of steps whose period, elapsed / steps, counts
        all of their work, however far ahead of the device the host ran inside the window."""
        self.wait_for_update()
        if self.device_type != "cpu":
            self.device_module.synchronize()  # every stream: swap-outs run on their own
        return self._mark()

    # -- checkpoints ------------------------------------------------------------------------------------
    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def save_checkpoint(self, root: str | Path | None = None) -> Path:
        """DCP save of model and optimizer into ``root/step_XXXXXXXX``: written to a hidden temp dir, then
        renamed, so a crash never leaves a half-written step directory that resume would pick."""
        root = Path(root or self.cfg.train.checkpoint_dir)
        final = root / f"step_{self.step:08d}"
        tmp = root / f".step_{self.step:08d}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        self.wait_for_update()  # the saved params are those after the last step
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=self.world_size == 1)
        self._barrier()
        if self.rank == 0:
            meta = {"step": self.step, "world_size": self.world_size, "config": self.cfg.model_dump(mode="json")}
            (tmp / META).write_text(json.dumps(meta, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        self._barrier()
        logger.info("saved checkpoint {}", final)
        return final

    def load_checkpoint(self, path: str | Path) -> Path:
        path = resolve_checkpoint(path)
        meta = json.loads((path / META).read_text())
        self.wait_for_update()  # loading overwrites params a pending update still writes
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path), no_dist=self.world_size == 1)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.step = int(meta["step"])
        logger.info("resumed from {} at step {}", path, self.step)
        return path

    # -- RL colocation ----------------------------------------------------------------------------------
    def offload_optimizer(self, empty_cache: bool = True) -> None:
        """Give the device to another phase: a SwapOptimizer only drains copies and frees staging (its states
        already live on the host); a plain optimizer's states are moved to the host."""
        self.wait_for_update()  # the other phase reads the params (a rollout generates with them)
        if self.swapping:
            swapopt.offload(self.optimizer, empty_cache=empty_cache)
        else:
            swapopt.put_optimizer_to_device(self.optimizer, "cpu")

    def onload_optimizer(self) -> None:
        if self.swapping:
            swapopt.onload(self.optimizer)
        else:
            swapopt.put_optimizer_to_device(self.optimizer, self.torch_device)

    def rollout(self, buffer_mb: float, empty_cache: bool = True) -> dict[str, Any]:
        """Stand-in for an RL rollout phase colocated on the same device: offload the optimizer, hold a
        ``buffer_mb`` buffer (KV cache, rollout batch), release it, onload."""
        self.offload_optimizer(empty_cache)
        self._reset_peak_memory()
        buffer = torch.empty(int(buffer_mb * 2**20) // 4, dtype=torch.float32, device=self.torch_device)
        buffer.fill_(1.0)
        peak = self._peak_memory()
        del buffer
        self.onload_optimizer()
        return {"step": self.step, "rollout_buffer_mb": buffer_mb, "rollout_mem_peak_bytes": peak}

    def close(self) -> None:
        self.wait_for_update()
        if self.swapping:
            swapopt.offload(self.optimizer)
