"""Sampling (top-k, top-p, temperature, seeds, the context window), codecs and ``python -m lmtrain generate``."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmtrain.cli import main
from lmtrain.generate import Codec, filter_top_k, filter_top_p, sample, sample_next
from lmtrain.module import LMModule

TINY = {"size": "tiny", "vocab_size": 256, "context_length": 16, "d_model": 32, "num_layers": 1, "num_heads": 2,
        "d_ff": 64}


def kept(logits: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(logits.tolist()) if v != -math.inf}


def test_top_k_keeps_the_k_largest_and_ties() -> None:
    logits = torch.tensor([1.0, 5.0, 3.0, 5.0, 0.0, 4.0])
    assert kept(filter_top_k(logits, 1)) == {1, 3}  # a tie at the k-th value keeps both
    assert kept(filter_top_k(logits, 3)) == {1, 3, 5}
    assert kept(filter_top_k(logits, 4)) == {1, 2, 3, 5}
    assert kept(filter_top_k(logits, 0)) == set(range(6)) and kept(filter_top_k(logits, 6)) == set(range(6))
    rows = filter_top_k(torch.stack([logits, -logits]), 2)  # per row
    assert kept(rows[0]) == {1, 3} and kept(rows[1]) == {0, 4}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # ranked: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    logits = probs.log()
    assert kept(filter_top_p(logits, 0.5)) == {1}  # 0.5 alone reaches 0.5
    assert kept(filter_top_p(logits, 0.51)) == {1, 3}
    assert kept(filter_top_p(logits, 0.8)) == {1, 3}
    assert kept(filter_top_p(logits, 0.81)) == {1, 3, 2}
    assert kept(filter_top_p(logits, 0.01)) == {1}  # the most likely token always stays
    assert kept(filter_top_p(logits, 1.0)) == {0, 1, 2, 3}
    kept_values = filter_top_p(logits, 0.8)
    assert torch.equal(kept_values[[1, 3]], logits[[1, 3]])  # kept logits unchanged


def test_temperature_zero_is_argmax_and_top_k_one_is_too() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next(logits, temperature=0.0), logits.argmax(-1))
    g = torch.Generator().manual_seed(1)
    assert torch.equal(sample_next(logits, temperature=1.5, top_k=1, generator=g), logits.argmax(-1))


def test_draws_follow_the_filtered_distribution() -> None:
    logits = torch.tensor([[1.0, 2.0, -3.0, 0.5]]).expand(4000, 4)
    draws = sample_next(logits, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {0, 1}
    share = (draws == 1).float().mean().item()  # softmax([1, 2])[1] = 0.731
    assert abs(share - 1 / (1 + math.exp(-1.0))) < 0.03
    draws = sample_next(logits, top_p=0.99, generator=torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {0, 1, 3}


def test_same_seed_same_samples() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    a = [sample_next(logits, 1.0, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    b = sample_next(logits, 1.0, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a[0], a[1]) and not torch.equal(a[0], b)


def test_sample_crops_the_window_to_the_context() -> None:
    seen: list[int] = []

    def forward(tokens: torch.Tensor) -> torch.Tensor:  # next id = last id + 1 (mod 10)
        seen.append(tokens.shape[1])
        return torch.nn.functional.one_hot((tokens + 1) % 10, 10).float()

    out = sample(forward, torch.tensor([[3, 4]]), max_new_tokens=6, context_length=4, temperature=0.0)
    assert out.tolist() == [[3, 4, 5, 6, 7, 8, 9, 0]]
    assert seen == [2, 3, 4, 4, 4, 4]


def test_byte_codec() -> None:
    codec = Codec({"kind": "bytes"})
    assert codec.encode("é") == [0xC3, 0xA9] and codec.decode([0xC3, 0xA9]) == "é"
    assert codec.decode([0x61, 0xC3]) == "a\ufffd"  # a cut character
    assert codec.vocab_size == 256 and codec.start_id is None


def test_codec_refuses_unknown_characters(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lmtrain.errors import LmtrainError

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "t.json"))
    codec = Codec.from_file(tmp_path / "t.json")
    assert codec.encode("hello") == [1]
    with pytest.raises(LmtrainError, match=r"--prompt: 'hello wörld' has characters"):
        codec.encode("hello wörld")


def write_checkpoint(path: Path, tokenizer: dict[str, str] | None = None) -> None:
    """A checkpoint as fit writes it (hyperparameters, weights, data state), of an untrained small model."""
    torch.manual_seed(0)
    module = LMModule(**TINY)
    module.configure_model()
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict(), "global_step": 0,
                "LMDataModule": {"tokenizer": tokenizer or {"kind": "bytes"}}}, path)


def generate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["generate", *map(str, args)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_generate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "m.ckpt"
    write_checkpoint(ckpt)
    args = ("--ckpt_path", ckpt, "--prompt", "def ", "--max-new-tokens", "12", "--seed", "3", "--num-samples", "2")
    rc, out, err = generate(capsys, *args)
    assert rc == 0, err
    samples = out.split("--- sample 2 ---\n")
    assert len(samples) == 2 and samples[0].startswith("--- sample 1 ---\ndef ") and samples[1].startswith("def ")
    assert generate(capsys, *args)[1] == out  # the same seed: the same samples
    rc, greedy, _ = generate(capsys, "--ckpt_path", ckpt, "--prompt", "x", "--max-new-tokens", "5",
                             "--temperature", "0")
    assert rc == 0 and greedy.startswith("x")


def test_generate_finds_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "logs" / "lmtrain" / "version_3" / "checkpoints"
    run.mkdir(parents=True)
    write_checkpoint(run / "last.ckpt")
    rc, out, err = generate(capsys, "--log-dir", tmp_path / "logs", "--prompt", "a", "--max-new-tokens", "3")
    assert rc == 0 and "version_3" in err and out.startswith("a")


@pytest.mark.parametrize(("args", "field"), [
    (("--temperature", "-1"), "--temperature"),
    (("--temperature", "nan"), "--temperature"),
    (("--top-p", "0"), "--top-p"),
    (("--top-p", "1.5"), "--top-p"),
    (("--top-k", "-2"), "--top-k"),
    (("--max-new-tokens", "0"), "--max-new-tokens"),
    (("--num-samples", "0"), "--num-samples"),
])
def test_generate_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
                              field: str) -> None:
    ckpt = tmp_path / "m.ckpt"
    write_checkpoint(ckpt)
    rc, out, err = generate(capsys, "--ckpt_path", ckpt, *args)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: {field}: ") and "Fix: " in err


def test_generate_bad_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = {"nothing under logs": ("--log-dir", tmp_path / "logs"),
             "missing file": ("--ckpt_path", tmp_path / "none.ckpt"),
             "a folder": ("--ckpt_path", tmp_path)}
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint at all")
    cases["garbage"] = ("--ckpt_path", garbage)
    good = tmp_path / "good.ckpt"
    write_checkpoint(good)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[:5000])
    cases["truncated"] = ("--ckpt_path", truncated)
    synthetic = tmp_path / "synthetic.ckpt"
    write_checkpoint(synthetic)
    checkpoint = torch.load(synthetic, weights_only=True)
    checkpoint["LMDataModule"] = {"tokenizer": None}
    torch.save(checkpoint, synthetic)
    cases["no tokenizer"] = ("--ckpt_path", synthetic)
    for name, args in cases.items():
        rc, out, err = generate(capsys, *args, "--prompt", "a")
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "Fix: " in err, (name, err)


@pytest.mark.slow
def test_generate_entry_point_one_line(tmp_path: Path) -> None:
    """Through ``python -m lmtrain``: exit status 2 and one line, no traceback."""
    from subprocs import own_job_env

    proc = subprocess.run([sys.executable, "-m", "lmtrain", "generate", "--log-dir", str(tmp_path)],
                          capture_output=True, text=True, env=own_job_env(), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --ckpt_path: ")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.gpu
def test_generate_on_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "m.ckpt"
    write_checkpoint(ckpt)
    args = ("--ckpt_path", ckpt, "--prompt", "def ", "--max-new-tokens", "40", "--seed", "1", "--device", "cuda")
    rc, out, err = generate(capsys, *args)
    assert rc == 0 and out.startswith("def ") and err.rstrip().endswith("cuda")
    assert generate(capsys, *args)[1] == out  # a CUDA generator of the same seed: the same draws
