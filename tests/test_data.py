"""LMDataModule: every source, window shapes, the train/val split, seeding, and every bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lmtrain.data import LMDataModule
from lmtrain.errors import LmtrainError

CONTEXT = 16
WINDOW = CONTEXT + 1


def make(**kwargs) -> LMDataModule:
    defaults = dict(batch_size=4, context_length=CONTEXT, vocab_size=1000, train_batches=3, val_batches=2)
    return LMDataModule(**{**defaults, **kwargs})


def batches(loader) -> list[torch.Tensor]:
    return list(loader)


def check_windows(dm: LMDataModule, vocab_size: int) -> None:
    for loader, n in ((dm.train_dataloader(), dm.train_batches), (dm.val_dataloader(), dm.val_batches)):
        got = batches(loader)
        assert len(got) == n
        for b in got:
            assert b.shape == (dm.batch_size, WINDOW)
            assert b.dtype == torch.int64
            assert int(b.min()) >= 0 and int(b.max()) < vocab_size


def test_synthetic_windows() -> None:
    dm = make(vocab_size=50)
    check_windows(dm, 50)
    # Window i is the same on every read; train and validation differ.
    assert torch.equal(dm.train_dataloader().dataset[5], dm.train_dataloader().dataset[5])
    assert not torch.equal(batches(dm.train_dataloader())[0], batches(dm.val_dataloader())[0])


@pytest.mark.parametrize("source", ["synthetic", "tokens"])
def test_seeded_determinism(source: str, tmp_path: Path) -> None:
    path = tmp_path / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 1000, 5000).astype(np.int32))
    kwargs = dict(source=source, path=str(path) if source == "tokens" else None)
    first, second, other = (batches(make(seed=s, **kwargs).train_dataloader()) for s in (1, 1, 2))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_tokens_npy(dtype: type, tmp_path: Path) -> None:
    tokens = np.arange(2000) % 997
    path = tmp_path / "tokens.npy"
    np.save(path, tokens.astype(dtype))
    dm = make(source="tokens", path=str(path))
    check_windows(dm, 1000)
    # Training windows are consecutive ids of the file.
    window = dm.train_dataloader().dataset[0].numpy()
    assert np.array_equal(np.diff(window) % 997, np.ones(CONTEXT))


@pytest.mark.parametrize("token_dtype", ["uint16", "uint32"])
def test_tokens_bin(token_dtype: str, tmp_path: Path) -> None:
    tokens = (np.arange(3000) * 7) % 70_000 if token_dtype == "uint32" else np.arange(3000) % 999
    path = tmp_path / "tokens.bin"
    tokens.astype(token_dtype).tofile(path)
    dm = make(source="tokens", path=str(path), token_dtype=token_dtype, vocab_size=70_000)
    check_windows(dm, 70_000)
    # Train then validation part, in order, cover the file exactly: the split holds out the last 10 %.
    assert np.array_equal(np.concatenate([dm.train_tokens, dm.val_tokens]), tokens)
    assert len(dm.val_tokens) == int(3000 * 0.1)


def test_val_fraction_sets_the_split(tmp_path: Path) -> None:
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(1000, dtype=np.int32))
    dm = make(source="tokens", path=str(path), val_fraction=0.25)
    assert len(dm.train_tokens) == 750 and len(dm.val_tokens) == 250
    assert dm.val_tokens[0] == 750
    # Validation windows come from the held-out tail only.
    assert all(int(b.min()) >= 750 for b in batches(dm.val_dataloader()))


def test_text_folder(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("hello world, " * 40)
    (tmp_path / "sub" / "b.md").write_text("ünïcode text " * 40)
    (tmp_path / "blob.bin").write_bytes(bytes([0xFF, 0xFE, 0x80]) * 100)  # not UTF-8: skipped inside a folder
    dm = make(source="text", path=str(tmp_path), vocab_size=256)
    check_windows(dm, 256)
    data = np.concatenate([dm.train_tokens, dm.val_tokens]).tobytes()
    assert data == ("hello world, " * 40).encode() + ("ünïcode text " * 40).encode()


def test_text_max_bytes_and_stdlib() -> None:
    dm = make(source="text", path="python-stdlib", vocab_size=256, max_bytes=20_000)
    assert len(dm.train_tokens) + len(dm.val_tokens) == 20_000
    assert b"def " in np.concatenate([dm.train_tokens, dm.val_tokens]).tobytes()
    check_windows(dm, 256)


def test_max_bytes_inside_a_character_keeps_the_complete_ones(tmp_path: Path) -> None:
    """A limit that falls inside a two-byte character (é) drops that character, in a file and in a folder."""
    text = tmp_path / "e.txt"
    text.write_text("é" * 100_000, encoding="utf-8")
    dm = make(source="text", path=str(text), vocab_size=256, max_bytes=100_001)
    assert np.concatenate([dm.train_tokens, dm.val_tokens]).tobytes() == "é".encode() * 50_000
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text("x" * 1000)
    (folder / "b.txt").write_text("é" * 1000, encoding="utf-8")
    (folder / "c.txt").write_text("y" * 1000)
    dm = make(source="text", path=str(folder), vocab_size=256, max_bytes=1501)
    # b.txt is cut, not skipped as if it were binary; c.txt is not reached.
    assert np.concatenate([dm.train_tokens, dm.val_tokens]).tobytes() == b"x" * 1000 + "é".encode() * 250


def test_max_bytes_cut_keeps_checking_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("café ".encode("latin-1") * 100)
    assert "UTF-8" in expect_error("data.path", source="text", path=str(path), vocab_size=256,
                                   max_bytes=301).problem


@pytest.mark.parametrize("max_bytes", [0, -5, 1.5])
def test_bad_max_bytes(max_bytes: object, tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("hello " * 100)
    expect_error("data.max_bytes", source="text", path=str(tmp_path / "t.txt"), vocab_size=256, max_bytes=max_bytes)


# -- bad inputs: each names its field and says how to fix it ---------------------------------------------


def expect_error(field: str, **kwargs) -> LmtrainError:
    with pytest.raises(LmtrainError) as info:
        make(**kwargs)
    assert info.value.field == field
    assert info.value.fix
    assert str(info.value).startswith(f"{field}: ")
    return info.value


def test_missing_file(tmp_path: Path) -> None:
    error = expect_error("data.path", source="tokens", path=str(tmp_path / "nope.npy"))
    assert "does not exist" in error.problem
    expect_error("data.path", source="text", path=str(tmp_path / "nope"))


def test_missing_path() -> None:
    expect_error("data.path", source="tokens", path=None)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    assert "empty" in expect_error("data.path", source="tokens", path=str(path)).problem
    folder = tmp_path / "folder"
    folder.mkdir()
    expect_error("data.path", source="text", path=str(folder))


def test_shorter_than_a_window(tmp_path: Path) -> None:
    path = tmp_path / "short.npy"
    np.save(path, np.arange(WINDOW - 1, dtype=np.int32))
    assert "fewer than two windows" in expect_error("data.path", source="tokens", path=str(path)).problem


def test_id_not_below_vocab_size(tmp_path: Path) -> None:
    path = tmp_path / "big.npy"
    np.save(path, np.array([1, 2, 3] * 100 + [1000], dtype=np.int32))
    error = expect_error("data.path", source="tokens", path=str(path), vocab_size=1000)
    assert "1000" in error.problem and "at least 1001" in error.fix


def test_text_needs_byte_vocab() -> None:
    expect_error("model.vocab_size", source="text", path="python-stdlib", vocab_size=100)


def test_wrong_token_dtype_size(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(1001, dtype=np.uint16).tofile(path)  # 2002 bytes: not a whole number of uint32
    assert "uint32" in expect_error("data.token_dtype", source="tokens", path=str(path), token_dtype="uint32").problem


def test_bad_npy(tmp_path: Path) -> None:
    path = tmp_path / "floats.npy"
    np.save(path, np.zeros(100, dtype=np.float32))
    expect_error("data.path", source="tokens", path=str(path))
    path = tmp_path / "matrix.npy"
    np.save(path, np.zeros((10, 10), dtype=np.int32))
    expect_error("data.path", source="tokens", path=str(path))


def test_non_utf8_text_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("café ".encode("latin-1") * 100)
    assert "UTF-8" in expect_error("data.path", source="text", path=str(path)).problem


@pytest.mark.parametrize("val_fraction", [0.0, 1.0, -0.1, 1.5])
def test_bad_val_fraction(val_fraction: float) -> None:
    expect_error("data.val_fraction", val_fraction=val_fraction)


def test_val_fraction_leaving_no_training_window(tmp_path: Path) -> None:
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(3 * WINDOW, dtype=np.int32))
    expect_error("data.val_fraction", source="tokens", path=str(path), val_fraction=0.9)


@pytest.mark.parametrize("name", ["batch_size", "context_length", "vocab_size", "train_batches", "val_batches"])
def test_bad_numbers(name: str) -> None:
    expect_error(f"data.{name}", **{name: 0})


def test_unknown_source() -> None:
    expect_error("data.source", source="parquet")


# -- one global sample order: ranks, resume, test split, shapes from the model ---------------------------


class _Trainer:
    """What setup reads from a trainer: rank, world size and the module (a simulated DDP rank)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.global_rank, self.world_size, self.lightning_module = rank, world_size, None


def _ranked(rank: int, world_size: int, **kwargs) -> LMDataModule:
    dm = make(**kwargs)
    dm.trainer = _Trainer(rank, world_size)
    dm.setup("fit")
    return dm


def _sources(tmp_path: Path) -> dict[str, dict]:
    path = tmp_path / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 1000, 5000).astype(np.int32))
    text = tmp_path / "text.txt"
    text.write_text("".join(chr(32 + i % 90) for i in range(6000)))
    return {"synthetic": {}, "tokens": {"source": "tokens", "path": str(path)},
            "text": {"source": "text", "path": str(text), "vocab_size": 256}}


@pytest.mark.parametrize("source", ["synthetic", "tokens", "text"])
@pytest.mark.parametrize("split", ["train", "val"])
def test_two_ranks_of_batch_2_read_what_one_rank_of_batch_4_reads(source: str, split: str, tmp_path: Path) -> None:
    kwargs = _sources(tmp_path)[source]
    loader = f"{split}_dataloader"
    single = batches(getattr(_ranked(0, 1, batch_size=4, **kwargs), loader)())
    ranks = [batches(getattr(_ranked(r, 2, batch_size=2, **kwargs), loader)()) for r in (0, 1)]
    assert len(single) == len(ranks[0]) == len(ranks[1])
    for i, whole in enumerate(single):
        assert torch.equal(torch.cat([ranks[0][i], ranks[1][i]]), whole)  # rank 0 first half, rank 1 second
    assert not torch.equal(ranks[0][0], ranks[1][0])


def test_epochs_continue_the_order_and_resume_skips_what_was_read() -> None:
    dm = make(train_batches=3)
    loader = dm.train_dataloader()
    # 1 rank of batch 4: global batch i is samples 4i .. 4i+3; the second epoch reads batches 3, 4, 5.
    assert list(loader.batch_sampler) == [[4 * i + k for k in range(4)] for i in range(3)]
    dm.progress.next_batch, dm.progress.batch_in_epoch = 3, 3  # what training steps count
    assert list(loader.batch_sampler)[0] == [12, 13, 14, 15]
    # Resumed after 4 batches (one into the second epoch): the rest of that epoch, from global batch 4.
    state = {**dm.state_dict(), "next_batch": 4, "batch_in_epoch": 1}
    resumed = make(train_batches=3)
    resumed.load_state_dict(state)
    assert list(resumed.train_dataloader().batch_sampler) == [[16, 17, 18, 19], [20, 21, 22, 23]]
    assert len(resumed.train_dataloader()) == 3  # a full epoch for Lightning, which counts the batches read


def test_resume_refuses_another_seed() -> None:
    state = make(seed=1).state_dict()
    with pytest.raises(LmtrainError) as info:
        make(seed=2).load_state_dict(state)
    assert info.value.field == "data.seed"


def test_test_split_is_held_out_after_validation(tmp_path: Path) -> None:
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(1000, dtype=np.int32))
    dm = make(source="tokens", path=str(path), val_fraction=0.2, test_fraction=0.1)
    assert (len(dm.train_tokens), len(dm.val_tokens), len(dm.test_tokens)) == (700, 200, 100)
    assert all(int(b.min()) >= 900 for b in batches(dm.test_dataloader()))
    assert all(700 <= int(b.min()) and int(b.max()) < 900 for b in batches(dm.val_dataloader()))


def test_without_a_test_split_test_says_it_uses_validation(tmp_path: Path) -> None:
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(1000, dtype=np.int32))
    dm = make(source="tokens", path=str(path))
    with pytest.warns(UserWarning, match="test reports the validation split"):
        test = batches(dm.test_dataloader())
    assert all(torch.equal(a, b) for a, b in zip(test, batches(dm.val_dataloader()), strict=True))


@pytest.mark.parametrize("fraction", [-0.1, 0.95])
def test_bad_test_fraction(fraction: float) -> None:
    expect_error("data.test_fraction", test_fraction=fraction)


def test_negative_token_ids(tmp_path: Path) -> None:
    path = tmp_path / "negative.npy"
    ids = np.arange(300, dtype=np.int64)
    ids[17] = -3
    np.save(path, ids)
    error = expect_error("data.path", source="tokens", path=str(path))
    assert "negative token id -3" in error.problem and "uint16" in error.fix


def test_shapes_come_from_the_model() -> None:
    from types import SimpleNamespace

    dm = LMDataModule(batch_size=2, train_batches=2, val_batches=1)  # no vocab_size, no context_length
    assert "vocab_size" not in dm.hparams and "context_length" not in dm.hparams
    with pytest.raises(LmtrainError) as info:
        dm.train_dataloader()
    assert info.value.field == "data.context_length" and "LMModule" in info.value.fix
    trainer = _Trainer(0, 1)
    trainer.lightning_module = SimpleNamespace(hparams={"vocab_size": 50, "context_length": 8})
    dm.trainer = trainer
    dm.setup("fit")
    assert (dm.vocab_size, dm.context_length) == (50, 8)
    assert batches(dm.train_dataloader())[0].shape == (2, 9)
    clash = LMDataModule(vocab_size=60, context_length=8)
    clash.trainer = trainer
    with pytest.raises(LmtrainError) as info:
        clash.setup("fit")
    assert info.value.field == "data.vocab_size"


def write_prepared(folder: Path, counts: tuple[int, int, int] = (400, 100, 50), vocab: int = 300,
                   dtype: str = "uint16") -> dict[str, np.ndarray]:
    """A folder as ``python -m lmtrain prepare`` writes it: split files, a manifest and a tokenizer file."""
    import json

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in zip(("train", "val", "test"), counts, strict=True):
        arrays[split] = rng.integers(0, vocab, n).astype(dtype)
        arrays[split].tofile(folder / f"{split}.bin")
    (folder / "tokenizer.json").write_text('{"model": "stand-in"}')
    manifest = {"format": "lmtrain-tokens", "version": 1, "vocab_size": vocab, "dtype": dtype,
                "tokenizer": "tokenizer.json",
                "splits": {s: {"file": f"{s}.bin", "tokens": n} for s, n in zip(arrays, counts, strict=True)}}
    (folder / "dataset.json").write_text(json.dumps(manifest))
    return arrays


@pytest.mark.parametrize("target", ["folder", "train.bin"])
def test_prepared_folder_brings_its_splits_and_tokenizer(target: str, tmp_path: Path) -> None:
    arrays = write_prepared(tmp_path / "ds", dtype="uint32")
    path = tmp_path / "ds" if target == "folder" else tmp_path / "ds" / "train.bin"
    dm = make(source="tokens", path=str(path), val_fraction=0.5, test_fraction=0.3)  # fractions unused
    for split in ("train", "val", "test"):
        assert np.array_equal(getattr(dm, f"{split}_tokens"), arrays[split])
    check_windows(dm, 300)
    state = dm.state_dict()["tokenizer"]
    assert state["kind"] == "bpe" and state["json"] == '{"model": "stand-in"}'
    assert Path(state["path"]) == (tmp_path / "ds" / "tokenizer.json").resolve()


def test_prepared_folder_checks(tmp_path: Path) -> None:
    write_prepared(tmp_path / "ds", vocab=1200)
    with pytest.raises(LmtrainError, match=r"^model\.vocab_size: the tokenizer of .* has 1,200 tokens"):
        make(source="tokens", path=str(tmp_path / "ds"))
    write_prepared(tmp_path / "short", counts=(400, 10, 50))
    with pytest.raises(LmtrainError, match=r"^data\.path: .*short/val\.bin \(the val split\) holds 10 tokens, "
                                           r"fewer than one window of context_length 16 \+ 1 = 17\. Fix: .*"
                                           r"--val-fraction .*model\.context_length to at most 9\.$"):
        make(source="tokens", path=str(tmp_path / "short"))
    write_prepared(tmp_path / "cut")
    (tmp_path / "cut" / "val.bin").write_bytes(b"\0" * 7)
    with pytest.raises(LmtrainError, match=r"^data\.path: .*val\.bin is missing or not the 100 uint16 ids"):
        make(source="tokens", path=str(tmp_path / "cut"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(LmtrainError, match=r"^data\.path: .* is a folder without dataset\.json"):
        make(source="tokens", path=str(tmp_path / "plain"))


@pytest.mark.parametrize(("counts", "split", "fix"), [
    ((16, 100, 50), "train", "a smaller --val-fraction or --test-fraction"),
    ((400, 100, 16), "test", "--test-fraction"),
    ((400, 1, 50), "val", "--val-fraction")])
def test_prepared_split_shorter_than_a_window_is_refused(counts: tuple[int, int, int], split: str, fix: str,
                                                         tmp_path: Path) -> None:
    """Any split one token short of a window stops setup (a pass could draw no window from it); exactly one window is
    enough."""
    write_prepared(tmp_path / "short", counts=counts)
    count = counts[("train", "val", "test").index(split)]
    with pytest.raises(LmtrainError, match=rf"^data\.path: .*{split}\.bin \(the {split} split\) holds {count} tokens"
                                           rf", fewer than one window of context_length 16 \+ 1 = 17\. Fix: .*{fix}"):
        make(source="tokens", path=str(tmp_path / "short"))
    write_prepared(tmp_path / "enough", counts=tuple(max(c, WINDOW) for c in counts))
    dm = make(source="tokens", path=str(tmp_path / "enough"), batch_size=2, train_batches=2, val_batches=2)
    assert [tuple(b.shape) for b in getattr(dm, f"{split}_dataloader")()] == [(2, WINDOW), (2, WINDOW)]


def test_prepared_folder_without_test_split_tests_on_validation(tmp_path: Path) -> None:
    arrays = write_prepared(tmp_path / "ds", counts=(400, 100, 0))
    dm = make(source="tokens", path=str(tmp_path / "ds"))
    assert dm.test_tokens is None
    with pytest.warns(UserWarning, match="prepare it again with --test-fraction"):
        loader = dm.test_dataloader()
    assert loader.dataset.tokens is dm.val_tokens and len(dm.val_tokens) == len(arrays["val"])


def test_tokenizer_state_of_each_source(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 20)
    assert make(source="text", path=str(text)).state_dict()["tokenizer"] == {"kind": "bytes"}
    assert make().state_dict()["tokenizer"] is None
    ids = tmp_path / "ids.bin"
    np.arange(200, dtype=np.uint16).tofile(ids)
    assert make(source="tokens", path=str(ids)).state_dict()["tokenizer"] is None
    (tmp_path / "tokenizer.json").write_text("{}")
    assert make(source="tokens", path=str(ids)).state_dict()["tokenizer"]["json"] == "{}"


def test_evaluation_windows_spread_over_a_short_split() -> None:
    """A split with fewer start positions (87) than evaluation windows (160): the repeated windows spread over it,
    each start used at most twice, instead of 74 copies of the last window; with room enough the windows are the
    evenly spaced ones they always were."""
    from collections import Counter

    from lmtrain.data import TokenWindows

    short = TokenWindows(np.arange(215), 129, 160, seed=0, random_offsets=False)
    starts = Counter(int(short[i][0]) for i in range(len(short)))
    assert sorted(starts) == list(range(87)) and max(starts.values()) == 2
    roomy = TokenWindows(np.arange(10_000), 129, 10, seed=0, random_offsets=False)
    assert [int(roomy[i][0]) for i in range(10)] == [i * (9871 // 9) for i in range(10)]


@pytest.mark.parametrize("seed", [-1, 2**40, 1.5])
def test_bad_seed_is_refused_before_any_batch(seed: object) -> None:
    """numpy's generators take non-negative seeds (a negative one failed mid-training on file data)."""
    with pytest.raises(LmtrainError, match=r"data\.seed"):
        LMDataModule(source="synthetic", batch_size=2, context_length=8, vocab_size=16, seed=seed)
