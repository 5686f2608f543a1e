"""What a verify run ran on: torch, the driver or CANN, the device, its host link, host memory.

Each figure is asked of the tool that knows it (torch, nvidia-smi, npu-smi, CANN's install files); one that
cannot be found is None and printed as "-", never guessed.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from pydantic import BaseModel

import device

# CANN writes its version into these files (the toolkit's install info, or the runtime's version.info).
_CANN_HOMES = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
_CANN_DEFAULT = Path("/usr/local/Ascend/ascend-toolkit/latest")
_CANN_FILES = ("version.cfg", "ascend_toolkit_install.info", "runtime/version.info", "compiler/version.info")


class Environment(BaseModel):
    kind: str  # "cuda", "npu" or "sim"
    simulated: bool
    device_name: str
    device_count: int
    device_memory_bytes: int | None = None
    torch: str
    torch_cuda: str | None = None  # the CUDA torch was built with
    torch_npu: str | None = None
    driver: str | None = None  # NVIDIA driver or NPU driver
    cann: str | None = None
    link: str | None = None  # "PCIe gen 5 x16 (max gen 5 x16)" where the tool reports it
    host_ram_bytes: int | None = None
    cpu_count: int | None = None
    python: str
    platform: str

    def lines(self) -> list[str]:
        def gib(n: int | None) -> str:
            return "-" if n is None else f"{n / 2**30:.1f} GiB"

        return [
            f"device: {self.device_name} ({self.kind}{', simulated' if self.simulated else ''}), "
            f"{self.device_count} visible, memory {gib(self.device_memory_bytes)}",
            f"torch {self.torch}" + (f", CUDA {self.torch_cuda}" if self.torch_cuda else "")
            + (f", torch_npu {self.torch_npu}" if self.torch_npu else ""),
            f"driver {self.driver or '-'}" + (f", CANN {self.cann}" if self.kind == "npu" else ""),
            f"link: {self.link or '-'}",
            f"host: {gib(self.host_ram_bytes)} RAM, {self.cpu_count or '-'} CPUs, {self.platform}, "
            f"Python {self.python}",
        ]


def _run(cmd: list[str]) -> str | None:
    """stdout of a tool, or None when it is missing or fails (a missing figure, not an error)."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def nvidia_smi(index: int = 0) -> dict[str, str]:
    """Driver, name and PCIe link of one GPU from nvidia-smi (empty when it is not there)."""
    keys = ("driver_version", "name", "pcie.link.gen.current", "pcie.link.gen.max", "pcie.link.width.current",
            "pcie.link.width.max")
    out = _run(["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(keys)}", "--format=csv,noheader,nounits"])
    if not out:
        return {}
    values = [v.strip() for v in out.splitlines()[0].split(",")]
    return {k: v for k, v in zip(keys, values) if v and "N/A" not in v and "Not Supported" not in v}


def pcie_link(smi: dict[str, str]) -> str | None:
    gen, width = smi.get("pcie.link.gen.current"), smi.get("pcie.link.width.current")
    if not gen and not width:
        return None
    text = f"PCIe gen {gen or '?'} x{width or '?'}"
    if smi.get("pcie.link.gen.max") or smi.get("pcie.link.width.max"):
        text += f" (max gen {smi.get('pcie.link.gen.max', '?')} x{smi.get('pcie.link.width.max', '?')})"
    # An idle GPU drops its link to a lower generation to save power: read it during load for the real one.
    return text + "; read at idle, a GPU may lower its link generation until loaded"


def cann_version() -> str | None:
    """The CANN toolkit version from its install files (None when no toolkit is found)."""
    homes = [Path(os.environ[v]) for v in _CANN_HOMES if os.environ.get(v)] + [_CANN_DEFAULT]
    for home in homes:
        for name in _CANN_FILES:
            path = home / name
            try:
                text = path.read_text()
            except OSError:
                continue
            for line in text.splitlines():
                key, _, value = line.partition("=")
                if key.strip().lower() in ("version", "runtime_running_version", "toolkit_version") and value.strip():
                    return value.strip().strip('"[]')
    return None


def npu_driver() -> str | None:
    out = _run(["npu-smi", "info"])
    if not out:
        return None
    for line in out.splitlines():
        if "Version" in line and ":" in line:
            return line.split(":", 1)[1].strip().strip("|").strip()
    return None


def host_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def collect(label: str) -> Environment:
    """The environment of the current device (or simulator); `label` names the device in the report."""
    mod = device.get_torch_device_module()
    simulated = device.is_simulated()
    kind = "sim" if simulated else device.get_device()
    try:
        name = mod.get_device_name(mod.current_device())
    except Exception:  # noqa: BLE001 - a name is cosmetic; the label stands in
        name = label
    if simulated:
        name = label
    try:
        memory = int(mod.mem_get_info()[1])
    except Exception:  # noqa: BLE001 - not every runtime reports it
        memory = None
    env = Environment(
        kind=kind, simulated=simulated, device_name=name, device_count=int(mod.device_count()),
        device_memory_bytes=memory, torch=torch.__version__, torch_cuda=torch.version.cuda,
        host_ram_bytes=host_ram_bytes(), cpu_count=os.cpu_count(), python=sys.version.split()[0],
        platform=platform.platform(terse=True),
    )
    if kind == "cuda":
        smi = nvidia_smi(mod.current_device())
        env.driver = smi.get("driver_version")
        env.link = pcie_link(smi)
    elif kind == "npu":
        torch_npu = sys.modules.get("torch_npu")
        env.torch_npu = getattr(torch_npu, "__version__", None)
        env.cann = cann_version()
        env.driver = npu_driver()
    return env
