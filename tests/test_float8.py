"""Float8 training on CPU: which layers convert, the refusals, the inspector's float8 statistics on constructed
tensors (exact fractions), the broken-scale warning through a real fit, and checkpoints across float8 settings.

torchao's casts and even its float8 layers run on a CPU (its GEMMs are emulated there); only a fit through
``LMModule`` with ``model.float8`` is refused on a CPU, so the fits here convert a float8-free module's model by
hand (``lmtrain.float8.convert_model``) to exercise the inspector.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
from lightning.pytorch.loggers import TensorBoardLogger
from refusals import refused
from tb import scalars, texts

from lmtrain.analysis import float8 as f8
from lmtrain.callbacks import PrecisionInspector
from lmtrain.callbacks.precision import Float8Probe
from lmtrain.config import ModelConfig, TrainerSettings
from lmtrain.data import LMDataModule
from lmtrain.errors import LmtrainError
from lmtrain.float8 import (
    check_float8_device,
    check_float8_run,
    convert_model,
    converts,
    float8_linears,
    gemm_specs,
    linear_config,
    load_float8,
)
from lmtrain.model import TransformerLM
from lmtrain.module import LMModule

torchao_float8 = pytest.importorskip("torchao.float8")
TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _config(**overrides: object) -> ModelConfig:
    base = dict(vocab_size=96, context_length=16, d_model=64, num_layers=2, num_heads=2, d_ff=72, attention="naive",
                float8="tensorwise", float8_min_features=64)
    return ModelConfig.from_size("tiny", **{**base, **overrides})


def _no_torchao(name: str) -> ModuleType:
    raise ImportError(f"No module named {name.split('.')[0]!r}")


# -- conversion -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, expected", [
    # d_ff 72 is no multiple of 16: the SwiGLU layers stay; the head stays unless asked; the embedding always
    (dict(), ("attn.qkv", "attn.out")),
    (dict(float8_head=True), ("attn.qkv", "attn.out", "lm_head")),
    # the size rule: widths 64 < 128 convert nothing
    (dict(d_ff=256, float8_min_features=128), ()),
    (dict(d_ff=256, float8_min_features=64), ("attn.qkv", "attn.out", "mlp.w1", "mlp.w2", "mlp.w3")),
])
def test_conversion_follows_the_size_rule_and_leaves_head_and_embedding(overrides: dict, expected: tuple) -> None:
    cfg = _config(**overrides)
    model = TransformerLM(cfg)
    converted = convert_model(model, cfg)
    want = [f"blocks.{i}.{name}" for i in range(cfg.num_layers) for name in expected if name != "lm_head"]
    want += ["lm_head"] if "lm_head" in expected else []
    assert sorted(converted) == sorted(want)
    assert sorted(float8_linears(model)) == sorted(want)  # what the inspector finds is what was converted
    assert type(model.embedding) is nn.Embedding
    assert (type(model.lm_head) is nn.Linear) == ("lm_head" not in expected)


def test_none_converts_nothing_and_imports_nothing() -> None:
    cfg = _config(float8="none")
    model = TransformerLM(cfg)
    assert convert_model(model, cfg, importer=_no_torchao) == []
    assert not converts(model.embedding, "embedding", cfg)


def test_recipes_map_to_torchao_configs() -> None:
    assert linear_config("tensorwise", fsdp=True).enable_fsdp_float8_all_gather
    assert not linear_config("tensorwise").enable_fsdp_float8_all_gather
    assert not linear_config("rowwise", fsdp=True).enable_fsdp_float8_all_gather  # tensorwise-only in torchao
    tensorwise = gemm_specs(linear_config("tensorwise"))
    assert tensorwise == {"output": (f8.CastSpec(E4M3), f8.CastSpec(E4M3)),
                          "grad_input": (f8.CastSpec(E5M2), f8.CastSpec(E4M3)),
                          "grad_weight": (f8.CastSpec(E5M2), f8.CastSpec(E4M3))}
    rowwise = f8.CastSpec(E4M3, rowwise=True, pow2=True)
    assert gemm_specs(linear_config("rowwise")) == {name: (rowwise, rowwise) for name in f8.GEMMS}


# -- refusals ---------------------------------------------------------------------------------------------


def _one_line(error: LmtrainError) -> str:
    text = str(error)
    assert "\n" not in text and error.field == "model.float8"
    return text


def test_missing_torchao_is_refused_with_the_install_fix() -> None:
    for call in (lambda: load_float8(_no_torchao), lambda: convert_model(TransformerLM(_config()), _config(),
                                                                         importer=_no_torchao),
                 lambda: check_float8_run(TrainerSettings(precision="bf16-mixed"), importer=_no_torchao)):
        with pytest.raises(LmtrainError) as info:
            call()
        assert _one_line(info.value).endswith("Fix: pip install lmtrain[float8]")


def test_devices_without_float8_tensor_cores_are_refused() -> None:
    with pytest.raises(LmtrainError, match="this run trains on cpu") as info:
        check_float8_device(torch.device("cpu"))
    _one_line(info.value)
    with pytest.raises(LmtrainError, match="this GPU has 8.0") as info:
        check_float8_device(torch.device("cuda", 0), capability=(8, 0))
    _one_line(info.value)
    check_float8_device(torch.device("cuda", 0), capability=(8, 9))
    check_float8_device(torch.device("cuda", 0), capability=(9, 0))


def test_fp16_precision_is_refused() -> None:
    with pytest.raises(LmtrainError, match="16-mixed") as info:
        check_float8_run(TrainerSettings(precision="16-mixed", device="cuda:0"))
    _one_line(info.value)


def test_a_cpu_fit_is_refused_before_anything_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    refused(["fit", "--config", TINY, "--model.float8", "tensorwise", "--trainer.max_steps", "1"], "model.float8",
            capsys, tmp_path)
    assert list(tmp_path.iterdir()) == []


# -- statistics on constructed tensors ----------------------------------------------------------------------


def test_cast_statistics_are_exact_fractions() -> None:
    # amax 448 = e4m3's max: scale 1. 2**-12 is below e4m3's smallest subnormal/2 (2**-10): flushed to zero.
    x = torch.tensor([[448.0, -448.0, 1.0, 0.5, 2**-12, -(2**-12), 0.0, 3.0]])
    _, scale, _, stats = f8.cast(x, f8.CastSpec(E4M3), dim=-1)
    assert scale.item() == 1.0 and stats["amax"].item() == 448.0
    assert stats["saturated"].item() == 0.0 and stats["underflow"].item() == 2 / 8
    # A scale 2**10 too large: 448, 448, 1, 0.5 and 3 now lie beyond e4m3's max, 2**-12 becomes 0.25 (kept).
    _, scale, _, stats = f8.cast(x, f8.CastSpec(E4M3), dim=-1, factor=2**10)
    assert scale.item() == 1024.0 and stats["saturated"].item() == 5 / 8 and stats["underflow"].item() == 0.0
    # e5m2 (gradients) keeps 2**-16 (its smallest subnormal) and flushes 2**-18.
    g = torch.tensor([57344.0, 2**-16, 2**-18, 0.0])
    _, _, _, stats = f8.cast(g, f8.CastSpec(E5M2), dim=-1)
    assert stats["underflow"].item() == 1 / 4 and stats["saturated"].item() == 0.0


def test_saturation_counts_what_the_clamp_changes_at_each_dtypes_tie() -> None:
    """Exactly half a step past the maximum, e5m2's round-to-nearest goes to inf (so the clamp changes the value:
    saturated) and e4m3fn's comes back to 448 (not saturated)."""
    assert torch.tensor([61440.0]).to(E5M2).float().isinf().all()  # 57344 + 8192 / 2
    assert torch.tensor([464.0]).to(E4M3).float().item() == 448.0  # 448 + 32 / 2
    past = f8._past_the_max(torch.tensor([61440.0, 61439.0, 57600.0]), E5M2, 57344.0)
    assert past.tolist() == [True, False, False]
    assert f8._past_the_max(torch.tensor([464.0, 464.5]), E4M3, 448.0).tolist() == [False, True]


def test_an_operand_with_inf_or_nan_is_flagged_whatever_the_layer_order() -> None:
    """A NaN in an operand makes its amax NaN and the float8 GEMM's output NaN: the layer is flagged, and the
    logged maxima are NaN whichever layer comes first (Python's max keeps or drops a NaN by position)."""
    def layer(name: str, amax: float, rel_err: float) -> f8.Float8LayerStats:
        cast = f8.CastStats(dtype="float8_e4m3fn", amax=amax, scale_min=1.0, scale_max=1.0, saturated=0.0,
                            underflow=0.0)
        return f8.Float8LayerStats(name, 1, {"output": f8.GemmStats(cast, cast, rel_err)})

    good, bad = layer("good", 3.0, 0.03), layer("bad", float("nan"), float("nan"))
    assert f8.flagged([good, bad], 1e-3) == f8.flagged([bad, good], 1e-3) == ["bad"]
    assert f8.flagged([layer("inf", float("inf"), 0.0)], 1e-3) == ["inf"]
    for order in ([good.gemms["output"].rel_err, float("nan")], [float("nan"), good.gemms["output"].rel_err]):
        assert math.isnan(f8.nan_max(order))
    assert f8.nan_max([0.1, 0.3, 0.2]) == 0.3 and f8.nan_max([]) == 0.0


def test_rowwise_scales_follow_the_contraction_dimension() -> None:
    a = torch.tensor([[448.0, 1.0], [100.0, -2.0]])  # A: one scale per row
    _, scale, amax, stats = f8.cast(a, f8.CastSpec(E4M3, rowwise=True, pow2=True), dim=-1)
    assert amax.flatten().tolist() == [448.0, 100.0]
    assert scale.flatten().tolist() == [1.0, 4.0]  # 448 / 100 = 4.48, rounded down to a power of two
    assert stats["scale_min"].item() == 1.0 and stats["scale_max"].item() == 4.0
    _, scale, _, _ = f8.cast(a, f8.CastSpec(E4M3, rowwise=True), dim=0)  # B: one scale per column
    assert scale.flatten().tolist() == pytest.approx([448.0 / 448.0, 448.0 / 2.0])


@pytest.mark.parametrize("rowwise", [False, True])
def test_scales_equal_torchao_own(rowwise: bool) -> None:
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale

    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * 3
    granularity = ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE
    for dtype in (E4M3, E5M2):
        theirs = tensor_to_scale(x, dtype, scaling_granularity=granularity, axiswise_dim=-1 if rowwise else None,
                                 round_scales_to_power_of_2=rowwise)
        ours = f8.scales(x, f8.CastSpec(dtype, rowwise=rowwise, pow2=rowwise), dim=-1)[1]
        assert torch.equal(ours.reshape(theirs.shape), theirs)


def test_the_replay_docstring_names_the_forward_gemms_fast_accumulation() -> None:
    """The replay accumulates in fp32; what it says of the real GEMMs' accumulation matches torchao's configs."""
    for recipe in ("tensorwise", "rowwise"):
        config = linear_config(recipe)
        assert config.gemm_config_output.use_fast_accum
        assert not config.gemm_config_grad_input.use_fast_accum and not config.gemm_config_grad_weight.use_fast_accum
    doc = " ".join(f8.__doc__.split())
    assert "forward (``output``) GEMM with ``use_fast_accum=True``" in doc
    assert "``grad_input`` and ``grad_weight`` run without fast accumulation" in doc


def test_gemm_error_is_zero_for_exact_operands_and_small_otherwise() -> None:
    # Small integers with amax 448 are exact in e4m3 at scale 1 and in bf16: both GEMMs agree exactly.
    a = torch.tensor([[448.0, 2.0, -3.0], [1.0, 0.0, 4.0]])
    b = torch.tensor([[1.0, -2.0], [448.0, 0.5], [3.0, 6.0]])
    raw = f8.gemm(a, b, f8.CastSpec(E4M3), f8.CastSpec(E4M3))
    assert f8.to_gemm_stats(raw).rel_err == 0.0
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(128, 96, generator=gen), torch.randn(96, 64, generator=gen)
    stats = f8.to_gemm_stats(f8.gemm(a, b, f8.CastSpec(E4M3), f8.CastSpec(E4M3)))
    assert 0.0 < stats.rel_err < 0.1 and stats.a.saturated == 0.0 and stats.b.dtype == "float8_e4m3fn"


# -- the inspector through a fit ------------------------------------------------------------------------------


def _float8_fit(tmp_path: Path, inspector: PrecisionInspector, precision: str = "32-true",
                compile: bool = False) -> pl.Trainer:
    pl.seed_everything(0)
    module = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=64, num_layers=1, num_heads=2,
                      d_ff=128, attention="naive", warmup_steps=1)
    module.configure_model()  # a float8-free module, converted by hand: LMModule refuses float8 on a CPU
    convert_model(module.model, module.config.replace(float8="tensorwise", float8_min_features=64))
    if compile:  # dynamo with the eager backend: compiled code's hook behaviour, no C++ compiler needed
        module.model.compile(backend="eager")
    data = LMDataModule(source="synthetic", batch_size=2, context_length=16, vocab_size=64, train_batches=10,
                        val_batches=1)
    trainer = pl.Trainer(max_steps=2, precision=precision, accelerator="cpu", devices=1,
                         logger=TensorBoardLogger(str(tmp_path), name="f8"), callbacks=[inspector],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, data)
    return trainer


def test_the_inspector_reports_every_gemm_of_every_float8_layer(tmp_path: Path, recwarn: pytest.WarningsRecorder
                                                                 ) -> None:
    inspector = PrecisionInspector(step=0, float8_every=1)
    trainer = _float8_fit(tmp_path, inspector, "bf16-mixed")
    layers = inspector.float8_result
    assert [s.layer for s in layers] == [f"model.blocks.0.{n}" for n in ("attn.qkv", "attn.out", "mlp.w1", "mlp.w2",
                                                                         "mlp.w3")]
    for s in layers:
        assert set(s.gemms) == set(f8.GEMMS) and s.step == 1
        for g in s.gemms.values():
            assert g.a.saturated == 0.0 and g.b.saturated == 0.0 and 0.0 < g.rel_err < 0.2
    # the amax history: one entry per inspected step (0, 1) for every operand
    assert {tuple(step for step, _ in h) for h in inspector.float8_history.values()} == {(0, 1)}
    assert not [w for w in recwarn if "float8 layer" in str(w.message)]
    logged = scalars(trainer.log_dir)
    assert [step for step, _ in logged["precision/float8_max_saturated"]] == [0, 1]
    assert logged["precision/float8_flagged_layers"][-1][1] == 0.0
    layer_tags = {t for t in logged if t.startswith("precision/float8/")}
    assert len(layer_tags) == len(layers) * 3 * (2 * 4 + 1)  # per GEMM: 4 statistics x 2 operands + rel_err
    doc = PrecisionInspector.__doc__
    for tag in logged:  # every float8 tag is documented, by name or by its pattern
        if tag.startswith("precision/float8/"):
            layer, gemm, leaf = tag.removeprefix("precision/float8/").rsplit("/", 2)
            assert layer in float8_linears(trainer.lightning_module) and gemm in f8.GEMMS
            operand, _, stat = leaf.rpartition("_")
            if leaf == "rel_err":
                assert "``precision/float8/<layer>/<gemm>/rel_err``" in doc
            else:
                assert operand in f8.GEMMS[gemm]
                assert f"``precision/float8/<layer>/<gemm>/<operand>_{stat}``" in doc or f"``..._{stat}``" in doc
        elif tag.startswith("precision/float8"):
            assert f"``{tag}``" in doc
    assert any("float8 layers in float8 too" in note for note in inspector.result.notes)
    table = texts(trainer.log_dir)["precision/float8"][-1]
    assert "`model.blocks.0.mlp.w2`" in table and "grad_weight" in table and "⚑" not in table


def test_a_scale_broken_by_2_pow_10_is_flagged(tmp_path: Path) -> None:
    broken = "model.blocks.0.attn.qkv"
    inspector = PrecisionInspector(step=1, float8_scale_factors={broken: 2**10}, reference=False)
    with pytest.warns(UserWarning, match=r"step 1: float8 layer\(s\) model\.blocks\.0\.attn\.qkv have more than"):
        trainer = _float8_fit(tmp_path, inspector)
    worst = {s.layer: s.worst()[0] for s in inspector.float8_result}
    assert worst[broken] > 0.5 and all(v == 0.0 for k, v in worst.items() if k != broken)
    assert scalars(trainer.log_dir)["precision/float8_flagged_layers"] == [(1, 1.0)]
    table = texts(trainer.log_dir)["precision/float8"][0]
    assert f"`{broken}` ⚑" in table


def test_a_compiled_model_is_probed_at_a_step_after_the_first(tmp_path: Path) -> None:
    # Step 0 runs the compiled code without hooks; dynamo does not guard on module hooks, so without the eager
    # stance the probe's hooks, added at step 1, would never run.
    inspector = PrecisionInspector(step=1, reference=False)
    trainer = _float8_fit(tmp_path, inspector, compile=True)
    assert trainer.lightning_module.model._compiled_call_impl is not None
    assert len(inspector.float8_result) == 5
    assert all(list(s.gemms) == list(f8.GEMMS) and s.step == 1 for s in inspector.float8_result)
    assert "ran their forward and backward passes eagerly" in texts(trainer.log_dir)["precision/float8"][0]
    assert any("force_eager" in note for note in inspector.result.notes)
    assert torch._dynamo.eval_frame._stance.stance == "default"  # the stance ends with the step


def test_the_probe_names_layers_whose_weight_arrives_in_float8() -> None:
    """FSDP2's float8 all-gather hands a layer a float8 weight (torchao's Float8TrainingTensor), stood in for here
    by that weight cast by hand: the probe names the layer (its replay cannot see the weight's own cast)."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    cfg = _config(d_ff=128, num_layers=1)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    convert_model(model, cfg)
    layer = float8_linears(model)["blocks.0.mlp.w1"]
    weight = hp_tensor_to_float8_dynamic(layer.weight.detach(), torch.float8_e4m3fn, layer.linear_mm_config,
                                         gemm_input_role=GemmInputRole.WEIGHT)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    probe = Float8Probe(model)
    probe.install()
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (2, 16)))
    probe.remove()
    assert probe.gathered == {"blocks.0.mlp.w1"}
    replayed = {s.layer: s.gemms["output"] for s in probe.results(0)}
    assert replayed["blocks.0.mlp.w1"].b.saturated == 0.0 and replayed["blocks.0.mlp.w1"].rel_err > 0


@pytest.mark.parametrize("policy", ["selective", "offload"])
def test_the_inspector_replays_every_gemm_under_activation_checkpointing(policy: str) -> None:
    from fitting import cpu_fit

    pl.seed_everything(0)
    module = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=64, num_layers=2, num_heads=2,
                      d_ff=128, attention="naive", warmup_steps=1, activation_checkpointing=policy)
    module.configure_model()
    convert_model(module.model, module.config.replace(float8="tensorwise", float8_min_features=64))
    inspector = PrecisionInspector(step=0, reference=False)
    cpu_fit(module, 1, batch=2, context=16, vocab=64, precision="bf16-mixed", callbacks=[inspector])
    # one replay per layer although checkpointing runs each block's forward twice
    assert len(inspector.float8_result) == 10
    assert all(list(s.gemms) == list(f8.GEMMS) for s in inspector.float8_result)
    assert {len(h) for h in inspector.float8_history.values()} == {1}


def test_a_scale_factor_for_no_float8_layer_is_warned_about(tmp_path: Path) -> None:
    inspector = PrecisionInspector(step=0, float8_scale_factors={"model.blocks.0.attn.qkvv": 2**10}, reference=False)
    with pytest.warns(UserWarning, match=r"names model\.blocks\.0\.attn\.qkvv, not a float8 layer"):
        _float8_fit(tmp_path, inspector)
    assert max(max(s.worst()) for s in inspector.float8_result) < 1e-3


def test_bad_float8_arguments_are_refused() -> None:
    with pytest.raises(LmtrainError, match="float8_threshold"):
        PrecisionInspector(float8_threshold=2).check_arguments()
    with pytest.raises(LmtrainError, match="float8_scale_factors"):
        PrecisionInspector(float8_scale_factors={"x": 0}).check_arguments()
    with pytest.raises(LmtrainError, match="float8_every"):
        PrecisionInspector(float8_every=-1).check_arguments()


# -- composition and checkpoints ---------------------------------------------------------------------------


def test_checkpoints_load_across_float8_settings() -> None:
    cfg = _config(d_ff=256, float8_head=True)
    torch.manual_seed(0)
    plain = TransformerLM(cfg.replace(float8="none", float8_head=False))
    converted = TransformerLM(cfg)
    convert_model(converted, cfg)
    assert list(plain.state_dict()) == list(converted.state_dict())  # Float8Linear keeps the weight's key
    converted.load_state_dict(plain.state_dict())  # bf16 -> float8
    back = TransformerLM(cfg.replace(float8="none", float8_head=False))
    back.load_state_dict(converted.state_dict())  # float8 -> bf16
    for (name, p), q in zip(plain.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_float8_gradients(policy: str) -> None:
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointing in ("none", policy):
        cfg = _config(d_ff=256, activation_checkpointing=checkpointing)
        torch.manual_seed(0)
        model = TransformerLM(cfg)
        convert_model(model, cfg)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("options", [dict(master_weights=True), dict(master_weights=True,
                                                                      optimizer_state_dtype="bfloat16"),
                                     dict(optimizer_in_backward=True)], ids=["master", "compact", "in_backward"])
def test_float8_layers_train_with_each_optimizer(options: dict) -> None:
    from fitting import cpu_fit

    pl.seed_everything(0)
    module = LMModule(size="tiny", vocab_size=64, context_length=16, d_model=64, num_layers=2, num_heads=2,
                      d_ff=128, attention="naive", warmup_steps=1, **options)
    module.configure_model()
    convert_model(module.model, module.config.replace(float8="tensorwise", float8_min_features=64))
    before = {name: p.detach().float().clone() for name, p in module.model.named_parameters()}
    cpu_fit(module, 2, batch=2, context=16, vocab=64, precision="bf16-mixed")
    assert len(float8_linears(module.model)) == 10
    qkv = module.model.blocks[0].attn.qkv.weight
    assert qkv.dtype == (torch.float32 if options.get("optimizer_in_backward") else torch.bfloat16)
    for name, p in module.model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(p.detach().float(), before[name]), name


# -- planner and bench --------------------------------------------------------------------------------------


def test_the_planner_plans_float8_memory() -> None:
    from lmtrain.memory_plan import estimate_memory, float8_block_elements, float8_cast_transient_bytes

    base = ModelConfig.from_size("2.7B", vocab_size=10_000, context_length=512)
    d, f = base.d_model, base.d_ff
    plain = estimate_memory(base, 4, 512, "bf16-mixed")
    f8cfg = base.replace(float8="tensorwise")
    assert float8_block_elements(f8cfg) == 4 * d * d + 3 * d * f  # every block layer converts at 2.7B
    assert float8_block_elements(ModelConfig.from_size("small", float8="tensorwise")) == 0  # 768 < 2048
    eager = estimate_memory(f8cfg, 4, 512, "bf16-mixed")
    # no autocast copy of a float8 weight, and no float8 weight kept for the backward, compiled or not (measured)
    assert eager.details["layer"]["weight_casts"] == 0
    assert plain.details["layer"]["weight_casts"] == (4 * d * d + 3 * d * f) * 2
    compiled = estimate_memory(f8cfg.replace(compile=True), 4, 512, "bf16-mixed")
    assert compiled.details["layer"] == eager.details["layer"]
    assert compiled.peak <= estimate_memory(base.replace(compile=True), 4, 512, "bf16-mixed").peak + \
        float8_cast_transient_bytes(f8cfg, 4 * 512)
    n = 4 * 512  # largest layer's backward casts: w1 (D -> F): 2 n F + D F + n D bytes
    assert float8_cast_transient_bytes(f8cfg, n) == 2 * n * f + d * f + n * d
    assert float8_cast_transient_bytes(base, n) == 0
    assert eager.details["options"]["float8"] == "tensorwise"
    # FSDP2: tensorwise all-gathers the float8 layers' weights in 1 byte instead of bf16's 2
    fsdp_plain = estimate_memory(base, 4, 512, "bf16-mixed", strategy="fsdp", world_size=2)
    fsdp_f8 = estimate_memory(f8cfg, 4, 512, "bf16-mixed", strategy="fsdp", world_size=2)
    gathered = fsdp_f8.details["float8_gathered_numel"]
    assert gathered == 4 * d * d + 3 * d * f
    assert fsdp_plain.components["fsdp_buffers"] - fsdp_f8.components["fsdp_buffers"] == 2 * gathered
    rowwise = estimate_memory(base.replace(float8="rowwise"), 4, 512, "bf16-mixed", strategy="fsdp", world_size=2)
    assert rowwise.details["float8_gathered_numel"] == 0


def test_bench_model_has_a_float8_axis() -> None:
    import argparse

    from lmtrain.bench import model as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    cells, _, _ = bench.plan_cells(parser.parse_args(["--sizes", "2.7B", "--float8", "none,tensorwise",
                                                      "--float8-head", "on"]))
    assert [(c.float8, c.float8_head) for c in cells] == [("none", False), ("tensorwise", True)]
    assert cells[0].slug != cells[1].slug and "f8" in cells[1].slug
    assert bench.cell_config(cells[1]).float8 == "tensorwise"
    # the size rule is an axis of float8 cells only: one bf16 cell, two float8 cells
    cells, _, _ = bench.plan_cells(parser.parse_args(["--sizes", "small", "--float8", "none,tensorwise",
                                                      "--float8-min-features", "2048,512"]))
    assert [(c.float8, c.float8_min_features) for c in cells] == [("none", 2048), ("tensorwise", 2048),
                                                                   ("tensorwise", 512)]


def test_loading_torchao_prints_nothing() -> None:
    """Importing torchao logs notes about extensions float8 training does not use; a float8 run shows none of them."""
    import subprocess
    import sys

    pytest.importorskip("torchao")
    code = "from lmtrain.float8 import load_float8; load_float8()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "register_constant" not in result.stderr and "Failed to load" not in result.stderr, result.stderr
