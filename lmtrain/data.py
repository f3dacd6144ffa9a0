"""LMDataModule: batches of token windows from random ids, token files or text files.

Each sample is a window of ``context_length + 1`` token ids (int64); the module splits it into inputs
``window[:, :-1]`` and targets ``window[:, 1:]``. Sources:

    synthetic   uniformly random ids in [0, vocab_size): the course's benchmark input, no I/O.
    tokens      token ids, memory-mapped: a folder written by ``python -m lmtrain prepare`` (or its
                ``train.bin``), whose ``dataset.json`` names the train/val/test files, their dtype and the
                ``tokenizer.json`` beside them; or one pre-tokenised file, ``.npy`` (any integer dtype) or a
                raw ``.bin`` of ``token_dtype`` (uint16 or uint32) ids, split as below.
    text        UTF-8 text files (a file or a folder, read recursively), one token per byte (vocab 256).
                ``path: python-stdlib`` reads the running Python's standard library source (``*.py``),
                a corpus every machine has.

A prepared folder brings its own splits (``val_fraction``/``test_fraction`` were prepare's options and are
not used here; an empty test split makes ``test`` report the validation part, with a warning); a split shorter
than one window of ``context_length + 1`` tokens stops setup with a line naming its file (``prepare
--context-length`` refuses to write such a folder). Other files
are split, in order, into a train part, a validation part (the next ``val_fraction`` of the
tokens) and a test part (the last ``test_fraction``; with 0, ``test`` reports the validation part and
says so). Validation and test windows are fixed and evenly spaced.

Training data follows one global sample order fixed by ``seed``: sample ``s`` is the same window on
every run (synthetic: ids seeded by ``s``; files: a random offset drawn from ``(seed, s)``), and global
batch ``i`` holds samples ``[i * G, (i + 1) * G)`` with ``G = world_size * batch_size``. Rank ``r`` of
``world_size`` reads ``[i * G + r * batch_size, i * G + (r + 1) * batch_size)``, so 2 ranks of batch 2
see exactly what 1 rank of batch 4 sees. An epoch is ``train_batches`` global batches; later epochs
continue the order (new windows), with no reload of the loader needed. The number of batches read is
part of the module's ``state_dict``, which Lightning stores in every checkpoint: a resumed run reads
exactly the batches an uninterrupted run would have read next. (Set the epoch length with
``train_batches``: a smaller ``trainer.limit_train_batches`` ends epochs early, and a run resumed at
such an epoch's end would start its next epoch at another point of the order.)

The tokenizer that turns the ids back into text (``tokenizer``: raw bytes for ``text``, the
``tokenizer.json`` found beside the token files for ``tokens``) is part of the ``state_dict`` too, so that
``python -m lmtrain generate`` decodes a checkpoint's samples with the run's own tokenizer.

Everything is checked when the module is built (or, when ``vocab_size``/``context_length`` are left
to the model, in ``setup``), before any training starts.
"""

from __future__ import annotations

import codecs
import json
import sysconfig
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lmtrain.errors import LmtrainError
from lmtrain.prepare import MANIFEST, MORE_TOKENS_FOR, STDLIB_ALIAS, TOKENIZER_FILE

Source = Literal["synthetic", "tokens", "text"]
Split = Literal["train", "val", "test"]
_TEXT_SUFFIXES_STDLIB = (".py",)
#: Seed offsets of the validation and test draws, so that no split repeats the training windows.
_SPLIT_SEED_OFFSET = {"train": 0, "val": 7919, "test": 2 * 7919}


class SyntheticWindows(Dataset):
    """Windows of uniformly random ids; window i is the same on every read (seeded by ``seed`` and i).

    ``length`` is one epoch; any index ``i >= 0`` is valid (later epochs read further along the order).
    """

    def __init__(self, vocab_size: int, window: int, length: int, seed: int) -> None:
        self.vocab_size, self.window, self.length, self.seed = vocab_size, window, length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randint(0, self.vocab_size, (self.window,), generator=g)


class TokenWindows(Dataset):
    """Windows of ``window`` consecutive ids from a 1-D token array (memory-mapped or in memory).

    With ``random_offsets`` window i starts at a random offset drawn from (seed, i), for any ``i >= 0``
    (``length`` is one epoch); otherwise ``length`` windows tile the array from the start, evenly spaced.
    """

    def __init__(self, tokens: np.ndarray, window: int, length: int, seed: int, random_offsets: bool) -> None:
        self.tokens, self.window, self.length = tokens, window, length
        self.seed, self.random_offsets = seed, random_offsets
        self.max_start = len(tokens) - window
        self.stride = max(1, self.max_start // max(1, length - 1)) if length > 1 else 0

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.random_offsets:
            rng = np.random.default_rng((self.seed, i))
            start = int(rng.integers(0, self.max_start + 1))
        elif self.max_start >= self.length - 1:
            start = i * self.stride  # at least one token apart: the same windows as ever
        else:
            # fewer start positions than windows: spread the repeats over the array instead of piling them on the
            # last window (the validation loss would be mostly that window's)
            start = i * self.max_start // (self.length - 1)
        # A copy: an int64 memmap slice would be a read-only view, which torch.from_numpy warns about.
        return torch.from_numpy(np.array(self.tokens[start:start + self.window], dtype=np.int64))


@dataclass
class ReadProgress:
    """How far training has read the global sample order (part of the data module's checkpoint state).

    Attributes:
        next_batch: global batches consumed by training steps so far, over all epochs: the next one to read.
        batch_in_epoch: of those, how many belong to the current epoch.
        resumed: set when loaded from a checkpoint; the next epoch started then continues the interrupted one.
    """

    next_batch: int = 0
    batch_in_epoch: int = 0
    resumed: bool = False


class GlobalOrderSampler(DistributedSampler):
    """Sample indices of one rank's share of the global sample order, batch by batch.

    Global batch ``i`` holds samples ``[i * W * b, (i + 1) * W * b)`` for ``W`` ranks of batch ``b``;
    rank ``r`` yields ``[i * W * b + r * b, i * W * b + (r + 1) * b)``. With a ``progress`` (training),
    each epoch starts where the previous one stopped, and an epoch resumed from a checkpoint yields only
    the batches it had not read; without one (validation, test), every pass reads batches
    ``0 .. batches - 1``.

    A ``DistributedSampler`` subclass so that Lightning, under DDP, keeps it rather than wrapping it in
    one of its own (which would reshuffle the order per rank).

    Args:
        dataset: the windows; only its length matters here.
        batches: global batches per epoch (pass).
        batch_size: samples per batch on one rank.
        rank: this process's rank.
        world_size: number of ranks.
        progress: the training read position, or None for a fixed pass.
    """

    def __init__(self, dataset: Dataset, batches: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 progress: ReadProgress | None = None) -> None:
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        self.batches, self.batch_size, self.progress = batches, batch_size, progress

    def __len__(self) -> int:
        # A full epoch, also when resuming mid-epoch: Lightning counts the batches already read itself.
        return self.batches * self.batch_size

    def _epoch(self) -> tuple[int, int]:
        """(first global batch, number of batches) of the pass about to start."""
        p = self.progress
        if p is None:
            return 0, self.batches
        if p.resumed and p.batch_in_epoch < self.batches:
            count = self.batches - p.batch_in_epoch
        else:
            p.batch_in_epoch, count = 0, self.batches
        p.resumed = False
        return p.next_batch, count

    def __iter__(self) -> Iterator[int]:
        first, count = self._epoch()
        global_batch = self.num_replicas * self.batch_size
        for i in range(first, first + count):
            start = i * global_batch + self.rank * self.batch_size
            yield from range(start, start + self.batch_size)


class ResumableLoader(DataLoader):
    """A DataLoader over a ``GlobalOrderSampler`` whose read position Lightning saves and restores.

    Having ``state_dict``/``load_state_dict`` marks the loader as resumable to Lightning, which stores its
    state in the checkpoint's loop state next to the data module's (both hold the same position).
    """

    def state_dict(self) -> dict[str, int]:
        progress = self.sampler.progress or ReadProgress()
        return {"next_batch": progress.next_batch, "batch_in_epoch": progress.batch_in_epoch}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        progress = self.sampler.progress
        if progress is not None:
            progress.next_batch, progress.batch_in_epoch = state_dict["next_batch"], state_dict["batch_in_epoch"]
            progress.resumed = True


#: What fixes the training sample order (:func:`data_order`'s keys) and the option that sets each.
_ORDER_OPTIONS = {"seed": "data.seed", "source": "data.source", "global_batch_size": "data.batch_size",
                  "train_batches": "data.train_batches"}


def data_order(seed: int, source: str, batch_size: int, world_size: int, train_batches: int) -> dict[str, Any]:
    """What fixes the training sample order, as ``LMDataModule.state_dict`` stores it in a checkpoint: the seed, the
    source, the global batch (``batch_size`` per process x ``world_size`` processes) and the epoch's batches."""
    return {"seed": seed, "source": source, "global_batch_size": batch_size * world_size,
            "train_batches": train_batches}


def check_data_order(saved: dict[str, Any], run: dict[str, Any]) -> None:
    """Refuse to resume a checkpoint's data order that this run's options cannot continue exactly (called when a
    fit restores the data module's state, and by the command line before the trainer exists).

    Args:
        saved: the checkpoint's data-module state (``LMDataModule.state_dict``; keys it lacks are not compared).
        run: this run's :func:`data_order`.

    Raises:
        LmtrainError: another seed, source, global batch or epoch size, naming the option to change.
    """
    for key, option in _ORDER_OPTIONS.items():
        if key in saved and saved[key] != run[key]:
            what = "data.batch_size x number of devices" if key == "global_batch_size" else option
            raise LmtrainError(option, f"the checkpoint was written with {key}={saved[key]!r}, this run has "
                               f"{run[key]!r}, so the data order cannot continue where it stopped.",
                               f"resume with {what} = {saved[key]!r}, or start a new run without --ckpt_path.")


class LMDataModule(pl.LightningDataModule):
    """Token windows for language-model training, in a seed-determined order that checkpoints keep.

    Args:
        source: ``synthetic`` (uniformly random ids in [0, vocab_size), no I/O), ``tokens`` (a .npy or raw .bin
            token file at ``path``, memory-mapped) or ``text`` (UTF-8 files at ``path``, one token per byte,
            vocab 256; ``path: python-stdlib`` reads the Python standard library).
        path: a folder written by ``prepare`` or one of its split files, or a token file (``tokens``); a text
            file / folder / ``python-stdlib`` (``text``).
        batch_size: sequences per batch on each rank (the global batch is ``batch_size * world_size``).
        context_length: tokens per input sequence (windows hold one more, for the targets). Linked to
            ``model.context_length`` by the command line; None takes the model's in ``setup``.
        vocab_size: the model's vocabulary; every id in the data must be below it. Linked to
            ``model.vocab_size`` by the command line; None takes the model's in ``setup``.
        token_dtype: element type of a raw ``.bin`` token file (``uint16`` or ``uint32``); a prepared folder's
            manifest gives its own.
        val_fraction: share of a file's tokens held out for validation (files only; not a prepared folder's).
        test_fraction: share of a file's tokens held out for ``test``, after the validation part (files
            only). 0: ``test`` reports the validation part (with a warning saying so).
        train_batches: global batches in one training epoch.
        val_batches: global batches in one validation (or test) pass.
        max_bytes: read at most this many bytes of text (``text`` only; None reads everything); a character that
            the limit cuts is left out whole.
        num_workers: DataLoader worker processes.
        seed: seed of the global sample order (synthetic ids and window offsets).
    """

    def __init__(
        self,
        source: Source = "synthetic",
        path: str | None = None,
        batch_size: int = 4,
        context_length: int | None = None,
        vocab_size: int | None = None,
        token_dtype: Literal["uint16", "uint32"] = "uint16",
        val_fraction: float = 0.1,
        test_fraction: float = 0.0,
        train_batches: int = 1000,
        val_batches: int = 10,
        max_bytes: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        # Shapes left to the model are not hyperparameters of their own: Lightning would find them None
        # here and set in the module, and refuse to merge the two.
        from_model = [name for name, value in (("context_length", context_length), ("vocab_size", vocab_size))
                      if value is None]
        self.save_hyperparameters(ignore=from_model)
        self.source, self.path = source, path
        self.batch_size, self.context_length, self.vocab_size = batch_size, context_length, vocab_size
        self.token_dtype, self.val_fraction, self.test_fraction = token_dtype, val_fraction, test_fraction
        self.train_batches, self.val_batches = train_batches, val_batches
        self.max_bytes, self.num_workers, self.seed = max_bytes, num_workers, seed
        self.rank, self.world_size = 0, 1
        self.progress = ReadProgress()
        self._check_numbers()
        self.train_tokens: np.ndarray | None = None
        self.val_tokens: np.ndarray | None = None
        self.test_tokens: np.ndarray | None = None
        #: How ids become text: ``{"kind": "bytes"}``, ``{"kind": "bpe", "path": ..., "json": ...}``, or None.
        self.tokenizer: dict[str, str] | None = {"kind": "bytes"} if source == "text" else None
        self._prepared = False
        if context_length is not None and vocab_size is not None:
            self._prepare()  # bad data stops here, before a trainer writes anything

    def _prepare(self) -> None:
        """Check the shapes against the data and read and split the files (once)."""
        if self._prepared:
            return
        for name in ("context_length", "vocab_size"):
            value = getattr(self, name)
            if value is None:
                raise LmtrainError(f"data.{name}", "is not set, and there is no model to take it from.",
                                   f"pass {name}= to LMDataModule, or train it with an LMModule, whose "
                                   f"{name} it then uses.")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise LmtrainError(f"data.{name}", f"must be a positive integer, got {value!r}.",
                                   f"set data.{name} to a whole number above 0.")
        if self.source == "text" and self.vocab_size < 256:
            raise LmtrainError("model.vocab_size",
                               f"text data has byte ids up to 255 but vocab_size={self.vocab_size}.",
                               "set model.vocab_size to at least 256.")
        if self.source != "synthetic":
            self.train_tokens, self.val_tokens, self.test_tokens = self._load_and_split()
        self._prepared = True

    # -- checks ---------------------------------------------------------------------------------

    def _check_numbers(self) -> None:
        if self.source not in ("synthetic", "tokens", "text"):
            raise LmtrainError("data.source", f"unknown source {self.source!r}.", "use synthetic, tokens or text.")
        for name in ("batch_size", "context_length", "vocab_size", "train_batches", "val_batches"):
            value = getattr(self, name)
            if value is None and name in ("context_length", "vocab_size"):
                continue  # taken from the model in setup
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise LmtrainError(f"data.{name}", f"must be a positive integer, got {value!r}.",
                                   f"set data.{name} to a whole number above 0.")
        if not 0.0 < self.val_fraction < 1.0:
            raise LmtrainError("data.val_fraction", f"must lie strictly between 0 and 1, got {self.val_fraction}.",
                               "use e.g. 0.1.")
        if not 0.0 <= self.test_fraction < 1.0 or self.val_fraction + self.test_fraction >= 1.0:
            raise LmtrainError("data.test_fraction", f"must lie in [0, 1) and leave training data next to "
                               f"val_fraction={self.val_fraction}, got {self.test_fraction}.",
                               "use e.g. 0.05, or 0 to test on the validation part.")
        if self.max_bytes is not None and (isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int)
                                           or self.max_bytes <= 0):
            raise LmtrainError("data.max_bytes", f"must be a positive integer or None, got {self.max_bytes!r}.",
                               "use e.g. 1000000, or leave it unset to read all the text.")
        if self.num_workers < 0:
            raise LmtrainError("data.num_workers", "must be 0 or more.", "use 0 to load in the main process.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**40:
            # numpy's generators take non-negative seeds; the batch index is mixed in, which must not overflow
            raise LmtrainError("data.seed", f"must be a whole number in [0, 2**40), got {self.seed!r}.",
                               "use e.g. 0.")
        if self.source != "synthetic" and not self.path:
            raise LmtrainError("data.path", f"source {self.source!r} needs a path.",
                               "set data.path to a token file (tokens) or a text file or folder (text).")

    def _load_and_split(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        folder = self._prepared_folder()
        if folder is not None:
            return self._read_prepared(folder)
        tokens = self._read_text() if self.source == "text" else self._read_tokens()
        window = self.context_length + 1
        parts = 3 if self.test_fraction > 0 else 2
        if len(tokens) < parts * window:
            count = "three" if parts == 3 else "two"
            held_out = "one each for validation and test" if parts == 3 else "one for validation"
            raise LmtrainError("data.path", f"{self.path} holds {len(tokens):,} tokens, fewer than {count} windows "
                               f"of context_length + 1 = {window} (one for training, {held_out}).",
                               "use more data or a smaller model.context_length.")
        n_val = max(window, int(len(tokens) * self.val_fraction))
        n_test = max(window, int(len(tokens) * self.test_fraction)) if self.test_fraction > 0 else 0
        n_train = len(tokens) - n_val - n_test
        if n_train < window:
            field = "data.test_fraction" if n_test else "data.val_fraction"
            raise LmtrainError(field, f"leaves fewer than {window} training tokens.",
                               "lower data.val_fraction / data.test_fraction or use more data.")
        test = tokens[n_train + n_val:] if n_test else None
        return tokens[:n_train], tokens[n_train:n_train + n_val], test

    def _prepared_folder(self) -> Path | None:
        """The ``prepare`` folder that ``path`` names (the folder or a file in it), or None for other data."""
        if self.source != "tokens":
            return None
        path = Path(self.path)
        if path.is_dir():
            folder = path
        elif path.name in ("train.bin", "val.bin", "test.bin"):
            folder = path.parent
        else:
            return None
        return folder if (folder / MANIFEST).is_file() else None

    def _read_prepared(self, folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The train/val/test splits of a folder written by ``prepare``, memory-mapped, and its tokenizer."""
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            vocab, dtype, splits = manifest["vocab_size"], manifest["dtype"], manifest["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise LmtrainError("data.path", f"{folder / MANIFEST} is not a readable prepare manifest ({e}).",
                               "write the folder again with python -m lmtrain prepare.") from None
        if vocab > self.vocab_size:
            raise LmtrainError("model.vocab_size", f"the tokenizer of {folder} has {vocab:,} tokens but "
                               f"vocab_size={self.vocab_size}.", f"set model.vocab_size to at least {vocab}.")
        window = self.context_length + 1
        arrays: dict[str, np.ndarray | None] = {}
        for split in ("train", "val", "test"):
            entry = splits.get(split) or {"file": f"{split}.bin", "tokens": 0}
            file = folder / entry["file"]
            count = int(entry["tokens"])
            if split == "test" and count == 0:
                arrays[split] = None
                continue
            if not file.is_file() or file.stat().st_size != count * np.dtype(dtype).itemsize:
                raise LmtrainError("data.path", f"{file} is missing or not the {count:,} {dtype} ids that "
                                   f"{MANIFEST} lists.", "write the folder again with python -m lmtrain prepare.")
            if count < window:
                # Every pass draws whole windows: validation or test could draw no batch, training none at all.
                shorter = f", or set model.context_length to at most {count - 1:,}" if count > 1 else ""
                raise LmtrainError("data.path", f"{file} (the {split} split) holds {count:,} tokens, fewer than one "
                                   f"window of context_length {self.context_length:,} + 1 = {window:,}.",
                                   f"prepare it again with more text or {MORE_TOKENS_FOR[split]} (--context-length "
                                   f"{self.context_length} makes prepare check each split){shorter}.")
            tokens = np.memmap(file, dtype=dtype, mode="r")
            self._check_ids(tokens, str(file))
            arrays[split] = tokens
        self.tokenizer = self._tokenizer_beside(folder / manifest.get("tokenizer", TOKENIZER_FILE))
        return arrays["train"], arrays["val"], arrays["test"]

    @staticmethod
    def _tokenizer_beside(path: Path) -> dict[str, str] | None:
        """The tokenizer at ``path`` (its location and JSON text), or None when there is none."""
        if not path.is_file():
            return None
        return {"kind": "bpe", "path": str(path.resolve()), "json": path.read_text(encoding="utf-8")}

    def _read_tokens(self) -> np.ndarray:
        path = Path(self.path)
        if path.is_dir():
            raise LmtrainError("data.path", f"{path} is a folder without {MANIFEST}.",
                               "point data.path at a token file, or at a folder written by python -m lmtrain prepare.")
        if not path.is_file():
            raise LmtrainError("data.path", f"token file {path} does not exist.", "check the path.")
        if path.stat().st_size == 0:
            raise LmtrainError("data.path", f"token file {path} is empty.", "point data.path at a non-empty file.")
        if path.suffix == ".npy":
            try:
                tokens = np.load(path, mmap_mode="r")
            except ValueError as e:
                raise LmtrainError("data.path", f"{path} is not a readable .npy file ({e}).",
                                   "write it with numpy.save, or use a raw .bin file.") from None
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise LmtrainError("data.path", f"{path} holds a {tokens.ndim}-D {tokens.dtype} array.",
                                   "save a 1-D integer array of token ids.")
        else:
            if self.token_dtype not in ("uint16", "uint32"):
                raise LmtrainError("data.token_dtype", f"unknown dtype {self.token_dtype!r}.", "use uint16 or uint32.")
            itemsize = np.dtype(self.token_dtype).itemsize
            if path.stat().st_size % itemsize:
                raise LmtrainError("data.token_dtype", f"{path} has {path.stat().st_size} bytes, not a multiple of "
                                   f"{itemsize} ({self.token_dtype}).", "set data.token_dtype to the file's type.")
            tokens = np.memmap(path, dtype=self.token_dtype, mode="r")
        self._check_ids(tokens, str(path))
        self.tokenizer = self._tokenizer_beside(path.parent / TOKENIZER_FILE)
        return tokens

    def _read_text(self) -> np.ndarray:
        if self.path == STDLIB_ALIAS:
            root, suffixes = Path(sysconfig.get_paths()["stdlib"]), _TEXT_SUFFIXES_STDLIB
        else:
            root, suffixes = Path(self.path), None
        if not root.exists():
            raise LmtrainError("data.path", f"{root} does not exist.", "check the path.")
        files = [root] if root.is_file() else sorted(
            p for p in root.rglob("*") if p.is_file() and (suffixes is None or p.suffix in suffixes)
        )
        chunks, total = [], 0
        for f in files:
            budget = None if self.max_bytes is None else self.max_bytes - total
            with open(f, "rb") as stream:
                data = stream.read() if budget is None else stream.read(budget)
                cut = budget is not None and stream.read(1) != b""
            # A cut file may end inside a character: its complete characters are checked (final=False leaves the
            # cut one in the decoder's buffer) and kept, the partial one dropped.
            decoder = codecs.getincrementaldecoder("utf-8")()
            try:
                decoder.decode(data, final=not cut)
            except UnicodeDecodeError:
                if root.is_file():
                    raise LmtrainError("data.path", f"{f} is not UTF-8 text.", "convert it to UTF-8.") from None
                continue  # skip binary files inside a folder
            if cut:
                data = data[:len(data) - len(decoder.getstate()[0])]
            chunks.append(data)
            total += len(data)
            if cut or (self.max_bytes is not None and total >= self.max_bytes):
                break
        if total == 0:
            raise LmtrainError("data.path", f"no text found in {root}.", "point data.path at UTF-8 text.")
        return np.frombuffer(b"".join(chunks), dtype=np.uint8)

    def _check_ids(self, tokens: np.ndarray, name: str) -> None:
        chunk = 1 << 24
        spans = range(0, len(tokens), chunk)
        top = max(int(tokens[i:i + chunk].max()) for i in spans) if len(tokens) else 0
        if top >= self.vocab_size:
            raise LmtrainError("data.path",
                               f"{name} holds token id {top}, not below model.vocab_size={self.vocab_size}.",
                               f"set model.vocab_size to at least {top + 1}, or check data.token_dtype.")
        # A negative id would index the embedding from its end (or fail inside the first step).
        if len(tokens) and np.issubdtype(tokens.dtype, np.signedinteger):
            low = min(int(tokens[i:i + chunk].min()) for i in spans)
            if low < 0:
                raise LmtrainError("data.path", f"{name} holds negative token id {low}; ids must lie in "
                                   f"[0, model.vocab_size={self.vocab_size}).",
                                   "re-tokenise the file so that every id is 0 or more (e.g. save it as "
                                   "uint16/uint32), or check how it was written.")

    # -- Lightning hooks ------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        """Take the rank and world size from the trainer, and shapes left to the model from the model."""
        trainer = self.trainer
        if trainer is None:
            return
        self.rank, self.world_size = trainer.global_rank, trainer.world_size
        module = trainer.lightning_module
        hparams = getattr(module, "hparams", {}) if module is not None else {}
        for name in ("context_length", "vocab_size"):
            model_value = hparams.get(name)
            if model_value is None:
                continue
            if getattr(self, name) is None:
                setattr(self, name, model_value)
            elif getattr(self, name) != model_value:
                raise LmtrainError(f"data.{name}", f"is {getattr(self, name)} but the model's {name} is "
                                   f"{model_value}.", f"leave data.{name} unset (None): it then takes the model's.")
        self._prepare()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Called once for each batch a training step is about to use, unlike the sampler, which the loader
        # and Lightning's prefetching run ahead of the steps: so this counts what training has consumed.
        trainer = self.trainer
        if trainer is not None and trainer.training:
            self.progress.next_batch += 1
            self.progress.batch_in_epoch += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The training read position and what fixes the sample order; Lightning stores it in checkpoints."""
        return {
            "next_batch": self.progress.next_batch,
            "batch_in_epoch": self.progress.batch_in_epoch,
            **data_order(self.seed, self.source, self.batch_size, self.world_size, self.train_batches),
            "tokenizer": self.tokenizer,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the sample order where a checkpointed run stopped (``fit`` only).

        Raises:
            LmtrainError: the checkpoint was written with another seed, source, global batch or epoch size,
                so the order could not continue exactly (:func:`check_data_order`).
        """
        trainer = self.trainer
        if trainer is not None and trainer.state.fn != "fit":
            return  # validate/test read fixed windows: the training position does not matter
        check_data_order(state_dict, self.state_dict())
        self.progress = ReadProgress(int(state_dict.get("next_batch", 0)), int(state_dict.get("batch_in_epoch", 0)),
                                     resumed=True)

    def _dataset(self, split: Split) -> Dataset:
        self._prepare()
        window = self.context_length + 1
        batches = self.train_batches if split == "train" else self.val_batches
        length = batches * self.batch_size * self.world_size  # one epoch (pass) of the global order
        seed = self.seed + _SPLIT_SEED_OFFSET[split]
        if self.source == "synthetic":
            return SyntheticWindows(self.vocab_size, window, length, seed)
        tokens = {"train": self.train_tokens, "val": self.val_tokens, "test": self.test_tokens}[split]
        return TokenWindows(tokens, window, length, seed, random_offsets=split == "train")

    def _loader(self, split: Split) -> DataLoader:
        dataset = self._dataset(split)
        batches = self.train_batches if split == "train" else self.val_batches
        sampler = GlobalOrderSampler(dataset, batches, self.batch_size, self.rank, self.world_size,
                                     progress=self.progress if split == "train" else None)
        return ResumableLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        self._prepare()
        if self.source != "synthetic" and self.test_tokens is None:
            fix = ("prepare it again with --test-fraction (e.g. 0.05)" if self._prepared_folder() is not None
                   else "set data.test_fraction (e.g. 0.05)")
            warnings.warn(f"there is no test split (data.test_fraction is 0), so test reports the validation split "
                          f"(the same windows as validate). To hold out a test split of its own, {fix}.",
                          stacklevel=2)
            return self._loader("val")
        return self._loader("test")
