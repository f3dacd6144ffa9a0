"""`bench model --study speed`: the speed options of a cell, the study's cells, the plain-PyTorch reference, the
cells' own clock and losses, and the study's tables."""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch

from lmtrain.bench import model as bench
from lmtrain.bench.reference import train_plain
from lmtrain.bench.studies import STUDIES, render_speed, variant_name
from lmtrain.cli import main
from lmtrain.config import ModelConfig, doc_of
from lmtrain.errors import LmtrainError

pytestmark = pytest.mark.usefixtures("one_thread")


def plan(*argv: str) -> tuple[list[bench.Cell], dict[str, list[bench.Cell]]]:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    cells, per_study, _ = bench.plan_cells(parser.parse_args(list(argv)))
    return cells, per_study


def name(cell: bench.Cell) -> str:
    return variant_name(bench.base_row(cell))


def _speed_variants() -> list[dict[str, Any]]:
    """The speed study's variants, each once (its preset lists every variant at every point)."""
    options = [{k: v for k, v in variant.items() if k not in ("sizes", "contexts")}
               for variant in STUDIES["speed"].preset["variants"]]
    return [json.loads(text) for text in dict.fromkeys(json.dumps(o, sort_keys=True) for o in options)]


def test_speed_study_cells_variants_order_and_keys() -> None:
    cells, per_study = plan("--study", "speed")
    variants = _speed_variants()
    points = [(c.size, c.context) for c in cells]
    expected = [(s, t) for variant in STUDIES["speed"].preset["variants"][::len(variants)]
                for s in variant["sizes"] for t in variant["contexts"]]
    assert cells == per_study["speed"] and len(cells) == len(expected) * len(variants)
    unique = list(dict.fromkeys(points))
    assert sorted(unique) == sorted(expected) and len(unique) * len(variants) == len(cells)
    sizes = list(dict.fromkeys(s for s, _ in points))  # the cells of one size, then of one context, are adjacent
    assert unique == sorted(unique, key=lambda p: (sizes.index(p[0]), p[1]))
    n = len(variants)
    for i in range(0, len(cells), n):  # each point: its variants together, in the preset's order, each named apart
        group = cells[i:i + n]
        assert len(set(points[i:i + n])) == 1 and len({name(c) for c in group}) == n
        for cell, variant in zip(group, variants, strict=True):
            assert cell.compile == (variant.get("compile") == ["on"])
            assert cell.runner == variant.get("runner", ["lightning"])[0]
            assert cell.cuda_graphs == (variant.get("cuda_graphs") == ["on"])
            assert cell.float8 == variant.get("float8", ["none"])[0]
    assert {(c.precision, c.batch_size, c.mode, c.attention, c.warmup, c.steps) for c in cells} == {
        ("bf16-mixed", 4, "train", "sdpa", 5, 20)}
    overlap = [c for c in cells if c.optimizer_overlap]
    assert overlap and all(c.optimizer_in_backward and c.cuda_graphs and c.compile for c in overlap)
    plain = [c for c in cells if c.runner == "plain"]
    assert plain and all(c.compile and c.cuda_graphs and not c.optimizer_in_backward for c in plain)
    # A cell without the new fields keeps the key it had before they existed; set fields join the key and the
    # name, in the schema's order.
    axes = ("small", 512, 4, "bf16-mixed", "sdpa", True, "train", 5, 20)
    eager = bench.Cell("small", 512, 4, "bf16-mixed", "sdpa", False, "train", 5, 20)
    assert eager.key() == json.dumps({"size": "small", "context": 512, "batch_size": 4, "precision": "bf16-mixed",
                                      "attention": "sdpa", "compile": False, "mode": "train", "warmup": 5,
                                      "steps": 20, "vocab_size": 10_000}, sort_keys=True)
    graphs = bench.Cell(*axes, cuda_graphs=True)
    assert json.loads(bench.Cell(*axes, runner="plain").key())["runner"] == "plain"
    assert json.loads(graphs.key())["cuda_graphs"] is True
    master = bench.Cell(*axes, cuda_graphs=True, master_weights=True)
    assert json.loads(master.key())["master_weights"] is True and "optimizer_state_dtype" not in master.key()
    compact = bench.Cell(*axes, cuda_graphs=True, master_weights=True, optimizer_state_dtype="bfloat16")
    assert json.loads(compact.key())["optimizer_state_dtype"] == "bfloat16"
    overlap = bench.Cell(*axes, cuda_graphs=True, optimizer_in_backward=True, optimizer_overlap=True)
    assert [c.slug.removeprefix("small_T512_B4_bf16-mixed_sdpa_") for c in (
        eager, bench.Cell(*axes), graphs, overlap, master, compact, bench.Cell(*axes, cuda_graphs=True, runner="plain"))
    ] == ["eager_train_w5_s20", "compiled_train_w5_s20", "compiled_train_w5_s20_graphs",
          "compiled_train_w5_s20_ib_graphs_ovl", "compiled_train_w5_s20_graphs_mw",
          "compiled_train_w5_s20_graphs_mw_statebfloat16", "compiled_train_w5_s20_graphs_plain"]


def test_speed_study_float8_variants_are_the_fast_recipe_with_each_recipe() -> None:
    variants = _speed_variants()
    fast = {"compile": ["on"], "cuda_graphs": ["on"], "master_weights": ["on"], "optimizer_state_dtype": ["bfloat16"]}
    assert [v for v in variants if "float8" in v] == [{**fast, "float8": ["tensorwise"]},
                                                      {**fast, "float8": ["rowwise"]}]
    assert fast in variants  # the bf16 fast recipe they are read against
    cells, _ = plan("--study", "speed", "--sizes", "2.7B", "--contexts", "512")
    float8 = [c for c in cells if c.float8 != "none"]
    assert [(name(c), c.float8_min_features, c.float8_head) for c in float8] == [
        ("compile+graphs+master+bf16 state+float8 tensorwise", 2048, False),
        ("compile+graphs+master+bf16 state+float8 rowwise", 2048, False)]
    assert all(c.master_weights and c.optimizer_state_dtype == "bfloat16" and c.cuda_graphs and c.compile
               and c.runner == "lightning" for c in float8)
    assert [c.slug.rsplit("_", 1)[1] for c in float8] == ["f8tensorwise", "f8rowwise"]
    # --float8 given explicitly overrides every variant, as any flag does.
    cells, _ = plan("--study", "speed", "--sizes", "small", "--contexts", "512", "--float8", "none")
    assert {c.float8 for c in cells} == {"none"}


def test_speed_study_overrides_and_other_studies_unchanged() -> None:
    n = len(_speed_variants())
    cells, _ = plan("--study", "speed", "--sizes", "medium", "--steps", "50")
    assert {(c.size, c.context) for c in cells} == {("medium", 128), ("medium", 512)}
    assert len(cells) == 2 * n and {c.steps for c in cells} == {50}
    cells, _ = plan("--study", "speed", "--sizes", "small", "--contexts", "256")
    full, _ = plan("--study", "speed")
    assert [name(c) for c in cells] == [name(c) for c in full[:n]]  # the two points collapse into one
    cells, per_study = plan("--study", "timing", "--study", "speed", "--sizes", "small")
    timing = STUDIES["timing"].preset
    assert len(per_study["timing"]) == len(timing["contexts"]) * len(timing["mode"])
    assert len(cells) == len(per_study["timing"]) + 2 * n
    assert all(c.runner == "lightning" and not c.cuda_graphs for c in per_study["timing"])
    assert per_study["timing"][0].slug == "small_T128_B4_32-true_sdpa_eager_forward_w3_s10"


def test_speed_flags_reach_the_module_and_overlap_implies_in_backward() -> None:
    cells, _ = plan("--sizes", "small", "--mode", "train", "--cuda-graphs", "off,on", "--optimizer-overlap", "on")
    assert [(c.cuda_graphs, c.optimizer_in_backward, c.optimizer_overlap) for c in cells] == [
        (False, True, True), (True, True, True)]
    kwargs = bench.module_kwargs(cells[1])
    assert (kwargs["cuda_graphs"], kwargs["optimizer_in_backward"], kwargs["optimizer_overlap"]) == (True, True, True)
    assert cells[1].slug.endswith("_ib_graphs_ovl")
    # in-backward off,on x overlap off,on: overlap-on cells of both in-backward values are one cell
    cells, _ = plan("--mode", "train", "--optimizer-in-backward", "off,on", "--optimizer-overlap", "off,on")
    assert [(c.optimizer_in_backward, c.optimizer_overlap) for c in cells] == [(False, False), (True, True),
                                                                               (True, False)]
    # at their defaults the options are not passed: LMModule versions without them accept the cell
    plain = bench.module_kwargs(bench.Cell("small", 512, 4, "bf16-mixed", "sdpa", True, "train", 5, 20))
    assert "cuda_graphs" not in plain and "optimizer_overlap" not in plain and "runner" not in plain
    for flag in ("--cuda-graphs", "--optimizer-overlap", "--runner"):
        with pytest.raises(LmtrainError, match=flag):
            plan("--sizes", "small", flag, "maybe")
    # One line per help text: argparse would otherwise wrap at the hyphens of option names.
    parser = argparse.ArgumentParser(formatter_class=lambda prog: argparse.HelpFormatter(prog, width=100_000))
    bench.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    doc = " ".join(doc_of(next(f for f in fields(ModelConfig) if f.name == "cuda_graphs")).split())
    assert f"--cuda-graphs CUDA_GRAPHS {doc} (model.cuda_graphs) In a sweep: off, on or off,on" in text
    assert "on implies --optimizer-in-backward on" in text


def speed_row(cell: bench.Cell, ms: float | None, **values: Any) -> dict[str, Any]:
    row = bench.base_row(cell)
    if ms is None:
        row.update(status="OOM", error="CUDA out of memory")
    else:
        row.update(status="ok", step_ms_mean=ms, step_ms_std=0.5, tokens_per_s=4 * cell.context / ms * 1e3,
                   mfu=0.25, peak_gib=10.0, **values)
    return bench.finish_row(row)


def test_render_speed_tables() -> None:
    cells = {name(c): c for c in plan("--study", "speed", "--sizes", "small", "--contexts", "512")[0]}
    eager_losses = [10.0, 9.0, 8.0]
    rows = [
        speed_row(cells["eager"], 100.0, events_step_ms_mean=98.0, pipeline_step_ms=104.0, timer_vs_events_pct=2.04,
                  losses=eager_losses),
        speed_row(cells["compile"], 80.0, events_step_ms_mean=80.0, pipeline_step_ms=81.0, timer_vs_events_pct=0.0,
                  losses=[10.0, 9.009, 8.0, 7.0]),
        speed_row(cells["compile+graphs"], 50.0, events_step_ms_mean=49.5, pipeline_step_ms=50.0,
                  timer_vs_events_pct=1.01, losses=[10.0, 9.0, 7.996]),
        speed_row(cells["compile+graphs+overlap"], None),
        speed_row(cells["compile+graphs+master+bf16 state"], 45.0, events_step_ms_mean=45.0, pipeline_step_ms=45.1,
                  timer_vs_events_pct=0.0, losses=[10.0, 9.0, 8.008]),
        speed_row(cells["compile+graphs+master+bf16 state+float8 tensorwise"], 25.0, events_step_ms_mean=25.0,
                  pipeline_step_ms=25.0, timer_vs_events_pct=0.0, losses=[10.0, 9.09, 8.0]),
        speed_row(cells["plain compile+graphs"], 40.0, pipeline_step_ms=40.4, losses=[10.5, 9.5, 8.5]),
    ]
    text = re.sub(" +", " ", render_speed(rows))
    assert "`small`, context 512, batch 4, bf16-mixed, sdpa, train" in text
    assert "| eager | 100.00 ± 0.50 | 98.00 | 104.00 | +2.0% | 20,480 | 25.0% | 10.00 | 1.00x |" in text
    assert "| compile | 80.00 ± 0.50 | 80.00 | 81.00 | +0.0% | 25,600 | 25.0% | 10.00 | 1.25x |" in text
    assert "| compile+graphs | 50.00 ± 0.50 | 49.50 | 50.00 | +1.0% | 40,960 | 25.0% | 10.00 | 2.00x |" in text
    assert "| compile+graphs+overlap | OOM | - | - | - | - | - | - | - |" in text
    assert "| plain compile+graphs | 40.00 ± 0.50 | - | 40.40 | - | 51,200 | 25.0% | 10.00 | 2.50x |" in text
    assert ("| compile+graphs+master+bf16 state+float8 tensorwise | 25.00 ± 0.50 | 25.00 | 25.00 | +0.0% | 81,920 "
            "| 25.0% | 10.00 | 4.00x |") in text
    losses = text[text.index("### Losses vs eager"):]
    # compile: steps 0-2 compared (the fourth has no eager counterpart), |9.009 - 9| = 9e-3, relative 1e-3
    assert "| small | 512 | compile | 3 | 9.00e-03 | 1.00e-03 |" in losses
    assert "| small | 512 | compile+graphs | 3 | 4.00e-03 | 5.00e-04 |" in losses
    assert "| small | 512 | compile+graphs+master+bf16 state | 3 | 8.00e-03 | 1.00e-03 |" in losses
    assert "| small | 512 | compile+graphs+master+bf16 state+float8 tensorwise | 3 | 9.00e-02 | 1.00e-02 |" in losses
    assert "overlap" not in losses and "plain" not in losses.split("left out.")[1]


def test_plain_reference_refuses_without_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = ModelConfig.from_size("tiny", context_length=16)
    with pytest.raises(LmtrainError) as info:
        train_plain(config, 2, "bf16-mixed", compile=True, cuda_graphs=True, warmup=1, steps=2)
    message = str(info.value)
    assert "\n" not in message and message.startswith("--runner: the plain reference loop times GPU steps")
    assert "no CUDA GPU is visible" in message
    # as a sweep cell: an error row with that line, and the sweep goes on
    out = tmp_path / "r.csv"
    assert main(["bench", "model", "--sizes", "tiny", "--contexts", "16", "--batch-size", "2", "--mode", "train",
                 "--warmup", "1", "--steps", "2", "--compile", "on", "--cuda-graphs", "on", "--runner", "plain",
                 "--out", str(out), "--logdir", "none"]) == 0
    row = bench.load_results(out)[0]
    assert row["status"] == "error" and row["error"] == f"LmtrainError: {message}"


def test_plain_cell_refuses_what_the_loop_does_not_do() -> None:
    cell = bench.Cell("tiny", 16, 2, "bf16-mixed", "sdpa", True, "forward", 1, 2, loss_chunk_tokens=8,
                      runner="plain")
    with pytest.raises(LmtrainError, match="asks for mode forward, loss_chunk_tokens"):
        bench.measure_plain_cell(cell)


def test_cells_own_clock_and_losses_on_a_cpu_fit() -> None:
    """The independent clock on the host: positive times, a pipeline no shorter than its steps, every loss."""
    cell = bench.Cell("tiny", 16, 2, "32-true", "sdpa", False, "train", 2, 3)
    row = bench.measure_cell(cell, None)
    assert row["status"] == "ok"
    assert row["events_step_ms_mean"] > 0 and row["pipeline_step_ms"] >= row["events_step_ms_mean"]
    assert row["timer_vs_events_pct"] == pytest.approx(
        100 * (row["step_ms_mean"] - row["events_step_ms_mean"]) / row["events_step_ms_mean"])
    losses = row["losses"]
    assert len(losses) == cell.warmup + cell.steps and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(10_000)) < 1.0  # freshly initialised: about uniform over the vocabulary
    # Same weights and batches: the in-backward optimizer follows the same losses as the ordinary step.
    again = bench.measure_cell(bench.Cell("tiny", 16, 2, "32-true", "sdpa", False, "train", 2, 3,
                                          optimizer_in_backward=True), None)
    assert again["losses"] == pytest.approx(losses, abs=1e-5)


@pytest.mark.gpu
def test_plain_reference_on_a_gpu() -> None:
    config = ModelConfig.from_size("tiny", context_length=64)
    run = train_plain(config, 2, "bf16-mixed", compile=True, cuda_graphs=True, warmup=3, steps=4)
    assert len(run.warmup_ms) == 3 and len(run.step_ms) == 4 and all(t > 0 for t in run.step_ms)
    assert run.pipeline_step_ms >= min(run.step_ms)
    assert len(run.losses) == 7 and all(math.isfinite(x) for x in run.losses)
    assert run.losses[-1] < run.losses[0]  # it trains


def test_compile_mode_is_a_cell_option() -> None:
    cells, _ = plan("--compile", "off,on", "--compile-mode", "default,max-autotune-no-cudagraphs", "--mode", "train")
    modes = sorted((c.compile, c.compile_mode) for c in cells)
    # An eager cell has no compile mode: the two modes give one eager cell and two compiled ones.
    assert modes == [(False, "default"), (True, "default"), (True, "max-autotune-no-cudagraphs")]
    tuned = next(c for c in cells if c.compile_mode != "default")
    assert bench.module_kwargs(tuned)["compile_mode"] == "max-autotune-no-cudagraphs"
    assert tuned.slug.endswith("_cmmax-autotune-no-cudagraphs")
    assert "compile_mode" not in json.loads(next(c for c in cells if c.compile).key())  # former keys still match
    assert name(tuned) == "compile(max-autotune-no-cudagraphs)"
    from lmtrain.bench.tables import options_text

    assert options_text(bench.base_row(tuned)) == "compile mode max-autotune-no-cudagraphs"
    with pytest.raises(LmtrainError, match="--compile-mode"):
        plan("--compile", "on", "--compile-mode", "reduce-overhead")
