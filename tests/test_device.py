"""device: detection order, SWAPOPT_DEVICE, the NPU path, host memory helpers, zero cost when inactive."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import device
import simdevice as simulator


def test_plain_machine_is_cpu(clean_device_env):
    assert device.get_device() == "cpu"
    assert device.get_torch_device_module() is torch.cpu
    assert device.torch_device() == torch.device("cpu")
    t = device.pinned_empty((2, 3), torch.bfloat16)
    assert t.shape == (2, 3) and t.dtype == torch.bfloat16
    assert device.is_host_tensor(t) and device.is_host_tensor(torch.ones(1))
    device.record_stream(t, None)  # nothing to record on plain CPU


@pytest.mark.parametrize("value", ["gpu", "cuda:0", "tpu", "simulator"])
def test_unknown_env_value_lists_choices(clean_device_env, value):
    clean_device_env.setenv("SWAPOPT_DEVICE", value)
    with pytest.raises(ValueError) as err:
        device.get_device()
    for choice in device.CHOICES:
        assert choice in str(err.value)


def test_env_cuda_absent_says_what_is_missing(clean_device_env):
    clean_device_env.setattr(torch.cuda, "is_available", lambda: False)
    clean_device_env.setenv("SWAPOPT_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match="torch.cuda.is_available"):
        device.get_device()


def test_env_npu_absent_names_torch_npu_and_cann(clean_device_env):
    clean_device_env.setitem(sys.modules, "torch_npu", None)  # import fails
    clean_device_env.setenv("SWAPOPT_DEVICE", "npu")
    with pytest.raises(RuntimeError) as err:
        device.get_device()
    assert "torch_npu" in str(err.value) and "CANN" in str(err.value)


def test_env_values_select(clean_device_env):
    clean_device_env.setenv("SWAPOPT_DEVICE", " CPU ")
    assert device.get_device() == "cpu"
    with simulator.activate():
        assert device.get_device() == "cpu"  # an explicit choice wins over an active simulator
    clean_device_env.setenv("SWAPOPT_DEVICE", "auto")
    assert device.get_device() == "cpu"


@pytest.fixture
def mocked_npu(clean_device_env):
    """torch_npu importable and torch.npu a simulator, as after `import torch_npu` on an Ascend host."""
    npu = simulator.SimDevice("910b", flavour=simulator.test_flavour())
    clean_device_env.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    clean_device_env.setattr(torch, "npu", npu, raising=False)
    return npu


def test_npu_detected_before_cuda(mocked_npu, clean_device_env):
    # transfer_to_npu makes torch.cuda answer for the NPU: detection must still say "npu".
    clean_device_env.setattr(torch, "cuda", mocked_npu)
    assert device.get_device() == "npu"
    assert device.get_torch_device_module() is mocked_npu
    clean_device_env.setenv("SWAPOPT_DEVICE", "npu")
    assert device.get_device() == "npu"


def test_npu_not_available_falls_through(mocked_npu, clean_device_env):
    clean_device_env.setattr(mocked_npu, "is_available", lambda: False)
    assert device.get_device() == "cpu"


def test_cuda_detected(clean_device_env):
    clean_device_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_device_env.setitem(sys.modules, "torch_npu", None)
    assert device.get_device() == "cuda"
    assert device.get_torch_device_module() is torch.cuda


def test_active_simulator_is_the_device(sim):
    # The simulator presents the device type of its flavour (cuda unless SWAPOPT_SIM_PRESET picks npu)
    assert device.is_simulated() and device.get_device() == sim.flavour in ("cuda", "npu")
    assert device.get_torch_device_module() is sim
    assert simulator.active() is sim
    assert device.torch_device() == torch.device(simulator.backend_name(sim.flavour), 0)
    pinned = device.pinned_empty(4)
    on_device = torch.empty(4, device=device.torch_device())
    assert device.is_host_tensor(pinned) and not device.is_host_tensor(on_device)
    assert sim.memory_allocated() == 16


def test_nested_simulators_scope(sim):
    with simulator.activate("910b") as inner:
        assert device.get_torch_device_module() is inner
        x = torch.empty(8)
        assert x.numel() == 8 and inner.memory_allocated() == 32 and sim.memory_allocated() == 0
    assert device.get_torch_device_module() is sim


def test_env_sim_uses_one_process_wide_simulator(clean_device_env):
    clean_device_env.setenv("SWAPOPT_DEVICE", "sim")
    with simulator.activate() as scoped:  # a scoped simulator still wins inside its block
        assert device.get_torch_device_module() is scoped
    stack_before = len(_get_current_dispatch_mode_stack())
    try:
        first = device.get_torch_device_module()
        assert isinstance(first, simulator.SimDevice)
        assert device.get_torch_device_module() is first
        assert device.is_simulated() and device.get_device() == first.flavour in ("cuda", "npu")
    finally:
        # The process-wide simulator is never exited in real use; undo it here so other tests run unmocked.
        if simulator._PROCESS and len(_get_current_dispatch_mode_stack()) > stack_before:
            simulator._PROCESS.pop()._stop()


def test_inactive_simulator_pushes_no_mode(clean_device_env):
    base = _get_current_dispatch_mode_stack()
    if not simulator._PROCESS:  # under SWAPOPT_DEVICE=sim the process-wide simulator stays active
        assert base == []
    with simulator.activate() as s:
        assert _get_current_dispatch_mode_stack() == [*base, s._mode]
        torch.ones(3).add_(1)
    assert _get_current_dispatch_mode_stack() == base
    assert simulator.active() is (simulator._PROCESS[0] if simulator._PROCESS else None)
    before = s.timeline
    torch.ones(3).add_(1)  # not seen
    assert s.timeline == before and s.memory_allocated() == 0


def test_dtensor_local_tensor_is_inspected(sim):
    class FakeDTensor(torch.Tensor):
        pass

    host = device.pinned_empty(4)
    wrapper = torch.empty(4, device="cpu").as_subclass(FakeDTensor)  # the wrapper itself holds no data
    wrapper._local_tensor = host
    assert device.is_host_tensor(wrapper)
    wrapper._local_tensor = torch.empty(4)
    assert not device.is_host_tensor(wrapper)


def test_record_stream_dispatch(sim, clean_device_env):
    side = sim.Stream()
    t = torch.empty(4)
    device.record_stream(t, side)
    assert side.actor in sim._lookup(t.untyped_storage()).recorded

    calls = []

    class Recording(torch.Tensor):
        def record_stream(self, stream):
            calls.append(stream)

    clean_device_env.setenv("SWAPOPT_DEVICE", "cuda")
    clean_device_env.setattr(torch.cuda, "is_available", lambda: True)
    device.record_stream(torch.empty(1, device="cpu").as_subclass(Recording), "s")
    assert calls == ["s"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_helpers(clean_device_env):
    assert device.get_device() == "cuda" and device.get_torch_device_module() is torch.cuda
    dev = device.torch_device()
    assert dev.type == "cuda" and dev.index == torch.cuda.current_device()
    host = device.pinned_empty((4, 4), torch.float16)
    assert host.is_pinned() and device.is_host_tensor(host)
    on_device = torch.empty(4, device=dev)
    assert not device.is_host_tensor(on_device)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_device.fill_(1.0)
    device.record_stream(on_device, side)
    torch.cuda.synchronize()
