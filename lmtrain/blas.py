"""The workspace cuBLAS gets for matrix products (``model.blas_workspace``).

With a workspace (PyTorch's default), cuBLAS on Hopper runs most of the model's bf16 GEMMs (its ``nvjet_*_coop*``
kernels) after a 4-byte ``cudaMemsetAsync`` into that workspace: one more GPU operation per product. The memset takes
under a microsecond, but the GPU idles a few microseconds around it, and a 2.7B step has about 256 such products. With
no workspace cuBLAS runs the same kernels (same names, same times) without the memset. Measured on an H200
(``benchmarks/2026-11-28-H200x2-blas-workspace.md``):

- a CUDA graph of eight 2.7B blocks at 2,048 tokens: 64 fewer operations, 1.7% less time per replay;
- ``configs/2.7B_bf16_fast.yaml`` (one CUDA graph per step): 2.0% faster; ``small_bf16_fast.yaml``: the same;
- ``configs/2.7B_bf16_fp8.yaml`` (float8 GEMMs, which are cuBLASLt products, in one CUDA graph): 1.7% faster
  (``benchmarks/2026-11-28-H200-float8-blas-workspace.md``);
- eager steps, where the host launches every product: 2.7B 0.2-0.5% faster, but the small model at context 512,
  whose step the host bounds, slower: 36% on one GPU while another fit shared the host, 3% in a DDP fit over two
  GPUs with the machine to itself (one measurement each): a cost on the host's side of each product, which a
  GPU-bound or graphed step hides.

So ``auto`` (the default) gives cuBLAS no workspace only where the host does not launch the products one by one,
under ``cuda_graphs``. ``none`` and ``default`` force either.

cuBLAS reads the workspace size when PyTorch makes its first handle in the process, from two environment variables:
``CUBLAS_WORKSPACE_CONFIG`` (``:size_KiB:count``; ``:0:0`` removes the memsets) and ``CUBLASLT_WORKSPACE_SIZE`` (KiB;
alone it changed nothing, but PyTorch warns when the cuBLASLt share exceeds the cuBLAS workspace).
:func:`apply_blas_workspace` sets both to zero; ``LMModule`` calls it when it is built, before any product runs.
Processes that Lightning or ``torchrun`` start for other ranks inherit the variables and build their module too.
"""

from __future__ import annotations

import os

import torch

__all__ = ["NO_WORKSPACE", "apply_blas_workspace", "deterministic_workspace", "resolve_blas_workspace"]

#: The environment that gives cuBLAS no workspace.
NO_WORKSPACE = {"CUBLASLT_WORKSPACE_SIZE": "0", "CUBLAS_WORKSPACE_CONFIG": ":0:0"}
#: The ``CUBLAS_WORKSPACE_CONFIG`` values PyTorch's deterministic mode accepts.
DETERMINISTIC_CONFIGS = (":4096:8", ":16:8")
#: True once :func:`apply_blas_workspace` has set :data:`NO_WORKSPACE` in this process (until ``default`` undoes it).
_set_here = False


def resolve_blas_workspace(setting: str, cuda_graphs: bool) -> str:
    """``none`` or ``default``: ``setting`` itself, or for ``auto`` ``none`` under ``cuda_graphs`` and ``default``
    otherwise (module docstring)."""
    if setting != "auto":
        return setting
    return "none" if cuda_graphs else "default"


def apply_blas_workspace(setting: str, cuda_graphs: bool = False) -> str | None:
    """Apply ``model.blas_workspace`` (``auto`` resolved for ``cuda_graphs`` by
    :func:`resolve_blas_workspace`); returns a one-line note when the setting cannot take effect as asked.

    ``none`` sets :data:`NO_WORKSPACE` in ``os.environ``. Where the environment sets either variable to another value,
    neither is set (the user's choice wins) and the note names it; silently so for the values PyTorch's
    deterministic mode requires while it is on (``trainer.deterministic`` has Lightning set
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8``). ``default`` removes the variables where this module set them earlier in
    the process. Either way, where CUDA is initialised already the note says the setting applies only if no matrix
    product has run on the GPU yet (cuBLAS reads its workspace size once, when its first handle is made).
    """
    global _set_here
    setting = resolve_blas_workspace(setting, cuda_graphs)
    if setting not in ("none", "default"):
        raise ValueError(f"unknown blas_workspace {setting!r}: use auto, none or default")
    ours = all(os.environ.get(name) == value for name, value in NO_WORKSPACE.items())
    if setting == "default":
        if not (ours and _set_here):
            return None
        for name in NO_WORKSPACE:
            os.environ.pop(name, None)
        _set_here = False
        return _too_late()
    if ours:
        return None
    kept = {name: os.environ[name] for name, value in NO_WORKSPACE.items() if name in os.environ
            and os.environ[name] != value}
    if kept:
        if torch.are_deterministic_algorithms_enabled() and set(kept) == {"CUBLAS_WORKSPACE_CONFIG"} and \
                kept["CUBLAS_WORKSPACE_CONFIG"] in DETERMINISTIC_CONFIGS:
            return None
        given = ", ".join(f"{name}={value}" for name, value in kept.items())
        return (f"model.blas_workspace: none leaves cuBLAS its workspace: the environment sets {given}; unset it to "
                "give cuBLAS none.")
    os.environ.update(NO_WORKSPACE)
    _set_here = True
    return _too_late()


def _too_late() -> str | None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return ("model.blas_workspace applies only if no matrix product has run on a GPU in this process yet (cuBLAS "
                "reads its workspace size once, when its first handle is made); CUDA is initialised already.")
    return None


def deterministic_workspace() -> str | None:
    """Give cuBLAS back a workspace PyTorch's deterministic mode accepts, where deterministic algorithms are on and
    ``CUBLAS_WORKSPACE_CONFIG`` is still ``:0:0`` (PyTorch then refuses every cuBLAS product unless it is ``:4096:8``
    or ``:16:8``). Lightning's ``Trainer(deterministic=True)`` sets ``:4096:8`` itself; this covers deterministic mode
    switched on otherwise (``torch.use_deterministic_algorithms``). Returns a one-line note when it did."""
    if torch.are_deterministic_algorithms_enabled() and \
            os.environ.get("CUBLAS_WORKSPACE_CONFIG") == NO_WORKSPACE["CUBLAS_WORKSPACE_CONFIG"]:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = DETERMINISTIC_CONFIGS[0]
        return ("model.blas_workspace: none gives way to deterministic algorithms: "
                f"CUBLAS_WORKSPACE_CONFIG={DETERMINISTIC_CONFIGS[0]}, a setting PyTorch's deterministic mode requires.")
    return None
