"""A program written as for a CUDA or Ascend machine, run under the simulator (SWAPOPT_DEVICE=sim,
SWAPOPT_SIM_PRESET picks the flavour). Prints one JSON line of what it saw, which
tests/test_sim_device_type.py judges. A process of its own: torch names its PrivateUse1 backend once."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import device
import swapopt


def model() -> nn.Module:
    torch.manual_seed(0)  # built on the CPU, moved afterwards: the flow README shows
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def train(m: nn.Module, opt: torch.optim.Optimizer, dev: torch.device, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen).to(dev)
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p.detach().cpu(), q.detach().cpu()) for p, q in zip(a.parameters(), b.parameters()))


def main() -> dict:
    flavour = device.get_device()
    seen: dict = {"get_device": flavour, "simulated": device.is_simulated()}
    if flavour == "npu":
        import torch_npu  # noqa: F401  (the simulator presents it)

        seen["torch_npu"] = torch.npu.device_count()
    dev = device.torch_device()
    seen["torch_device"] = str(dev)

    moved = {
        "torch_device": model().to(dev),
        "get_device": model().to(device.get_device()),
        "method": model().cuda() if flavour == "cuda" else model().npu(),
    }
    seen["moved"] = {k: str(next(m.parameters()).device) for k, m in moved.items()}
    # By hand, as FSDP2 moves a CPU-built model onto its mesh: `param.data = ...` puts the param on the device.
    param = nn.Parameter(torch.randn(4))
    param.data = param.data.to(dev)
    seen["data_moved"] = [str(param.device), isinstance(param, nn.Parameter), param.requires_grad]

    swapped, plain = moved["torch_device"], moved["get_device"]
    opt = swapopt.SwapOptimizer(torch.optim.AdamW(swapped.parameters(), lr=1e-2, fused=True), swap_optimizer_times=2)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    train(swapped, opt, dev)
    train(plain, ref, dev)
    seen["bitwise"] = same(swapped, plain)
    seen["swap_steps"] = opt.swap_stats().steps
    seen["swapped_state_device"] = str(opt.state[next(swapped.parameters())]["exp_avg"].device)

    w = next(plain.parameters()).detach()
    host = w.cpu()
    host.add_(1)
    seen["cpu_copies"] = host.device.type == "cpu" and not torch.equal(host, w.cpu())
    try:
        _ = w + torch.ones_like(host)
        seen["mix_raises"] = False
    except RuntimeError as e:
        seen["mix_raises"] = "same device" in str(e)

    module = device.get_torch_device_module()
    before = module.memory_allocated()
    state = ref.state[next(plain.parameters())]["exp_avg"].clone()
    swapopt.offload(ref)
    seen["offload_freed"] = before - module.memory_allocated()
    seen["offloaded_to"] = str(ref.state[next(plain.parameters())]["exp_avg"].device)
    swapopt.onload(ref)
    back = ref.state[next(plain.parameters())]["exp_avg"]
    seen["onloaded_to"] = str(back.device)
    seen["onload_bitwise"] = torch.equal(back.cpu(), state.cpu())

    module.set_device(1)
    t = torch.zeros(1024, device=device.torch_device())
    seen["set_device_1"] = {"tensor": str(t.device), "bytes_on_1": module.memory_allocated(1)}
    module.set_device(0)
    seen["streams"] = side_stream_work(flavour, w)
    seen["saved_loaded"] = save_load(w)
    seen["engine_device"] = engine_device()
    return seen


def side_stream_work(flavour: str, w: torch.Tensor) -> bool:
    """A library's own side stream through torch.cuda / torch.npu, ordered as on the device."""
    mod = torch.cuda if flavour == "cuda" else torch.npu
    side = mod.Stream()
    side.wait_stream(mod.current_stream())
    with mod.stream(side):
        doubled = w * 2
    mod.current_stream().wait_stream(side)
    mod.synchronize()
    return torch.equal(doubled.cpu(), w.cpu() * 2)


def save_load(w: torch.Tensor) -> bool:
    with tempfile.TemporaryDirectory() as d:
        torch.save({"w": w}, os.path.join(d, "w.pt"))
        back = torch.load(os.path.join(d, "w.pt"))["w"]
    return back.device == w.device and torch.equal(back.cpu(), w.cpu())


def engine_device() -> str:
    """The engine as torchrun's rank 1 of 2 starts it (LOCAL_RANK=1): the device its model lands on. The
    process group is one gloo rank over a file, standing in for the second rank."""
    from swapopt.engine.config import load_config
    from swapopt.engine.trainer import TrainEngine

    real_init = dist.init_process_group
    with tempfile.TemporaryDirectory() as d:
        os.environ.update(WORLD_SIZE="2", LOCAL_RANK="1", RANK="1")

        def one_rank(backend: str, **_: object) -> None:
            real_init(backend, init_method=f"file://{d}/pg", rank=0, world_size=1)

        dist.init_process_group = one_rank
        try:
            cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py"))
            engine = TrainEngine(cfg)
            return str(next(engine.model.parameters()).device)
        finally:
            dist.init_process_group = real_init
            if dist.is_initialized():
                dist.destroy_process_group()


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.stdout.flush()
