"""Torch's own optimizers behave under the simulator exactly as without it.

The flows of torch's optimizer tests (steps, state_dict deepcopy and load, torch.save / torch.load,
loading host states into device params, tensor lr of every rank, hooks, complex params, fused /
foreach / for-loop) run on every optimizer of torch's `optim_db`, once plain and once with the
simulator active. Every case that runs without the simulator must run with it and give bitwise equal
params and states; the few cases torch itself refuses are named (`_REFUSED`) and must be refused the same
way with the simulator. Nothing is skipped: any other exception fails the case.
"""

from __future__ import annotations

import copy
import io
import re
from collections.abc import Callable

import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

import simdevice as simulator

STEPS = 2


def _params(complex_ok: bool, matrix_only: bool) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    if not matrix_only:
        params.append(torch.nn.Parameter(torch.randn(3)))
        if complex_ok:
            params.append(torch.nn.Parameter(torch.randn(2, 2, dtype=torch.complex64)))
    return params


def _closure(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = sum((torch.view_as_real(p) if p.is_complex() else p).sin().square().sum() for p in params)
        loss.backward()
        return loss

    return closure


def _step(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    closure = _closure(opt, params)
    if isinstance(opt, torch.optim.LBFGS):
        opt.step(closure)
    else:
        closure()
        opt.step()


def _snapshot(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Params and every state tensor, as plain host clones (compared bitwise afterwards)."""
    out = [p.detach().clone() for p in params]
    for p in params:
        for key in sorted(opt.state.get(p, {})):
            value = opt.state[p][key]
            if isinstance(value, torch.Tensor):
                out.append(value.detach().clone())
    return out


def _fresh(case: dict, params: list[torch.Tensor]) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    return case["cls"](twins, **case["kwargs"]), twins


def flow_steps(case: dict) -> list[torch.Tensor]:
    params = _params(case["complex"], case["matrix_only"])
    opt = case["cls"](params, **case["kwargs"])
    for _ in range(STEPS + 1):
        _step(opt, params)
    return _snapshot(opt, params)


def _resume(case: dict, transfer: Callable[[dict], dict]) -> list[torch.Tensor]:
    """Step, hand the state dict through `transfer` into a fresh optimizer, step both, return both."""
    params = _params(case["complex"], case["matrix_only"])
    opt = case["cls"](params, **case["kwargs"])
    for _ in range(STEPS):
        _step(opt, params)
    other, twins = _fresh(case, params)
    other.load_state_dict(transfer(opt.state_dict()))
    _step(opt, params)
    _step(other, twins)
    return _snapshot(opt, params) + _snapshot(other, twins)


def flow_deepcopy_load(case: dict) -> list[torch.Tensor]:
    return _resume(case, copy.deepcopy)


def _through_file(state: dict, **load_kwargs) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, **load_kwargs)


def flow_torch_load(case: dict) -> list[torch.Tensor]:
    return _resume(case, _through_file)


def flow_torch_load_to_host(case: dict) -> list[torch.Tensor]:
    """Loaded as host tensors: torch's load_state_dict casts them to param.device (device memory)."""
    return _resume(case, lambda state: _through_file(state, map_location="cpu"))


def _tensor_lr(rank: int, host: bool = False) -> Callable[[dict], list[torch.Tensor]]:
    """A tensor lr of `rank` on the default device (the simulated one, as users write it), or on the host
    (host=True: torch's test_tensor_lr passes both; CUDA's fused kernels read a host lr with lr.item())."""

    def flow(case: dict) -> list[torch.Tensor]:
        lr = float(case["kwargs"].get("lr", 1e-3))
        lr = torch.tensor(lr, device="cpu" if host else None).reshape([1] * rank)
        return flow_steps({**case, "kwargs": {**case["kwargs"], "lr": lr}})

    flow.__name__ = f"flow_tensor_lr_rank{rank}{'_host' if host else ''}"
    return flow


def flow_hooks(case: dict) -> list[torch.Tensor]:
    params = _params(case["complex"], case["matrix_only"])
    opt = case["cls"](params, **case["kwargs"])
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: [p.data.mul_(0.5) for p in params] and None)
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("state_dict"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load"))
    for _ in range(STEPS):
        _step(opt, params)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _step(opt, params)
    assert calls.count("pre") >= STEPS + 1 and "state_dict" in calls and "load" in calls
    return _snapshot(opt, params)


FLOWS = [flow_steps, flow_deepcopy_load, flow_torch_load, flow_torch_load_to_host, flow_hooks] + [
    _tensor_lr(rank) for rank in (0, 1, 2)
] + [_tensor_lr(rank, host=True) for rank in (1, 2)]


# What torch refuses in these flows, by name: foreach Adam/AdamW take a tensor lr only when capturable.
_REFUSED = (ValueError, "lr as a Tensor is not supported for capturable=False and foreach=True")


def _refused(cls: type, kwargs: dict, flow: Callable) -> tuple[type, str] | None:
    if (
        cls in (torch.optim.Adam, torch.optim.AdamW)
        and kwargs.get("foreach")
        and not kwargs.get("capturable")
        and flow.__name__.startswith("flow_tensor_lr")
    ):
        return _REFUSED
    return None


def _cases() -> list:
    """Every optimizer x implementation; inputs and flows sampled (deterministically) to stay quick."""
    cases = []
    for info in optim_db:
        if info.only_supports_sparse_grads:
            continue
        inputs = info.optim_inputs_func(device="cpu")
        impls = [None] + (["foreach"] if "foreach" in info.supported_impls else [])
        impls += ["fused"] if "fused" in info.supported_impls and "cpu" in info.supports_fused_on else []
        for impl in impls:
            for k, inp in enumerate(inputs):
                kwargs = dict(inp.kwargs)
                if impl is not None:
                    kwargs[impl] = True
                elif "foreach" in info.supported_impls:
                    kwargs["foreach"] = False
                # The first input runs every flow; each other input one flow, in turn. LBFGS runs its closure up to
                # max_iter times a step (most of this file's time when it ran every flow): one flow per input.
                every = k == 0 and info.optim_cls is not torch.optim.LBFGS
                flows = FLOWS if every else [FLOWS[k % len(FLOWS)]]
                for flow in flows:
                    case = {
                        "cls": info.optim_cls,
                        "kwargs": kwargs,
                        "complex": info.supports_complex and impl != "fused",
                        "matrix_only": info.optim_cls.__name__ == "Muon",
                        "refused": _refused(info.optim_cls, kwargs, flow),
                    }
                    name = f"{info.optim_cls.__name__}-{impl or 'forloop'}-{inp.desc}-{flow.__name__[5:]}"
                    cases.append(pytest.param(case, flow, id=name.replace(" ", "_")))
    return cases


CASES = _cases()


@pytest.mark.parametrize(("case", "flow"), CASES)
def test_flow_runs_the_same_with_the_simulator(case, flow, clean_device_env):
    if case["refused"] is not None:
        error, message = case["refused"]
        with pytest.raises(error, match=re.escape(message)):
            flow(case)
        with simulator.activate(), pytest.raises(error, match=re.escape(message)):
            flow(case)
        return
    plain = flow(case)
    with simulator.activate() as sim:
        simulated = flow(case)
        assert not sim.is_host(simulated[0])  # params live in simulated device memory, as on CUDA
        sim.synchronize()
    assert len(simulated) == len(plain)
    for a, b in zip(plain, simulated):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


def test_most_cases_run():
    """Refusals must stay the exception: the flows are real for nearly every optimizer."""
    assert len(CASES) >= 300
    refused = [p.id for p in CASES if p.values[0]["refused"] is not None]
    # Only torch's one refusal: foreach Adam/AdamW with a tensor lr, on the first input's five tensor-lr flows.
    assert 0 < len(refused) <= 10 and all(re.match(r"AdamW?-foreach-.*-tensor_lr_rank", r) for r in refused), refused
