"""lmtrain.flops: the compute dtype of each Lightning precision."""

from __future__ import annotations

import pytest
import torch

from lmtrain.flops import compute_dtype


@pytest.mark.parametrize(("precision", "dtype"), [
    ("bf16-mixed", torch.bfloat16), ("bf16-true", torch.bfloat16), ("16-mixed", torch.float16),
    ("16-true", torch.float16), ("32-true", torch.float32),
])
def test_compute_dtype_of_each_precision(precision: str, dtype: torch.dtype) -> None:
    assert compute_dtype(precision) is dtype
