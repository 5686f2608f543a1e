"""Mixing simulated device memory with host memory in one op, and moving modules, as CUDA judges them.

CUDA accepts host tensors in a device op only where its kernels read them on the host: 0-dim CPU scalars in the
ops built on TensorIterator, and a one-element CPU lr of any rank in the fused optimizers' `tensor_lr` overloads
(FusedAdamKernel.cu and the others: `if (lr.is_cpu()) ... lr.item<double>()`); everything else, a 0-dim host
`step` handed to a fused kernel included, is torch's "Expected all tensors to be on the same device" error.
Module._apply keeps the Parameter objects where CUDA keeps them (dense host <-> device, dtype changes) and
makes new ones where CUDA does (`to_empty` of a meta-built module, `.to("meta")`,
set_overwrite_module_params_on_conversion).
"""

from __future__ import annotations

import pytest
import torch

import simdevice as simulator
import swapopt

FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def _kwargs(cls: type) -> dict:
    return {"momentum": 0.9} if cls is torch.optim.SGD else {}


def _fused_run(cls: type, dev: torch.device, lr: float | torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 3, device="cpu").to(dev))
    opt = cls([p], lr=lr, fused=True, **_kwargs(cls))
    for _ in range(3):
        p.grad = torch.randn(4, 3, device="cpu").to(dev)
        opt.step()
    return [p.detach().cpu()] + [v.detach().cpu() for v in opt.state[p].values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("cls", FUSED, ids=lambda c: c.__name__)
def test_fused_kernels_read_a_one_element_host_lr_of_any_rank(cls, rank, clean_device_env):
    """torch's test_tensor_lr_num_dim_{1,2}: a host lr tensor with fused=True runs, as on CUDA, and steps the
    params exactly as the float lr does."""
    with simulator.activate() as sim:
        dev = sim.torch_device()
        host_lr = torch.tensor(1e-2, device="cpu").reshape([1] * rank)
        tensor_lr = _fused_run(cls, dev, host_lr)
        float_lr = _fused_run(cls, dev, 1e-2)
    for a, b in zip(tensor_lr, float_lr):
        assert torch.equal(a, b)


def test_fused_kernel_refuses_a_host_step(clean_device_env):
    """A fused kernel's float-lr overload is device-checked by the dispatcher: host `step` tensors (as XTuner's
    SwapAdamW keeps them) raise torch's error naming state_steps, as CUDA raises it."""
    with simulator.activate() as sim:
        dev = sim.torch_device()
        p = torch.nn.Parameter(torch.randn(8, device=dev))
        p.grad = torch.randn(8, device=dev)
        opt = torch.optim.AdamW([p], fused=True)
        opt.step()
        opt.state[p]["step"] = opt.state[p]["step"].cpu()
        refused = "Expected all tensors to be on the same device, but got state_steps is on cpu"
        with pytest.raises(RuntimeError, match=refused):
            opt.step()


def test_fused_kernel_refuses_a_host_lr_of_two_elements(clean_device_env):
    with simulator.activate() as sim:
        dev = sim.torch_device()
        p = torch.nn.Parameter(torch.randn(8, device=dev))
        p.grad = torch.randn(8, device=dev)
        state = [torch.zeros(8, device=dev) for _ in range(2)]
        step = [torch.zeros((), device=dev)]
        hyper = dict(beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        with pytest.raises(RuntimeError, match="2 elements cannot be converted to Scalar"):
            torch._fused_adamw_([p.detach()], [p.grad], [state[0]], [state[1]], [], step, lr=torch.ones(2, device="cpu"),
                                **hyper)  # fmt: skip


def test_tensor_iterator_ops_take_a_host_scalar_only(clean_device_env):
    with simulator.activate() as sim:
        t = torch.ones(3, device=sim.torch_device())
        t.mul_(torch.tensor(2.0, device="cpu"))  # a 0-dim CPU scalar: fine on CUDA
        assert torch.equal(t.cpu(), torch.full((3,), 2.0, device="cpu"))
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            t.mul_(torch.tensor([2.0], device="cpu"))


def _ids(module: torch.nn.Module) -> list[int]:
    return [id(p) for p in module.parameters()]


def _meta_linear() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Linear(2, 3)


# (name, build, move, whether CUDA keeps the Parameter objects)
MOVES = [
    ("to_empty_from_meta", _meta_linear, lambda m, d: m.to_empty(device=d), False),
    ("host_to_device", lambda: torch.nn.Linear(2, 3, device="cpu"), lambda m, d: m.to(d), True),
    ("cuda", lambda: torch.nn.Linear(2, 3, device="cpu"), lambda m, d: m.cuda(), True),
    ("device_to_host", lambda: torch.nn.Linear(2, 3), lambda m, d: m.cpu(), True),
    ("dtype_on_device", lambda: torch.nn.Linear(2, 3), lambda m, d: m.half(), True),
    ("device_to_meta", lambda: torch.nn.Linear(2, 3), lambda m, d: m.to("meta"), False),
]


@pytest.mark.parametrize(("build", "move", "keeps"), [m[1:] for m in MOVES], ids=[m[0] for m in MOVES])
def test_module_moves_keep_parameters_where_cuda_does(build, move, keeps, clean_device_env):
    with simulator.activate() as sim:
        module = build()
        if not module.weight.is_meta:
            module.weight.grad = torch.ones_like(module.weight)
        before = _ids(module)
        move(module, sim.torch_device())
        assert (_ids(module) == before) is keeps
        assert all(isinstance(p, torch.nn.Parameter) for p in module.parameters())
        if module.weight.grad is not None:
            assert module.weight.grad.device == module.weight.device


@pytest.mark.parametrize("flag", ["overwrite", "swap"])
def test_module_moves_follow_torch_future_flags(flag, clean_device_env):
    """set_overwrite_module_params_on_conversion(True): new Parameters on CUDA; swap_module_params: kept."""
    setter = getattr(torch.__future__, f"set_{flag}_module_params_on_conversion")
    with simulator.activate() as sim:
        setter(True)
        try:
            module = torch.nn.Linear(2, 3, device="cpu")
            before = _ids(module)
            module.to(sim.torch_device())
        finally:
            setter(False)
        assert (_ids(module) == before) is (flag == "swap")


def _fused_meta_flow(cls: type, dev: torch.device, wrap: bool) -> None:
    """torch's test_fused_error_on_params_on_meta: torch's own error for meta params, then `to_empty` gives the
    model new params, so the optimizer (holding the meta ones, without grads) steps nothing."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1))
    opt = cls(model.parameters(), fused=True, **_kwargs(cls))
    if wrap:
        opt = swapopt.SwapOptimizer(opt)
    with torch.device("meta"):
        for p in model.parameters():
            p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point Tensors"):
        opt.step()
    opt.zero_grad(set_to_none=True)
    model.to_empty(device=dev)
    for p in model.parameters():
        p.grad = torch.rand_like(p)
    opt.step()


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "swapped"])
@pytest.mark.parametrize("cls", FUSED, ids=lambda c: c.__name__)
def test_fused_optimizer_on_meta_params(cls, wrap, clean_device_env):
    with simulator.activate() as sim:
        _fused_meta_flow(cls, sim.torch_device(), wrap)


def test_swap_optimizer_on_meta_params_gives_torchs_error(clean_device_env):
    """Adagrad builds its states at construction (meta ones for meta params): the wrapper leaves them to torch
    instead of copying them into pinned memory ("Cannot copy out of meta tensor")."""
    with simulator.activate():
        with torch.device("meta"):
            model = torch.nn.Linear(2, 3)
        opt = swapopt.SwapOptimizer(torch.optim.Adagrad(model.parameters(), fused=True))
        with torch.device("meta"):
            for p in model.parameters():
                p.grad = torch.rand_like(p)
        torchs = "requires all the params to be floating point Tensors of supported devices"
        with pytest.raises(RuntimeError, match=torchs):
            opt.step()
