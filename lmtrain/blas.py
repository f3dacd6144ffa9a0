"""The workspace cuBLAS gets for matrix products (``model.blas_workspace``).

With a workspace (PyTorch's default), cuBLAS on Hopper runs most of the model's bf16 GEMMs (its ``nvjet_*_coop*``
kernels) after a 4-byte ``cudaMemsetAsync`` into that workspace: one more GPU operation per product. The memset takes
under a microsecond, but the GPU idles a few microseconds around it, and a 2.7B step has about 256 such products. With
no workspace cuBLAS runs the same kernels (same names, same times) without the memset. Measured on an H200
(``benchmarks/2026-11-28-H200x2-blas-workspace.md``):

- a CUDA graph of eight 2.7B blocks at 2,048 tokens: 64 fewer operations, 1.7% less time per replay;
- ``configs/2.7B_bf16_fast.yaml`` (one CUDA graph per step): 2.0% faster; ``small_bf16_fast.yaml``: the same;
- eager steps, where the host launches every product: 2.7B 0.2-0.5% faster, but the small model at context 512,
  whose step the host bounds, 36% slower (45.3 against 33.4 ms, one measurement): a cost on the host's side of
  each product, which a GPU-bound or graphed step hides.

So ``auto`` (the default) gives cuBLAS no workspace only where the host does not launch the products one by one,
under ``cuda_graphs``, and not with ``float8`` (its GEMMs are cuBLASLt products, whose workspace this PyTorch takes
from the same pool: not measured without one). ``none`` and ``default`` force either.

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


def resolve_blas_workspace(setting: str, cuda_graphs: bool, float8: str = "none") -> str:
    """``none`` or ``default``: ``setting`` itself, or for ``auto`` ``none`` under ``cuda_graphs`` without float8 and
    ``default`` otherwise (module docstring)."""
    if setting != "auto":
        return setting
    return "none" if cuda_graphs and float8 == "none" else "default"


def apply_blas_workspace(setting: str) -> str | None:
    """Apply ``model.blas_workspace``; returns a one-line note when the setting cannot take effect as asked.

    ``none`` sets :data:`NO_WORKSPACE` in ``os.environ``. A variable already set in the environment to another value
    is left as it is (the user's choice wins) and named in the note. Where CUDA is initialised already, the note
    says the setting applies only if no matrix product has run on the GPU yet (cuBLAS has read its size then).
    ``default`` changes nothing.
    """
    if setting == "default":
        return None
    if setting != "none":
        raise ValueError(f"unknown blas_workspace {setting!r}: use none or default")
    kept = {name: os.environ[name] for name, value in NO_WORKSPACE.items()
            if name in os.environ and os.environ[name] != value}
    for name, value in NO_WORKSPACE.items():
        if name not in kept:
            os.environ[name] = value
    if kept:
        given = ", ".join(f"{name}={value}" for name, value in kept.items())
        return (f"model.blas_workspace: none leaves {given} as the environment sets it; unset it to give cuBLAS no "
                "workspace there.")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return ("model.blas_workspace: none applies only if no matrix product has run on a GPU in this process yet "
                "(cuBLAS reads its workspace size once, when its first handle is made); CUDA is initialised "
                "already.")
    return None


def deterministic_workspace() -> str | None:
    """Give cuBLAS back a workspace PyTorch's deterministic mode accepts, where deterministic algorithms are on (the
    trainer's ``deterministic``) and :func:`apply_blas_workspace` left ``CUBLAS_WORKSPACE_CONFIG`` at ``:0:0``: PyTorch
    then refuses every cuBLAS product unless it is ``:4096:8`` or ``:16:8``. Returns a one-line note when it did."""
    if torch.are_deterministic_algorithms_enabled() and \
            os.environ.get("CUBLAS_WORKSPACE_CONFIG") == NO_WORKSPACE["CUBLAS_WORKSPACE_CONFIG"]:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        return ("model.blas_workspace: none gives way to deterministic algorithms (trainer.deterministic): "
                "CUBLAS_WORKSPACE_CONFIG=:4096:8, the setting PyTorch's deterministic mode requires.")
    return None
