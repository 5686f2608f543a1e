"""Shared by the checkpoint, DCP and offload tests: a tiny model, a deterministic training loop, state
snapshots, and a launcher that runs a script as N ranks (torchrun-style env, gloo on 127.0.0.1), forked from a
process that imported torch once or, where a test asks, in fresh interpreters."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

import cli_zygote
import device
from swapopt import SwapOptimizer

_ROOT = Path(__file__).resolve().parent.parent


# What the rank scripts import before their own code: torch's distributed packages, and Dynamo, which fully_shard
# imports. The ranks fork from a zygote that imported them once (tests/cli_zygote.py), so that a rank's CPU goes to
# its job rather than to 4-5 s of imports: some twenty ranks start in the suite, on two cores.
RANK_PRELOAD = ("torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor", "torch._dynamo")


def launch(script: str, world_size: int, *args: str, timeout: float = 180.0, fresh: bool = False) -> None:
    """Run ``world_size`` ranks of ``tests/<script>`` on the simulator and wait for all; fails with their
    stderr if any rank fails or times out. The ranks fork from the launch zygote (RANK_PRELOAD); ``fresh``: fresh
    interpreters, for a test whose subject is the interpreter's own start or exit."""
    launch_argv([str(_ROOT / "tests" / script), *args], world_size, timeout=timeout, fresh=fresh)


def launch_argv(argv: list[str], world_size: int, *, timeout: float = 180.0, fresh: bool = False) -> None:
    """``launch`` for any command line (``["-m", module, *args]``, or a script and its arguments)."""
    # The launcher hosts the rendezvous store itself, on a port the OS picks and that stays bound until the
    # ranks are done, and every rank connects as a client (torchrun's agent store). Picking a free port and
    # letting rank 0 bind it later would race any other process taking that port in between.
    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    envs = [
        dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            TORCHELASTIC_USE_AGENT_STORE="True",  # env:// connects to the store above instead of hosting one
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            OMP_NUM_THREADS="1",
            SWAPOPT_DEVICE="sim",  # the simulator, process-wide, in every rank
            PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])),
        )
        for rank in range(world_size)
    ]
    if fresh:
        results = _run_fresh(argv, envs, timeout)
    else:
        commands = [cli_zygote.Command(argv, _ROOT, env) for env in envs]
        results = [(done.returncode, done.stderr) for done in cli_zygote.run_all(commands, preload=RANK_PRELOAD,
                                                                                  timeout=timeout)]  # fmt: skip
    del store
    failures = [f"rank {rank} exited {code}\n{err[-4000:]}" for rank, (code, err) in enumerate(results) if code != 0]
    if failures:
        raise AssertionError(f"{' '.join(map(str, argv))} failed:\n" + "\n".join(failures))


def _run_fresh(argv: list[str], envs: list[dict[str, str]], timeout: float) -> list[tuple[int, str]]:
    """Each rank in a fresh interpreter: (exit status, stderr) of each, all killed once one times out."""
    procs = []
    for env in envs:
        # stderr to a file, not a pipe: a rank that logs a lot must not block on a full pipe.
        err = tempfile.TemporaryFile("w+")
        procs.append((subprocess.Popen([sys.executable, *argv], cwd=_ROOT, env=env, stdout=subprocess.DEVNULL,
                                       stderr=err), err))  # fmt: skip
    results = []
    for proc, err in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            proc.wait()
        err.seek(0)
        results.append((proc.returncode, err.read()))
        err.close()
    return results


def end_rank() -> None:
    """End a rank process started by ``launch``: barrier, then destroy the process group; the interpreter
    then exits normally. Call it last in every rank script. (The simulator keeps a normal exit from aborting:
    Note [collective tensors at exit] in device/sim/device.py.)"""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # no rank leaves while a peer still talks to it
        dist.destroy_process_group()


def live_device_bytes(mod: Any) -> int:
    """Device bytes held by live objects. Cyclic garbage is collected first: the interpreter would free it
    at an arbitrary later moment, in the middle of a measurement."""
    gc.collect()
    return mod.memory_allocated()


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)


def swap(model: nn.Module, **kw: Any) -> torch.optim.Optimizer:
    return SwapOptimizer(adamw(model), swap_optimizer_times=3, **kw)


def host_states(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The swapped states (all but ``step``), once in-flight swap-outs have landed."""
    opt.wait_for_swap_out()
    return [v for s in opt.state.values() for k, v in s.items() if k != "step"]


def assert_host_states(opt: torch.optim.Optimizer) -> int:
    """Assert that every state but ``step`` is a host tensor (naming the key); return how many were checked."""
    checked = 0
    for st in opt.state.values():
        for key, value in st.items():
            if key != "step":
                assert device.is_host_tensor(value), key
                checked += 1
    return checked


def snapshot_params(params, state) -> list[tuple[torch.Tensor, dict]]:
    """Each param's value and state, cloned."""
    return [
        (p.detach().clone(), {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.get(p, {}).items()})
        for p in params
    ]


def matches_snapshot(p, st, snap) -> bool:
    """Whether param ``p`` with state ``st`` equals one entry of snapshot_params."""
    value, states = snap
    if not torch.equal(p.detach(), value) or set(st) != set(states):
        return False
    # swapped states are host tensors, a reference's device tensors: compare host copies, as on CUDA
    return all(torch.equal(st[k].cpu(), v.cpu()) if isinstance(v, torch.Tensor) else st[k] == v for k, v in states.items())


def adopt(r, ref_state, value, states) -> None:
    """Give reference param ``r`` a value and states (device memory for swapped ones, as torch keeps them;
    scalar states keep their kind: a host literal, or on the device for fused)."""
    r.data.copy_(value)
    ref_state.pop(r, None)
    if states:
        ref_state[r] = {
            k: (torch.empty(v.shape, dtype=v.dtype).copy_(v) if isinstance(v, torch.Tensor) and v.dim() else
                v.clone() if isinstance(v, torch.Tensor) else v)
            for k, v in states.items()
        }  # fmt: skip


def assert_steps_match(opt, ref, params, refs, grads, steps: int = 1) -> None:
    """After a failed step (and the reference's adoption of its outcome): ``steps`` more steps of both, each with
    ``grads(params, refs)``, leave every param and state bitwise the reference's."""
    for _ in range(steps):
        grads(params, refs)
        opt.step()
        ref.step()
    opt.wait_for_swap_out()
    for i, (p, r) in enumerate(zip(params, refs)):
        assert matches_snapshot(p, opt.state.get(p, {}), snapshot_params([r], ref.state)[0]), f"param {i}"


def forward_backward(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 8))


def sharded_mlp(
    dims: tuple[int, ...], world_size: int, mesh_device: str = "cpu", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Linear layers of ``dims`` with Tanh between them (seed 0, params of ``dtype``), each and the root sharded
    with FSDP2's fully_shard on a mesh of ``world_size`` ranks (a process group must exist) of device type
    ``mesh_device`` (FSDP2 moves the params there: CPU by default)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(dims) - 2 else [])
    model = nn.Sequential(*layers).to(dtype)
    mesh = init_device_mesh(mesh_device, (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def copy_model(model: nn.Module) -> nn.Module:
    """A new model (device memory when a simulator is active, unlike copy.deepcopy) with ``model``'s values."""
    new = make_model()
    with torch.no_grad():
        for p, q in zip(new.parameters(), model.parameters()):
            p.copy_(q)
    return new


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    """``steps`` optimizer steps on data that depends only on the step index."""
    for step in range(start, start + steps):
        forward_backward(model, step)
        opt.step()
        opt.zero_grad()


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Copies of params and of the optimizer state dict (taken through state_dict: it waits for swap-outs)."""
    sd = opt.state_dict()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                  for i, s in sd["state"].items()},
        "param_groups": [dict(g) for g in sd["param_groups"]],
    }


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Same keys, shapes, dtypes and bitwise-equal values (params, states, param groups)."""
    assert len(a["params"]) == len(b["params"])
    # Compared on the host (.cpu() on both sides, as on CUDA): a SwapOptimizer's states live in host memory,
    # a plain optimizer's on the device.
    for i, (x, y) in enumerate(zip(a["params"], b["params"])):
        assert torch.equal(x.cpu(), y.cpu()), f"param {i} differs"
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys(), f"state keys of param {i}"
        for k, x in a["state"][i].items():
            y = b["state"][i][k]
            assert (x.shape, x.dtype) == (y.shape, y.dtype), f"param {i} {k}: {x.shape}/{x.dtype}, {y.shape}/{y.dtype}"
            assert torch.equal(x.cpu(), y.cpu()), f"param {i} {k} differs"
    assert a["param_groups"] == b["param_groups"]
