"""Lightning: SwapAdamW from configure_optimizers, checkpoint, resume with SwapSingleDeviceStrategy: states are
never handed to _optimizer_to_device, stay on the host, and training ends bitwise where plain AdamW ends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import lightning.pytorch.strategies.strategy as strategy_module  # noqa: E402
from lightning.pytorch.accelerators import Accelerator  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402
from dist_utils import assert_host_states  # noqa: E402

import device  # noqa: E402
import simdevice  # noqa: E402
from swapopt import SwapAdamW, SwapOptimizer  # noqa: E402
from swapopt.integrations.lightning import SwapSingleDeviceStrategy, keep_states_on_host  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")


class Regressor(L.LightningModule):
    def __init__(self, swap: bool) -> None:
        super().__init__()
        self.swap = swap
        gen = torch.Generator().manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.swap:
            return SwapAdamW(self.parameters(), lr=1e-2, weight_decay=0.1, swap_optimizer_times=2)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(16, 8, generator=gen)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)  # 2 steps per epoch


class HostStates(Callback):
    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._check(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._check(trainer)

    def _check(self, trainer) -> None:
        opt = trainer.strategy.optimizers[0]
        assert isinstance(opt, SwapOptimizer)
        opt.wait_for_swap_out()
        self.checked += assert_host_states(opt)


def fit(root, module, strategy, epochs: int, ckpt_path=None, callbacks=()):
    trainer = L.Trainer(
        default_root_dir=str(root), max_epochs=epochs, accelerator=SimAccelerator(), strategy=strategy, logger=False,
        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        callbacks=[ModelCheckpoint(dirpath=str(root), save_top_k=-1, every_n_epochs=1), *callbacks],
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


class SimAccelerator(Accelerator):
    """The simulated device as a Lightning accelerator (Lightning's API for accelerators it does not ship):
    one device, the simulator's current one."""

    def setup_device(self, device: torch.device) -> None:
        device_module().set_device(device.index or 0)

    def teardown(self) -> None:
        pass

    @staticmethod
    def parse_devices(devices):
        return 1

    @staticmethod
    def get_parallel_devices(devices):
        return [device.torch_device()]

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return device.is_simulated()

    @staticmethod
    def name() -> str:
        return "sim"

    def get_device_stats(self, device):
        return {}


def device_module():
    return device.get_torch_device_module()


@pytest.fixture
def on_accelerator(sim):
    """Lightning on the simulated accelerator (SimAccelerator, strategies on its device). torch's default device
    is the host's, as in a training script: Lightning places the model and the batches."""
    with simdevice.host_default():
        yield sim


def test_resume_keeps_states_on_host_and_matches_adamw(on_accelerator, tmp_path, monkeypatch):
    moved = []
    real = strategy_module._optimizer_to_device
    monkeypatch.setattr(strategy_module, "_optimizer_to_device", lambda opt, dev: (moved.append(opt), real(opt, dev)))

    plain = Regressor(swap=False)
    fit(tmp_path / "plain", plain, SingleDeviceStrategy(device=device.torch_device()), 2)

    first = Regressor(swap=True)
    fit(tmp_path / "swap", first, SwapSingleDeviceStrategy(device=device.torch_device()), 1)
    ckpt = tmp_path / "swap" / "epoch=0-step=2.ckpt"
    assert ckpt.is_file()

    # Stock strategy: Lightning hands the swapped states to _optimizer_to_device on resume (the bug).
    moved.clear()
    fit(tmp_path / "stock", Regressor(swap=True), SingleDeviceStrategy(device=device.torch_device()), 2, ckpt_path=ckpt)
    assert any(isinstance(o, SwapOptimizer) for o in moved)

    moved.clear()
    hook = HostStates()
    resumed = Regressor(swap=True)
    trainer = fit(tmp_path / "resumed", resumed, SwapSingleDeviceStrategy(device=device.torch_device()), 2, ckpt_path=ckpt,
                  callbacks=[hook])
    assert not any(isinstance(o, SwapOptimizer) for o in moved)
    assert hook.checked and trainer.global_step == 4
    assert trainer.strategy.optimizers[0].swap_stats().h2d_bytes > 0
    for a, b in zip(resumed.parameters(), plain.parameters()):
        assert torch.equal(a, b)


def test_keep_states_on_host_rehomes_device_states(sim):
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    opt = SwapAdamW(params, lr=1e-2, swap_optimizer_times=2)
    for p in params:
        p.grad = torch.ones(5)
    opt.step()
    opt.wait_for_swap_out()
    on_device = torch.empty(5)  # created while the simulator is active: device memory
    on_device.copy_(opt.state[params[0]]["exp_avg"])
    opt.state[params[0]]["exp_avg"] = on_device
    assert not device.is_host_tensor(on_device)
    assert keep_states_on_host([opt, torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)]) == 1
    home = opt.state[params[0]]["exp_avg"]
    assert device.is_host_tensor(home) and torch.equal(home, on_device.cpu())
    opt.step()  # the re-homed tensor is what the next step streams
    assert keep_states_on_host([opt]) == 0
