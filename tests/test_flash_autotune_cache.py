"""The pointer kernels' autotuning results go to Triton's cache folder, so a second process skips the tuning."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

# One forward and backward of bf16 attention on the pointer kernels (the TMA and Gluon kernels off), autotuned.
_SCRIPT = """
import torch
from lmtrain.kernels.flash import flash_attention, use_settings

q, k, v = (torch.randn(2, 4, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
with use_settings(gluon="off", tma=False, autotune=True, launch_plans="off"):
    flash_attention(q, k, v, causal=True).sum().backward()
torch.cuda.synchronize()
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_pointer_kernels_ask_triton_to_cache_their_tuning() -> None:
    import triton

    from lmtrain.kernels.flash import pointer
    from lmtrain.kernels.flash.tuning import triton_version

    kernels = (pointer._flash_ptr_fwd, pointer._flash_ptr_bwd_dq, pointer._flash_ptr_bwd_dkdv)
    if triton_version() < (3, 4):  # the argument does not exist yet
        assert pointer._AUTOTUNE_CACHE == {}
        return
    assert pointer._AUTOTUNE_CACHE == {"cache_results": True}
    if triton.knobs.runtime.interpret:
        pytest.skip("the interpreter runs one configuration and never tunes")
    assert [kernel.cache_results for kernel in kernels] == [True, True, True]


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and Triton")
def test_second_process_reads_the_tuning_from_the_cache(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "TRITON_PRINT_AUTOTUNING": "1"}
    env.pop("TRITON_INTERPRET", None)

    def run() -> str:
        done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    first = run()
    names = ("_flash_ptr_fwd", "_flash_ptr_bwd_dq", "_flash_ptr_bwd_dkdv")
    for name in names:
        assert f"Triton autotuning for function {name}" in first, first[-3000:]
        assert list(tmp_path.glob(f"*/{name}.autotune.json")), name
    second = run()
    assert "Triton autotuning for function _flash_ptr" not in second, second[-3000:]
