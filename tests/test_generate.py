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
    assert kept(filter_top_p(logits, 1e-300)) == {1}  # also where p rounds to 0 in float32 (nothing was left)
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
    assert codec.vocab_size == 256 and codec.start_id == ord("\n")  # an empty prompt starts from a newline
    assert codec.prompt_ids("") == [ord("\n")] and codec.prompt_ids("ab") == [97, 98]


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


def write_checkpoint(path: Path, tokenizer: dict[str, str] | None = None, vocab_size: int = 256,
                     silence_below: int = 0) -> None:
    """A checkpoint as fit writes it (hyperparameters, weights, data state), of an untrained small model.

    ``silence_below``: the head's rows of ids below it are zeroed, so that their logits are 0 and the largest
    logit (the greedy choice) is an id at or above it.
    """
    torch.manual_seed(0)
    module = LMModule(**{**TINY, "vocab_size": vocab_size})
    module.configure_model()
    with torch.no_grad():
        module.model.lm_head.weight[:silence_below] = 0.0
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict(), "global_step": 0,
                "LMDataModule": {"tokenizer": tokenizer or {"kind": "bytes"}}}, path)


def small_bpe(tmp_path: Path, vocab_size: int = 300, special_tokens: tuple[str, ...] = ("<|endoftext|>",)
              ) -> dict[str, str]:
    """The tokenizer spec (as a checkpoint holds it) of a byte-level BPE of at most ``vocab_size`` tokens."""
    from lmtrain.prepare import find_corpus, train_tokenizer

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "corpus.txt").write_text("def value(self):\n    return self.name\n" * 50, encoding="utf-8")
    tokenizer = train_tokenizer(find_corpus(str(tmp_path / "corpus.txt")), vocab_size, list(special_tokens),
                                quiet=True)
    return {"kind": "bpe", "path": "tokenizer.json", "json": tokenizer.to_str()}


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


@pytest.mark.slow
def test_generate_entry_point_prompt_bytes(tmp_path: Path) -> None:
    """A prompt of raw bytes that are not UTF-8 (``--prompt $'ab\\xffcd'``), on a byte-level and a BPE run: one line,
    exit status 2."""
    from subprocs import own_job_env

    for name, tokenizer in (("bytes", None), ("bpe", small_bpe(tmp_path))):
        ckpt = tmp_path / f"{name}.ckpt"
        write_checkpoint(ckpt, tokenizer=tokenizer, vocab_size=300)
        proc = subprocess.run([sys.executable, "-m", "lmtrain", "generate", "--ckpt_path", str(ckpt), "--prompt",
                               b"ab\xffcd"], capture_output=True, text=True, env=own_job_env(), cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.startswith("error: --prompt: holds byte 0xff"), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.gpu
def test_generate_on_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "m.ckpt"
    write_checkpoint(ckpt)
    args = ("--ckpt_path", ckpt, "--prompt", "def ", "--max-new-tokens", "40", "--seed", "1", "--device", "cuda")
    rc, out, err = generate(capsys, *args)
    assert rc == 0 and out.startswith("def ") and err.rstrip().endswith("cuda")
    assert generate(capsys, *args)[1] == out  # a CUDA generator of the same seed: the same draws


# -- ids the tokenizer lacks, odd prompts and temperatures ----------------------------------------


def test_sample_draws_only_ids_below_vocab_size() -> None:
    def forward(tokens: torch.Tensor) -> torch.Tensor:  # id 300 of 400 dominates
        logits = torch.zeros(*tokens.shape, 400)
        logits[..., 300] = 10.0
        return logits

    prompt = torch.zeros(64, 1, dtype=torch.long)
    assert (sample(forward, prompt, 4, 8, temperature=0.0)[:, 1:] == 300).all()  # the model's choice without a limit
    for temperature in (0.0, 1.0, 5.0):
        out = sample(forward, prompt, 4, 8, temperature, generator=torch.Generator().manual_seed(0), vocab_size=256)
        assert int(out.max()) < 256, temperature


def test_generate_byte_run_with_a_larger_model_vocabulary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A byte-level run of model vocabulary 10,000 (the configs' size): the ids above 255 are never drawn."""
    ckpt = tmp_path / "m.ckpt"
    write_checkpoint(ckpt, vocab_size=10_000, silence_below=256)  # greedy would pick an id >= 256
    for temperature in ("0", "1"):
        rc, out, err = generate(capsys, "--ckpt_path", ckpt, "--prompt", "ab", "--max-new-tokens", "12",
                                "--temperature", temperature, "--seed", "0")
        assert rc == 0 and out.startswith("ab") and len(out.rstrip("\n").encode("utf-8", "replace")) > 2, err


def test_a_seed_torch_cannot_take_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "m.ckpt"
    write_checkpoint(ckpt)
    rc, out, err = generate(capsys, "--ckpt_path", ckpt, "--prompt", "ab", "--seed", str(10**23))
    assert rc == 2 and out == "" and err.strip().startswith("error: --seed: must lie in [-2**63, 2**64)"), err


def test_generate_bpe_smaller_than_the_model_vocabulary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Ids beyond a BPE's vocabulary would decode to nothing: they are never drawn, so the text grows."""
    spec = small_bpe(tmp_path)
    ckpt = tmp_path / "m.ckpt"
    write_checkpoint(ckpt, tokenizer=spec, vocab_size=1000, silence_below=300)
    rc, out, err = generate(capsys, "--ckpt_path", ckpt, "--prompt", "def", "--max-new-tokens", "6",
                            "--temperature", "0")
    assert rc == 0 and out.startswith("def") and len(out.rstrip("\n")) > len("def"), (out, err)


def test_tokenizer_larger_than_the_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tokenizer of 300 tokens for a model of 256 ids cannot be the run's: a prompt could encode to ids the
    model's embedding lacks. One line, exit 2, from generate and from the callback's setup."""
    from types import SimpleNamespace

    from lmtrain.callbacks import GenerateSamples
    from lmtrain.errors import LmtrainError

    spec = small_bpe(tmp_path)
    ckpt = tmp_path / "m.ckpt"
    write_checkpoint(ckpt, tokenizer=spec, vocab_size=256)
    rc, out, err = generate(capsys, "--ckpt_path", ckpt, "--prompt", "def")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("error: --tokenizer: the tokenizer tokenizer.json has ") and "Fix: " in err
    trainer = SimpleNamespace(datamodule=SimpleNamespace(tokenizer=spec))
    with pytest.raises(LmtrainError, match=r"^model\.vocab_size: .* more than the model's vocabulary of 256"):
        GenerateSamples(prompts=["def"]).setup(trainer, LMModule(**TINY), "fit")  # type: ignore[arg-type]


@pytest.mark.parametrize("bpe", [False, True])
def test_prompt_that_is_not_utf8_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], bpe: bool) -> None:
    """``--prompt $'ab\\xffcd'``: Python keeps the byte 0xff of argv as the surrogate U+DCFF; both tokenizers
    refuse it with the same line (a BPE tokenizer would raise a TypeError of its own)."""
    ckpt = tmp_path / "m.ckpt"
    write_checkpoint(ckpt, tokenizer=small_bpe(tmp_path) if bpe else None, vocab_size=300)
    rc, out, err = generate(capsys, "--ckpt_path", ckpt, "--prompt", "ab\udcffcd")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("error: --prompt: holds byte 0xff, which is not UTF-8 text.") and "Fix: " in err


def test_empty_prompt_starts_from_a_newline_or_end_of_text(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "bytes.ckpt"
    write_checkpoint(ckpt)
    rc, out, err = generate(capsys, "--ckpt_path", ckpt, "--max-new-tokens", "5", "--seed", "0")  # the default ""
    assert rc == 0 and out.startswith("\n"), err
    spec = small_bpe(tmp_path)
    ckpt = tmp_path / "bpe.ckpt"
    write_checkpoint(ckpt, tokenizer=spec, vocab_size=300)
    rc, out, err = generate(capsys, "--ckpt_path", ckpt, "--max-new-tokens", "5", "--seed", "0")
    assert rc == 0 and out.startswith("<|endoftext|>"), err
    no_specials = Codec(small_bpe(tmp_path / "plain", special_tokens=()))
    newline = no_specials.encode("\n")
    assert len(newline) == 1 and no_specials.prompt_ids("") == newline


def test_tiny_temperatures_are_greedy_and_finite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    for temperature in (1e-45, 1e-7):  # 1e-45 passes the option check, then divided logits to +-inf
        assert torch.equal(sample_next(logits, temperature, generator=g), logits.argmax(-1))
    # Just above the greedy threshold, logits far apart must not overflow fp32 (1e33 / 1e-6 = 1e39 > 3.4e38).
    huge = logits * 1e33
    assert torch.equal(sample_next(huge, 1e-6, generator=g), huge.argmax(-1))
    assert torch.equal(sample_next(huge, 1e-6, top_p=0.5, top_k=3, generator=g), huge.argmax(-1))
    ckpt = tmp_path / "m.ckpt"
    write_checkpoint(ckpt)
    outs = [generate(capsys, "--ckpt_path", ckpt, "--prompt", "x", "--max-new-tokens", "8", "--temperature", t)
            for t in ("0", "1e-45")]
    assert outs[0][0] == outs[1][0] == 0 and outs[0][1] == outs[1][1]


# -- loading ----------------------------------------------------------------------------------------


class RandomOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The random fills (``normal_``, ``uniform_``) of real tensors run while it is active: a model's initialisation
    (fills of ``meta`` tensors, which hold no memory and cost nothing, are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.overloadpacket in (torch.ops.aten.normal_, torch.ops.aten.uniform_) and not args[0].is_meta:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def test_checkpoint_is_memory_mapped_and_the_model_not_initialised(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """generate builds the model on the meta device and takes the checkpoint's (memory-mapped) tensors: no random
    initialisation, and the samples are those of the model loaded the usual way."""
    from lmtrain.config import ModelConfig
    from lmtrain.generate import build_model, load_checkpoint
    from lmtrain.model import TransformerLM

    ckpt = tmp_path / "m.ckpt"
    write_checkpoint(ckpt)
    checkpoint = load_checkpoint(ckpt)
    maps = Path("/proc/self/maps")
    if maps.is_file():  # Linux: the file is mapped, not read into memory
        assert str(ckpt.resolve()) in maps.read_text()
    with RandomOps() as spy:
        model = build_model(checkpoint, torch.device("cpu"))
    assert spy.calls == []
    with RandomOps() as spy:  # the check sees an initialisation where there is one
        TransformerLM(ModelConfig.from_module_kwargs(checkpoint["hyper_parameters"]))
    assert spy.calls
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad for t in tensors)
    assert not model.training

    # The usual way: a model built (and initialised) on the CPU, given the weights by copy.
    reference = TransformerLM(ModelConfig.from_module_kwargs(checkpoint["hyper_parameters"]))
    reference.load_state_dict({k.removeprefix("model."): v for k, v in torch.load(ckpt)["state_dict"].items()
                               if k.startswith("model.")})
    reference.eval()
    prompt = torch.tensor([list(b"def ")] * 2)
    expected = sample(reference, prompt, 20, 16, 1.0, generator=torch.Generator().manual_seed(5), vocab_size=256)
    rc, out, _ = generate(capsys, "--ckpt_path", ckpt, "--prompt", "def ", "--max-new-tokens", "20",
                          "--temperature", "1", "--seed", "5", "--num-samples", "2", "--device", "cpu")
    texts = [Codec({"kind": "bytes"}).decode(row.tolist()) for row in expected]
    assert rc == 0 and out == f"--- sample 1 ---\n{texts[0]}\n--- sample 2 ---\n{texts[1]}\n"
