"""python -m lmtrain prepare: tokenizer training, token files, manifest, streaming pieces and one-line errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from lmtrain.cli import main
from lmtrain.prepare import Corpus, Progress, find_corpus, iter_chunks, split_sizes, token_dtype

EOT = "<|endoftext|>"


def write_corpus(root: Path, files: int = 3, lines: int = 150, seed: int = 0) -> list[Path]:
    """A few files of Python-like lines (with some non-ASCII text), deterministic in ``seed``."""
    rng = random.Random(seed)
    words = ["def", "return", "self", "value", "name", "for", "in", "if", "else", "import", "café", "naïve", "π"]
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        body = "".join(f"{'    ' * rng.randint(0, 2)}{' '.join(rng.choices(words, k=rng.randint(1, 8)))}\n"
                       for _ in range(lines))
        path = root / f"part_{f}.txt"
        path.write_text(body, encoding="utf-8")
        paths.append(path)
    return paths


def run_prepare(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = main(["prepare", "--quiet", *map(str, args)])
    return rc, capsys.readouterr().err


def all_tokens(out: Path) -> np.ndarray:
    manifest = json.loads((out / "dataset.json").read_text())
    return np.concatenate([np.fromfile(out / f"{s}.bin", dtype=manifest["dtype"]) for s in ("train", "val", "test")])


def test_prepare_round_trips_the_corpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenizers import Tokenizer

    paths = write_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    rc, err = run_prepare(capsys, "--input", tmp_path / "corpus", "--out", out, "--vocab-size", "300")
    assert rc == 0, err
    manifest = json.loads((out / "dataset.json").read_text())
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert manifest["vocab_size"] == tokenizer.get_vocab_size() <= 300
    assert manifest["dtype"] == "uint16" and manifest["eot_id"] == tokenizer.token_to_id(EOT)
    ids = all_tokens(out)
    n = len(ids)
    assert manifest["tokens"] == n
    assert [manifest["splits"][s]["tokens"] for s in ("train", "val", "test")] == list(split_sizes(n, 0.1, 0.05))
    # The files, in sorted order, with the end-of-text token between them: nothing lost or added.
    expected = EOT.join(p.read_text(encoding="utf-8") for p in paths)
    assert tokenizer.decode(ids.tolist(), skip_special_tokens=False) == expected
    assert sorted(p.name for p in out.iterdir()) == ["dataset.json", "test.bin", "tokenizer.json", "train.bin",
                                                    "val.bin"]


def test_prepare_reuses_a_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_corpus(tmp_path / "corpus")
    first, second = tmp_path / "a", tmp_path / "b"
    assert run_prepare(capsys, "--input", tmp_path / "corpus", "--out", first, "--vocab-size", "300")[0] == 0
    rc, err = run_prepare(capsys, "--input", tmp_path / "corpus", "--out", second,
                          "--tokenizer", first / "tokenizer.json")
    assert rc == 0, err
    assert np.array_equal(all_tokens(first), all_tokens(second))
    assert json.loads((second / "dataset.json").read_text())["tokenizer_source"] == str(first / "tokenizer.json")


def test_prepare_glob_and_single_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = write_corpus(tmp_path / "corpus", files=3)
    (tmp_path / "corpus" / "skip.md").write_text("not matched\n")
    corpus = find_corpus(str(tmp_path / "corpus" / "*.txt"))
    assert corpus.files == tuple(paths)
    assert find_corpus(str(paths[1])).files == (paths[1],)
    (tmp_path / "corpus" / "blob.bin").write_bytes(b"\x00\x01binary")
    folder = find_corpus(str(tmp_path / "corpus"))
    assert folder.skipped == 1 and len(folder.files) == 4


def test_chunks_end_at_line_ends_and_keep_every_character(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    text = "".join(f"line {i} é€😀\n" for i in range(40)) + "no newline at the end"
    path.write_text(text, encoding="utf-8")
    corpus = Corpus(str(path), (path,), path.stat().st_size)
    chunks = list(iter_chunks(corpus, None, chunk_bytes=16))
    assert "".join(chunks) == text
    assert len(chunks) > 10 and all(c.endswith("\n") for c in chunks[:-1])


def test_separator_between_files_only(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first\n")
    b.write_text("second\n")
    chunks = list(iter_chunks(Corpus("x", (a, b), 14), EOT))
    assert chunks == ["first\n", EOT, "second\n"]


def test_progress_lines(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress("encoding", 3_000_000, min_bytes=0, every_s=0.0)
    progress.advance(1_500_000)
    err = capsys.readouterr().err
    assert err.startswith("prepare: encoding 1.5 / 3.0 MB (50%), ") and err.rstrip().endswith("MB/s")
    Progress("encoding", 3_000_000, quiet=True, min_bytes=0, every_s=0.0).advance(10)
    assert capsys.readouterr().err == ""


def test_token_dtype() -> None:
    assert token_dtype(10_000) == "uint16" and token_dtype(65_536) == "uint16" and token_dtype(65_537) == "uint32"


def _bad(capsys: pytest.CaptureFixture[str], out: Path, *args: str, field: str) -> None:
    before = sorted(out.rglob("*")) if out.exists() else None
    rc, err = run_prepare(capsys, *args)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {field}: ") and "Fix: " in lines[0]
    assert (sorted(out.rglob("*")) if out.exists() else None) == before  # nothing written


def test_prepare_errors_write_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_corpus(tmp_path / "corpus", files=1)
    out = tmp_path / "out"
    _bad(capsys, out, "--input", tmp_path / "missing", "--out", out, field="--input")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    _bad(capsys, out, "--input", tmp_path / "empty", "--out", out, field="--input")
    _bad(capsys, out, "--input", tmp_path / "corpus", "--out", out, "--vocab-size", "200", field="--vocab-size")
    _bad(capsys, out, "--input", tmp_path / "corpus", "--out", out, "--tokenizer", tmp_path / "nope.json",
         field="--tokenizer")
    _bad(capsys, out, "--input", tmp_path / "corpus", "--out", out, "--val-fraction", "0", field="--val-fraction")
    (tmp_path / "afile").write_text("x")
    _bad(capsys, tmp_path / "afile", "--input", tmp_path / "corpus", "--out", tmp_path / "afile" / "sub",
         field="--out")


def test_prepare_refuses_empty_splits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A corpus too small for a validation split, or for a test split that was asked for: one line, nothing
    written (fit could not use the folder). --vocab-size 257 (the bytes and <|endoftext|>, no merges) makes one
    token per byte."""
    (tmp_path / "ten.txt").write_text("abcdefghij")
    (tmp_path / "five.txt").write_text("abcde")
    out = tmp_path / "out"
    _bad(capsys, out, "--input", tmp_path / "ten.txt", "--out", out, field="--input")  # 10,000 tokens: val 0
    _bad(capsys, out, "--input", tmp_path / "ten.txt", "--out", out, "--vocab-size", "257",
         field="--input")  # 10 tokens: val 1, test 0 of 0.05
    _bad(capsys, out, "--input", tmp_path / "five.txt", "--out", out, "--vocab-size", "257", "--test-fraction", "0",
         field="--input")  # 5 tokens: val 0
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = run_prepare(capsys, "--input", tmp_path / "ten.txt", "--out", out, "--vocab-size", "257")
    assert rc == 2 and "too few for a test split of 0.05" in err and "--test-fraction 0" in err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    rc = main(["prepare", "--input", str(tmp_path / "ten.txt"), "--out", str(out)])  # not --quiet: still one line
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: --input: "), err
    rc, err = run_prepare(capsys, "--input", tmp_path / "ten.txt", "--out", out, "--vocab-size", "257",
                          "--test-fraction", "0")  # no test split asked for: val 1, written
    assert rc == 0, err
    splits = json.loads((out / "dataset.json").read_text())["splits"]
    assert [splits[s]["tokens"] for s in ("train", "val", "test")] == [9, 1, 0]


def test_prepare_refuses_another_dataset_in_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_corpus(tmp_path / "corpus", files=1)
    write_corpus(tmp_path / "other", files=1, seed=1)
    out = tmp_path / "out"
    assert run_prepare(capsys, "--input", tmp_path / "corpus", "--out", out, "--vocab-size", "300")[0] == 0
    manifest = (out / "dataset.json").read_text()
    _bad(capsys, out, "--input", tmp_path / "other", "--out", out, "--vocab-size", "300", field="--out")
    assert (out / "dataset.json").read_text() == manifest
    # The same inputs again rewrite the folder; --force replaces another dataset.
    assert run_prepare(capsys, "--input", tmp_path / "corpus", "--out", out, "--vocab-size", "300")[0] == 0
    assert run_prepare(capsys, "--input", tmp_path / "other", "--out", out, "--vocab-size", "300", "--force")[0] == 0
    assert json.loads((out / "dataset.json").read_text())["source"]["input"] == str(tmp_path / "other")
    assert not list(out.glob(".prepare-*"))


def test_prepare_fit_generate_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The fast version of the first day: prepare, a few steps of fit on the folder, generate from the checkpoint."""
    import lightning.pytorch as pl
    import torch

    from lmtrain.data import LMDataModule
    from lmtrain.module import LMModule

    write_corpus(tmp_path / "corpus")
    ds = tmp_path / "ds"
    assert run_prepare(capsys, "--input", tmp_path / "corpus", "--out", ds, "--vocab-size", "320")[0] == 0
    torch.manual_seed(0)
    module = LMModule(size="tiny", vocab_size=320, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    data = LMDataModule(source="tokens", path=str(ds), batch_size=2, train_batches=10, val_batches=1)
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         default_root_dir=tmp_path)
    trainer.fit(module, data)
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["LMDataModule"]["tokenizer"]
    assert saved["json"] == (ds / "tokenizer.json").read_text(encoding="utf-8")
    rc = main(["generate", "--ckpt_path", str(ckpt), "--prompt", "def ", "--max-new-tokens", "8", "--seed", "0"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.out.startswith("def ") and str(ds / "tokenizer.json") in captured.err


@pytest.mark.slow
def test_prepare_fit_generate_through_the_command_line(tmp_path: Path) -> None:
    """prepare on a generated corpus, fit the tiny model on its tokens for 50 steps, generate: as a user types it."""
    import subprocess
    import sys

    from subprocs import ROOT, own_job_env

    write_corpus(tmp_path / "corpus", files=4, lines=400)

    def lmtrain(*args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "lmtrain", *args], capture_output=True, text=True,
                              env=own_job_env(), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    lmtrain("prepare", "--input", "corpus", "--out", "data/corpus", "--vocab-size", "400")
    lmtrain("fit", "--config", str(ROOT / "configs" / "tiny_bpe.yaml"), "--data.path", "data/corpus",
            "--model.vocab_size", "400", "--model.context_length", "32", "--model.d_model", "64",
            "--model.num_layers", "2", "--model.num_heads", "2", "--model.d_ff", "128", "--data.batch_size", "4",
            "--data.val_batches", "2", "--trainer.max_steps", "50", "--trainer.val_check_interval", "25",
            "--trainer.enable_progress_bar", "false")
    assert (tmp_path / "logs" / "lmtrain" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    out = lmtrain("generate", "--ckpt_path", "last", "--prompt", "def ", "--max-new-tokens", "30", "--seed", "0",
                  "--num-samples", "2")
    samples = out.stdout.split("--- sample 2 ---\n")
    assert len(samples) == 2 and samples[0].startswith("--- sample 1 ---\ndef ") and samples[1].startswith("def ")
    assert "data/corpus/tokenizer.json" in out.stderr
