"""python -m lmtrain prepare: tokenizer training, token files, manifest, streaming pieces and one-line errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from lmtrain.cli import main
from lmtrain.prepare import Corpus, Progress, find_corpus, iter_chunks, split_sizes, token_dtype, tokens_needed

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


def test_a_vocabulary_larger_than_the_corpus_can_give_learns_what_it_can(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The largest size that fits uint32 ids (2**32 - 1) learns the same vocabulary as any size beyond what the
    corpus holds (the trainer allocated for the whole request and aborted the process)."""
    write_corpus(tmp_path / "corpus", files=1, lines=60)
    sizes = {}
    for request in (100_000, 2**32 - 1):
        rc, err = run_prepare(capsys, "--input", tmp_path / "corpus", "--out", tmp_path / str(request),
                              "--vocab-size", request)
        assert rc == 0, err
        sizes[request] = json.loads((tmp_path / str(request) / "dataset.json").read_text())["vocab_size"]
        assert not list((tmp_path / str(request)).glob(".prepare-*"))
    assert sizes[100_000] == sizes[2**32 - 1] < 100_000
    rc, err = run_prepare(capsys, "--input", tmp_path / "corpus", "--out", tmp_path / "big", "--vocab-size", 2**32)
    assert rc == 2 and "does not fit in uint32 ids" in err


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


def test_prepare_refuses_splits_too_short_for_any_context(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --context-length, a split that fit reads needs 2 tokens (one window of context_length 1): a corpus too
    small for that is refused with one line, nothing written. --vocab-size 257 (the bytes and <|endoftext|>, no
    merges) makes one token per byte."""
    (tmp_path / "ten.txt").write_text("abcdefghij")
    (tmp_path / "twenty.txt").write_text("abcdefghij" * 2)
    out = tmp_path / "out"
    _bad(capsys, out, "--input", tmp_path / "ten.txt", "--out", out, field="--input")  # 10,000 tokens: val 0
    _bad(capsys, out, "--input", tmp_path / "ten.txt", "--out", out, "--vocab-size", "257", "--test-fraction", "0",
         field="--input")  # 10 tokens: val 1, a window of no context
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = run_prepare(capsys, "--input", tmp_path / "twenty.txt", "--out", out, "--vocab-size", "257")
    assert rc == 2 and ("(train 17, val 2, test 1): the test split holds 1, fewer than one window of context_length 1 "
                        "(the least)") in err, err
    assert "--test-fraction (0 for no test split)" in err and "at least 40 tokens with these fractions" in err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    rc = main(["prepare", "--input", str(tmp_path / "ten.txt"), "--out", str(out)])  # not --quiet: still one line
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: --input: "), err
    rc = main(["prepare", "--input", str(tmp_path / "twenty.txt"), "--out", str(out), "--vocab-size", "257",
               "--test-fraction", "0"])  # no test split asked for: val 2, written
    err = capsys.readouterr().err
    assert rc == 0, err
    assert err.rstrip().endswith("splits long enough for a context_length up to 1")
    splits = json.loads((out / "dataset.json").read_text())["splits"]
    assert [splits[s]["tokens"] for s in ("train", "val", "test")] == [18, 2, 0]


def test_prepare_refuses_splits_shorter_than_the_context(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With --context-length N every split that fit reads must hold N + 1 tokens; the refusal names the split, its
    count, the window and how much text would do. 301 one-byte tokens split into train 256, val 30, test 15."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefghij" * 30 + "\n")
    out = tmp_path / "out"
    base = ("--input", corpus, "--out", out, "--vocab-size", "257")
    cases = [(("--context-length", "64"), "the val split holds 30, fewer than one window of --context-length 64 + "
              "1 = 65 tokens", "a larger --val-fraction, or a shorter --context-length (at most 29 for this val"),
             (("--context-length", "15"), "the test split holds 15, fewer than one window of --context-length 15 + "
              "1 = 16 tokens", "a larger --test-fraction (0 for no test split), or a shorter --context-length (at "
              "most 14 for this test"),
             (("--context-length", "20", "--val-fraction", "0.5", "--test-fraction", "0.45"),
              "(train 16, val 150, test 135): the train split holds 16, fewer than one window of --context-length "
              "20 + 1 = 21", "a smaller --val-fraction or --test-fraction, or a shorter --context-length (at most 15")]
    for extra, problem, fix in cases:
        _bad(capsys, out, *base, *extra, field="--input")
        err = run_prepare(capsys, *base, *extra)[1]
        assert problem in err.split(" Fix: ")[0] and fix in err.split(" Fix: ")[1], err
    _bad(capsys, out, *base, "--context-length", "0", field="--context-length")
    rc, err = run_prepare(capsys, *base, "--context-length", "14")  # test holds exactly one window
    assert rc == 0, err
    # The text the refusal asks for is enough, one token less is not.
    err = run_prepare(capsys, *base, "--context-length", "64", "--force")[1]
    need = int(err.split("give more text (at least ")[1].split(" tokens")[0].replace(",", ""))
    assert need == tokens_needed(65, 0.1, 0.05)
    for size, rc in ((need - 1, 2), (need, 0)):
        corpus.write_text("a" * size)
        assert run_prepare(capsys, *base, "--context-length", "64", "--force")[0] == rc


@pytest.mark.parametrize(("window", "val", "test"), [(2, 0.1, 0.05), (65, 0.1, 0.05), (129, 0.29, 0.0),
                                                     (17, 0.07, 0.03), (1000, 0.5, 0.45), (50, 0.3, 0.3)])
def test_tokens_needed_is_where_every_larger_corpus_serves(window: int, val: float, test: float) -> None:
    """One more than the largest corpus size (counted well past window / fraction) that leaves a split in use short
    of a window: the training split can shrink by a token as the corpus grows, so the first size that serves is not
    always the answer."""
    used = [0, 1, 2] if test > 0 else [0, 1]
    smallest = min([1 - val - test, val] + ([test] if test > 0 else []))
    short = [n for n in range(1, int(3 * window / smallest))
             if min(split_sizes(n, val, test)[i] for i in used) < window]
    assert tokens_needed(window, val, test) == short[-1] + 1


def test_prepared_splits_serve_the_context_they_were_checked_for(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A folder written with --context-length N gives validation and test batches of N + 1 tokens; the data module
    refuses a longer context at setup, naming the file."""
    from lmtrain.data import LMDataModule
    from lmtrain.errors import LmtrainError

    (tmp_path / "c.txt").write_text("abcdefghij" * 30 + "\n")
    out = tmp_path / "out"
    assert run_prepare(capsys, "--input", tmp_path / "c.txt", "--out", out, "--vocab-size", "257",
                       "--context-length", "14")[0] == 0
    data = LMDataModule(source="tokens", path=str(out), batch_size=2, context_length=14, vocab_size=257,
                        train_batches=1, val_batches=2)
    for loader in (data.val_dataloader(), data.test_dataloader()):
        assert [tuple(b.shape) for b in loader] == [(2, 15), (2, 15)]
    with pytest.raises(LmtrainError, match=r"^data\.path: .*test\.bin \(the test split\) holds 15 tokens, fewer "
                                           r"than one window of context_length 15 \+ 1 = 16\."):
        LMDataModule(source="tokens", path=str(out), context_length=15, vocab_size=257)


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
