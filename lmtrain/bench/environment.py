"""The environment a benchmark ran in: library versions, CUDA build, driver and device, for its records."""

from __future__ import annotations

import platform
import subprocess


def environment() -> dict[str, str]:
    """Python, torch, lightning, triton, CUDA (torch build) and driver versions of this process.

    Children of ``lmtrain.bench.runner`` run with the same installation, so the parent's record holds for them.
    """
    import lightning
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
            "CUDA (torch build)": str(torch.version.cuda)}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    info["driver"] = _driver()
    return info


def flash_kernels(shapes: list[tuple[int, int]] | None = None, dtype: str = "bf16", cuda: bool | None = None) -> dict:
    """The FlashAttention settings in force and, per (sequence length, head dim) in ``shapes``, the kernels that serve
    it on this device (``lmtrain.kernels.flash.describe``): what a record needs to say which kernels it measured."""
    import torch

    from lmtrain.kernels.flash import describe

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if cuda is None:
        cuda = torch.cuda.is_available()
    return describe(shapes, device="cuda" if cuda else "cpu", dtype=dtypes.get(dtype, torch.bfloat16))


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return "n/a"
    lines = out.stdout.strip().splitlines()
    return lines[0] if out.returncode == 0 and lines else "n/a"


def device_name(cuda: bool | None = None) -> str:
    """The CUDA device's name, or ``cpu`` (``cuda=None``: whether CUDA is available; initialises CUDA then)."""
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    return torch.cuda.get_device_name() if cuda else "cpu"
