"""A stand-in for XTuner v1's ``TrainEngine``, RL training worker and trainer resume path.

XTuner v1 is not on the package registry, so CI cannot import it. This module reproduces, with a tiny model,
the calls XTuner's code makes on the optimizer and its config (xtuner/v1/engine/train_engine.py,
xtuner/v1/rl/trainer/worker.py, xtuner/v1/train/trainer.py): ``optim_cfg.build(model)``, the
``clip_grad`` group flag, ``step`` / ``zero_grad`` with grad-norm skipping, DCP save / async save / load
through ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` with ``StateDictOptions(cpu_offload=...)``,
``put_optimizer_to_device`` keyed on ``optim_cfg.swap_optimizer``, and the worker's offload / onload with
``empty_cache``. The model is sharded with FSDP2 (``fully_shard``) when a process group is up.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import device
from swapopt.integrations.xtuner import _AdamWFields


class TinyLM(nn.Module):
    """Embedding, two blocks and a frozen norm weight, with XTuner's ``trainable_parameters()``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(32, 12)
        self.blocks = nn.ModuleList(nn.Linear(12, 12) for _ in range(2))
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 32, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * 0.2)  # a CPU generator draws on the CPU
        self.norm.weight.requires_grad_(False)

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # 2-D activations: FSDP2 warns about modules that return views (a Linear over 3-D input does).
        h = self.embed(ids[:, :-1]).reshape(-1, 12)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1))


def batch(step: int) -> torch.Tensor:
    """Token ids drawn on the host and moved to the device, as XTuner's data loader and engine do."""
    ids = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(100 + step), device="cpu")
    return ids.to(device.torch_device())


class TrainEngine:
    """The optimizer-facing part of XTuner v1's TrainEngine."""

    # XTuner loads with its InterleavedShardLoadPlanner (xtuner/v1/patch), which skips torch's size check;
    # tests with XTuner importable set it here, torch's default planner is used otherwise.
    load_planner_cls: Any = None

    def __init__(self, optim_cfg: Any, seed: int = 0) -> None:
        self.optim_cfg = optim_cfg
        self.model = self.build_model(seed)
        self.optimizer = self.build_optimizer(optim_cfg)
        self.has_freeze_params = any(not p.requires_grad for p in self.model.parameters())

    def build_model(self, seed: int) -> nn.Module:
        model = TinyLM(seed)
        if dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.torch_device().type, (dist.get_world_size(),))  # XTuner's DEVICE mesh
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model

    def build_optimizer(self, optim_cfg: Any) -> torch.optim.Optimizer:
        return optim_cfg.build(self.model)

    def train_step(self, step: int) -> float:
        loss = self.model(batch(step))
        loss.backward()
        return loss.item()

    @torch.no_grad()
    def clip_grad_norm(self, do_clip: bool = True) -> torch.Tensor:
        trainable = [p for _, p in self.model.trainable_parameters()]
        grads = [p.grad for p in trainable if p.grad is not None]
        total_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if hasattr(total_norm, "full_tensor"):
            total_norm = total_norm.full_tensor()
        if do_clip:
            clip_ids = {id(p) for g in self.optimizer.param_groups if g.get("clip_grad", True) for p in g["params"]}
            clip = [p.grad for p in trainable if id(p) in clip_ids and p.grad is not None]
            coef = torch.clamp(self.optim_cfg.max_grad_norm / (total_norm + 1e-6), max=1.0)
            for g in clip:
                g.mul_(coef)
        return total_norm

    def step_optimizer(self, grad_norm: torch.Tensor) -> torch.Tensor:
        threshold = self.optim_cfg.skip_grad_norm_threshold
        if torch.isnan(grad_norm) or torch.isinf(grad_norm) or (threshold is not None and grad_norm > threshold):
            self.optimizer.zero_grad()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad()
        return grad_norm

    def _get_dcp_state_dict(self, *, cpu_offload: bool, save_optimizer: bool = True) -> dict[str, Any]:
        options = StateDictOptions(cpu_offload=cpu_offload, ignore_frozen_params=False)
        state: dict[str, Any] = {"model": get_model_state_dict(self.model, options=options)}
        if save_optimizer:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return state

    def save_dcp(self, weights_dir: Path, save_optimizer: bool = True) -> None:
        dcp.save(self._get_dcp_state_dict(cpu_offload=True, save_optimizer=save_optimizer), checkpoint_id=weights_dir)

    def async_save_dcp(self, weights_dir: Path, save_optimizer: bool = True) -> Future:
        state = self._get_dcp_state_dict(cpu_offload=False, save_optimizer=save_optimizer)
        return dcp.async_save(state, checkpoint_id=weights_dir)

    def load_dcp(self, weights_dir: Path, load_states: bool = True, load_args: bool = True) -> None:
        load_optimizer = load_states or load_args
        state = self._get_dcp_state_dict(cpu_offload=True, save_optimizer=load_optimizer)
        options = StateDictOptions(cpu_offload=True, strict=not self.has_freeze_params)
        planner = self.load_planner_cls() if self.load_planner_cls is not None else None
        dcp.load(state_dict=state, checkpoint_id=weights_dir, planner=planner)
        set_model_state_dict(self.model, state["model"], options=options)
        if not load_optimizer:
            return
        optimizer_state = state["optimizer"]
        if not load_states:
            optimizer_state["state"] = {}
        if not load_args:
            defaults = self.optimizer.state_dict()["param_groups"][0]
            defaults.pop("params")
            for group in optimizer_state["param_groups"]:
                for key in [k for k in group if k != "params"]:
                    group.pop(key)
                group.update(defaults)
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=optimizer_state, options=options)

    def put_optimizer_to_device(self, target: torch.device | str) -> bool:
        if getattr(self.optim_cfg, "swap_optimizer", False):
            return False
        if not self.optimizer.state:
            return False
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.to(target, non_blocking=True)
        device.get_torch_device_module().synchronize()
        return True


class TrainWorker:
    """The RL training worker's optimizer phases around rollout."""

    def __init__(self, engine: TrainEngine) -> None:
        self._engine = engine
        self.skipped: list[str] = []

    def offload_optimizer(self) -> None:
        moved = self._engine.put_optimizer_to_device("cpu")
        device.get_torch_device_module().empty_cache()
        if not moved:
            self.skipped.append("offload")

    def onload_optimizer(self) -> None:
        if not self._engine.put_optimizer_to_device(device.torch_device()):
            self.skipped.append("onload")


def train(engine: TrainEngine, start: int, steps: int, offload_first_step: bool = False) -> None:
    """The trainer loop: ``offload_optimizer_first_step`` parks the states on the CPU after resume and puts
    them back just before the first step, as XTuner's Trainer does."""
    if offload_first_step:
        engine.put_optimizer_to_device("cpu")
        device.get_torch_device_module().empty_cache()
    for step in range(start, start + steps):
        engine.train_step(step)
        grad_norm = engine.clip_grad_norm()
        if offload_first_step:
            engine.put_optimizer_to_device(device.torch_device())
            offload_first_step = False
        engine.step_optimizer(grad_norm)


class XTunerAdamWConfig(_AdamWFields):
    """XTuner v1's ``AdamWConfig`` as defined in xtuner/v1/config/optim.py (the fields and defaults swapopt's
    fallback mirrors, and build), for tests that patch it with ``use_swapopt()`` when XTuner itself is not
    importable. Its swap branch builds XTuner's own ``SwapAdamW``, which is not here: reaching it fails the
    test."""

    def build(self, model):
        params = [p for p in model.parameters() if p.requires_grad]
        _ = model.trainable_parameters(), dist.get_rank()  # XTuner's build logs on rank 0: needs a process group
        if self.swap_optimizer:
            raise AssertionError("XTuner's own SwapAdamW branch was reached")
        return torch.optim.AdamW(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, foreach=self.foreach
        )
