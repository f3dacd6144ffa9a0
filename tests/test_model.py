"""TransformerLM: the reference study's parameter counts, shapes, causality, backends, RMSNorm, ModelConfig checks."""

from __future__ import annotations

import pytest
import torch

from lmtrain.attention import get_attention
from lmtrain.config import SEED_SIZES, SIZES, ModelConfig
from lmtrain.errors import LmtrainError
from lmtrain.flops import parameter_count
from lmtrain.model import RMSNorm, TransformerLM, count_parameters

#: The reference study's model table (vocabulary 10,000).
SEED_PARAMETERS = {
    "small": 128_625_408,
    "medium": 423_183_360,
    "large": 969_411_840,
    "xl": 1_998_235_200,
    "2.7B": 3_406_809_600,
}


def tiny_config(**changes) -> ModelConfig:
    return ModelConfig.from_size("tiny", vocab_size=64, context_length=32, **changes)


def test_seed_table_covers_every_seed_size() -> None:
    assert set(SEED_PARAMETERS) == set(SEED_SIZES)


@pytest.mark.parametrize("size", SEED_SIZES)
def test_parameter_count_matches_the_seeds_table(size: str) -> None:
    cfg = ModelConfig.from_size(size)
    assert cfg.vocab_size == 10_000
    with torch.device("meta"):
        model = TransformerLM(cfg)
    assert count_parameters(model) == SEED_PARAMETERS[size]
    assert parameter_count(cfg) == SEED_PARAMETERS[size]


def test_sizes_give_the_seeds_shapes() -> None:
    assert SIZES["2.7B"] == dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32)
    assert ModelConfig.from_size("2.7B").head_dim == 80


def test_no_biases_and_untied_head() -> None:
    model = TransformerLM(tiny_config())
    assert all(not name.endswith("bias") for name, _ in model.named_parameters())
    assert model.lm_head.weight.data_ptr() != model.embedding.weight.data_ptr()


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_forward_shape_and_dtype(attention: str) -> None:
    model = TransformerLM(tiny_config(attention=attention))
    tokens = torch.randint(0, 64, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, 64)
    assert logits.dtype == torch.float32


def test_longer_than_context_is_refused() -> None:
    model = TransformerLM(tiny_config())
    with pytest.raises(ValueError, match="context_length"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_causality(attention: str) -> None:
    """Changing token t+1 never changes the logits at positions <= t (fp64, exact)."""
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(attention=attention)).double().eval()
    tokens = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        reference = model(tokens)
        for t in (0, 7, 22):
            changed = tokens.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1) % 64
            logits = model(changed)
            assert torch.equal(logits[:, : t + 1], reference[:, : t + 1])
            assert not torch.equal(logits[:, t + 1], reference[:, t + 1])  # the change does reach position t+1


def test_naive_and_sdpa_models_agree_in_fp32() -> None:
    torch.manual_seed(0)
    naive = TransformerLM(tiny_config(attention="naive"))
    sdpa = TransformerLM(tiny_config(attention="sdpa"))
    sdpa.load_state_dict(naive.state_dict())
    tokens = torch.randint(0, 64, (2, 31))
    torch.testing.assert_close(sdpa(tokens), naive(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("n", "d"), [(97, 80), (64, 64), (1, 16)])
def test_naive_and_sdpa_functions_agree_in_fp32(n: int, d: int, causal: bool) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, d, requires_grad=True) for _ in range(3))
    outputs, grads = [], []
    for name in ("naive", "sdpa"):
        out = get_attention(name)(q, k, v, causal)
        assert out.shape == (2, 3, n, d) and out.dtype == torch.float32
        outputs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    for g_sdpa, g_naive in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g_sdpa, g_naive, rtol=1e-4, atol=1e-4)


def test_rmsnorm_computes_in_fp32_under_bf16_input() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(256)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(4, 256) * 30).bfloat16()
    y = norm(x)
    assert y.dtype == torch.bfloat16
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight).bfloat16()
    assert torch.equal(y, expected)
    # The same arithmetic done in bf16 rounds differently: the fp32 path is really taken.
    w16 = norm.weight.detach().bfloat16()
    in_bf16 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * w16
    assert not torch.equal(y, in_bf16)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(num_heads=3), "model.num_heads"),  # 3 does not divide 128
        (dict(d_model=96, num_heads=32), "model.num_heads"),  # head dim 3 is odd: RoPE needs pairs
        (dict(attention="flash_magic"), "model.attention"),
        (dict(vocab_size=0), "model.vocab_size"),
        (dict(context_length=-1), "model.context_length"),
        (dict(num_layers=2.5), "model.num_layers"),
        (dict(d_ff=True), "model.d_ff"),
        (dict(rope_theta=0.0), "model.rope_theta"),
        (dict(norm_eps=0.0), "model.norm_eps"),
    ],
)
def test_model_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(LmtrainError) as info:
        ModelConfig.from_size("tiny", **kwargs)
    assert info.value.field == field
    assert info.value.fix


def test_unknown_size_and_unknown_override() -> None:
    with pytest.raises(LmtrainError) as info:
        ModelConfig.from_size("huge")
    assert info.value.field == "model.size" and "2.7B" in info.value.fix
    with pytest.raises(LmtrainError) as info:
        ModelConfig.from_size("tiny", n_embd=64)
    assert info.value.field == "model.n_embd"


def test_heads_error_suggests_a_divisor() -> None:
    with pytest.raises(LmtrainError) as info:
        ModelConfig.from_size("2.7B", num_heads=30)
    assert "e.g. 32" in info.value.fix


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("size", ["small", "2.7B"])
def test_naive_and_sdpa_agree_in_bf16_on_cuda(size: str) -> None:
    """One block of each seed shape (head dim 64 and 80) in bf16: sdpa stays within naive's own bf16 error."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_size(size, num_layers=1, context_length=512)
    models = {}
    for name in ("naive", "sdpa"):
        models[name] = TransformerLM(cfg.replace(attention=name)).cuda()
    models["sdpa"].load_state_dict(models["naive"].state_dict())
    reference = TransformerLM(cfg.replace(attention="naive")).cuda().double()
    reference.load_state_dict(models["naive"].state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 512), device="cuda")
    with torch.no_grad():
        exact = reference(tokens)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            naive, sdpa = models["naive"](tokens).double(), models["sdpa"](tokens).double()
    naive_error = (naive - exact).abs().max().item()
    sdpa_error = (sdpa - exact).abs().max().item()
    assert sdpa_error <= 2 * naive_error + 1e-3
