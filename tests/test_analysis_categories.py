"""Kernel categories (lmtrain.analysis.categories) on real kernel names: every shipped kernel has a home."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmtrain.analysis.categories import CATEGORIES, categorize, inductor_category, own_kernels
from lmtrain.analysis.kernels import records_from_trace, short_name, summarize
from lmtrain.attention import kernel_names
from lmtrain.kernels.master_adamw import KERNEL_NAMES

#: tests/data/kernel_names.tsv: names from H100 traces (eager, compiled, CUDA graphs, FSDP2), cuBLAS / cuDNN / NCCL
#: / inductor naming and CPU operators, each with its category.
REAL_NAMES: list[tuple[str, str]] = [
    (name, category) for category, name in (
        line.split("\t", 1) for line in (Path(__file__).parent / "data" / "kernel_names.tsv").read_text().splitlines()
        if line and not line.startswith("#"))]


@pytest.mark.parametrize(("name", "category"), REAL_NAMES, ids=[short_name(n, 40) for n, _ in REAL_NAMES])
def test_categorize_real_names(name: str, category: str) -> None:
    assert categorize(name) == category


def test_real_names_cover_every_category() -> None:
    assert {c for _, c in REAL_NAMES} == set(CATEGORIES)


def test_every_own_kernel_is_named_by_the_registry() -> None:
    """lmtrain's kernels get their category from the exported names, not from a pattern over names."""
    registry = {name for names in kernel_names().values() for name in names}
    assert registry >= {"_flash_fused_bwd_atomic", "_flash_bwd_delta", "_flash_bwd_dq_convert", "_flash_ptr_fwd"}
    assert own_kernels() == {**{n: "attention" for n in registry}, **{n: "optimizer" for n in KERNEL_NAMES}}
    assert all(categorize(n) == "attention" for n in registry)
    assert categorize("_ptr_fwd") == "other"  # exact names: no near misses


@pytest.mark.parametrize(("name", "category"), [
    ("triton_poi_fused_add_0", "elementwise"),
    ("triton_per_fused_sum_1", "reduction"),
    ("triton_red_fused_amax_2", "reduction"),
    ("triton_tem_fused_mm_t_3", "gemm"),
    ("triton_for_fused_4", "optimizer"),
    ("triton_poi_fused__scaled_dot_product_flash_attention_5", "attention"),
    ("triton_per_fused__log_softmax_6", "loss"),
    ("triton_per_fused__softmax_7", "softmax"),
    ("triton_poi_fused_rsqrt_8", "norm"),
    # a matmul op names a template's own product (gemm), but only the epilogue / prologue of a pointwise or
    # reduction kernel, which keeps its kind
    ("triton_tem_fused_addmm_relu_9", "gemm"),
    ("triton_tem_fused__scaled_mm_10", "gemm"),
    ("triton_poi_fused_addmm_relu_0", "elementwise"),
    ("triton_poi_fused__scaled_mm_0", "elementwise"),
    ("triton_red_fused__scaled_mm_abs_max_1", "reduction"),
    ("triton_per_fused_bmm_2", "reduction"),
    ("not_an_inductor_kernel", None),
])
def test_inductor_kernels_by_what_they_fuse(name: str, category: str | None) -> None:
    assert inductor_category(name) == category


def test_graph_replayed_kernels_keep_their_own_categories() -> None:
    """A whole step replayed from a CUDA graph launches inside ``Optimizer.step``: its kernels are still GEMMs and
    attention, not optimizer work (the category follows the name; the phase is the range the replay ran in)."""
    gemm, attn = "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "_flash_fused_bwd_atomic"
    assert categorize(gemm) == "gemm"
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 100, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "Optimizer.step#AdamW.step", "ts": 1, "dur": 90, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "cuda graph", "ts": 2, "dur": 80, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 5, "dur": 5, "tid": 1,
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": gemm, "ts": 20, "dur": 30, "tid": 9, "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": attn, "ts": 50, "dur": 20, "tid": 9, "args": {"correlation": 7}},
    ]
    tr = records_from_trace({"traceEvents": events}, "cuda")
    summary = summarize(tr.records, tr.steps)
    assert summary.category_us["cuda graph"] == {"gemm": 30.0, "attention": 20.0}


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["flash_triton", "sdpa"])
def test_other_holds_at_most_one_percent_on_a_default_path(tmp_path: Path, attention: str) -> None:
    """The small model, eager, bf16: KernelShare's "other" category stays under 1% of the step's kernel time, and
    the report names whatever is in it."""
    import lightning.pytorch as pl

    from lmtrain.callbacks import KernelShare
    from lmtrain.data import LMDataModule
    from lmtrain.module import LMModule

    pl.seed_everything(0)
    module = LMModule(size="small", vocab_size=10_000, context_length=512, attention=attention, warmup_steps=1)
    data = LMDataModule(source="synthetic", batch_size=8, context_length=512, vocab_size=10_000, train_batches=20,
                        val_batches=1)
    cb = KernelShare(wait=2, warmup=1, active=2, chart=False)
    trainer = pl.Trainer(max_steps=6, precision="bf16-mixed", accelerator="gpu", devices=1, logger=False,
                         default_root_dir=str(tmp_path), callbacks=[cb], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, data)
    assert cb.summary is not None
    other = [r for r in cb.summary.rows["step"] if r.category == "other"]
    assert (cb.summary.share("other") or 0.0) <= 0.01, [(r.name, r.share) for r in other]
    assert cb.summary.share("attention") > 0.0 and cb.summary.share("gemm") > 0.0
