"""LMDataModule: batches of token windows from random ids, token files or text files.

Each sample is a window of ``context_length + 1`` token ids (int64); the module splits it into inputs
``window[:, :-1]`` and targets ``window[:, 1:]``. Sources:

    synthetic   uniformly random ids in [0, vocab_size): the seeds' benchmark input, no I/O.
    tokens      a pre-tokenised file, memory-mapped: ``.npy`` (any integer dtype) or a raw ``.bin``
                of ``token_dtype`` (uint16 or uint32) ids.
    text        UTF-8 text files (a file or a folder, read recursively), one token per byte (vocab 256).
                ``path: python-stdlib`` reads the running Python's standard library source (``*.py``),
                a corpus every machine has.

Files are split into a train part and a validation part (the last ``val_fraction`` of the tokens).
Training windows start at random offsets drawn from (seed, epoch, index); Lightning builds the loader
once per ``fit``, so a fresh draw per epoch needs ``trainer.reload_dataloaders_every_n_epochs: 1``.
Validation windows are fixed and evenly spaced. Everything is checked when the module is built,
before any training or logging starts.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lmtrain.errors import LmtrainError

Source = Literal["synthetic", "tokens", "text"]
STDLIB_ALIAS = "python-stdlib"
_TEXT_SUFFIXES_STDLIB = (".py",)


class SyntheticWindows(Dataset):
    """``length`` windows of uniformly random ids; window i is the same on every read (seeded by i)."""

    def __init__(self, vocab_size: int, window: int, length: int, seed: int) -> None:
        self.vocab_size, self.window, self.length, self.seed = vocab_size, window, length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randint(0, self.vocab_size, (self.window,), generator=g)


class TokenWindows(Dataset):
    """Windows of ``window`` consecutive ids from a 1-D token array (memory-mapped or in memory).

    With ``random_offsets`` window i starts at a random offset drawn from (seed, epoch, i); otherwise
    windows tile the array from the start, evenly spaced.
    """

    def __init__(self, tokens: np.ndarray, window: int, length: int, seed: int, random_offsets: bool) -> None:
        self.tokens, self.window, self.length = tokens, window, length
        self.seed, self.random_offsets, self.epoch = seed, random_offsets, 0
        self.max_start = len(tokens) - window
        self.stride = max(1, self.max_start // max(1, length - 1)) if length > 1 else 0

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.random_offsets:
            rng = np.random.default_rng((self.seed, self.epoch, i))
            start = int(rng.integers(0, self.max_start + 1))
        else:
            start = min(i * self.stride, self.max_start)
        # A copy: an int64 memmap slice would be a read-only view, which torch.from_numpy warns about.
        return torch.from_numpy(np.array(self.tokens[start:start + self.window], dtype=np.int64))


class LMDataModule(pl.LightningDataModule):
    """Token windows for language-model training.

    Args:
        source: ``synthetic``, ``tokens`` or ``text`` (see the module docstring).
        path: the token file (``tokens``), or a text file / folder / ``python-stdlib`` (``text``).
        batch_size: sequences per batch.
        context_length: tokens per input sequence (windows hold one more, for the targets). Linked to
            ``model.context_length`` by the command line.
        vocab_size: the model's vocabulary; every id in the data must be below it. Linked to
            ``model.vocab_size`` by the command line.
        token_dtype: element type of a raw ``.bin`` token file (``uint16`` or ``uint32``).
        val_fraction: share of a file's tokens held out for validation (files only).
        train_batches: batches in one training epoch (the number of random windows drawn per epoch
            is ``train_batches * batch_size``).
        val_batches: batches in one validation pass.
        max_bytes: read at most this many bytes of text (``text`` only; None reads everything).
        num_workers: DataLoader worker processes.
        seed: seed for synthetic ids and window offsets.
    """

    def __init__(
        self,
        source: Source = "synthetic",
        path: str | None = None,
        batch_size: int = 4,
        context_length: int = 512,
        vocab_size: int = 10_000,
        token_dtype: Literal["uint16", "uint32"] = "uint16",
        val_fraction: float = 0.1,
        train_batches: int = 1000,
        val_batches: int = 10,
        max_bytes: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.source, self.path = source, path
        self.batch_size, self.context_length, self.vocab_size = batch_size, context_length, vocab_size
        self.token_dtype, self.val_fraction = token_dtype, val_fraction
        self.train_batches, self.val_batches = train_batches, val_batches
        self.max_bytes, self.num_workers, self.seed = max_bytes, num_workers, seed
        self._check_numbers()
        self.train_tokens: np.ndarray | None = None
        self.val_tokens: np.ndarray | None = None
        if source != "synthetic":
            self.train_tokens, self.val_tokens = self._load_and_split()

    # -- checks ---------------------------------------------------------------------------------

    def _check_numbers(self) -> None:
        if self.source not in ("synthetic", "tokens", "text"):
            raise LmtrainError("data.source", f"unknown source {self.source!r}.", "use synthetic, tokens or text.")
        for name in ("batch_size", "context_length", "vocab_size", "train_batches", "val_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise LmtrainError(f"data.{name}", f"must be a positive integer, got {value!r}.",
                                   f"set data.{name} to a whole number above 0.")
        if not 0.0 < self.val_fraction < 1.0:
            raise LmtrainError("data.val_fraction", f"must lie strictly between 0 and 1, got {self.val_fraction}.",
                               "use e.g. 0.1.")
        if self.num_workers < 0:
            raise LmtrainError("data.num_workers", "must be 0 or more.", "use 0 to load in the main process.")
        if self.source != "synthetic" and not self.path:
            raise LmtrainError("data.path", f"source {self.source!r} needs a path.",
                               "set data.path to a token file (tokens) or a text file or folder (text).")
        if self.source == "text" and self.vocab_size < 256:
            raise LmtrainError("model.vocab_size",
                               f"text data has byte ids up to 255 but vocab_size={self.vocab_size}.",
                               "set model.vocab_size to at least 256.")

    def _load_and_split(self) -> tuple[np.ndarray, np.ndarray]:
        tokens = self._read_text() if self.source == "text" else self._read_tokens()
        window = self.context_length + 1
        if len(tokens) < 2 * window:
            raise LmtrainError("data.path", f"{self.path} holds {len(tokens):,} tokens, fewer than two windows of "
                               f"context_length + 1 = {window} (one for training, one for validation).",
                               "use more data or a smaller model.context_length.")
        n_val = max(window, int(len(tokens) * self.val_fraction))
        if len(tokens) - n_val < window:
            raise LmtrainError("data.val_fraction", f"leaves fewer than {window} training tokens.",
                               "lower data.val_fraction or use more data.")
        return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]

    def _read_tokens(self) -> np.ndarray:
        path = Path(self.path)
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
            data = f.read_bytes()
            if self.max_bytes is not None:
                data = data[: self.max_bytes - total]
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                if root.is_file():
                    raise LmtrainError("data.path", f"{f} is not UTF-8 text.", "convert it to UTF-8.") from None
                continue  # skip binary files inside a folder
            chunks.append(data)
            total += len(data)
            if self.max_bytes is not None and total >= self.max_bytes:
                break
        if total == 0:
            raise LmtrainError("data.path", f"no text found in {root}.", "point data.path at UTF-8 text.")
        return np.frombuffer(b"".join(chunks), dtype=np.uint8)

    def _check_ids(self, tokens: np.ndarray, name: str) -> None:
        chunk = 1 << 24
        top = max(int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk)) if len(tokens) else 0
        if top >= self.vocab_size:
            raise LmtrainError("data.path",
                               f"{name} holds token id {top}, not below model.vocab_size={self.vocab_size}.",
                               f"set model.vocab_size to at least {top + 1}, or check data.token_dtype.")

    # -- Lightning hooks ------------------------------------------------------------------------

    def _dataset(self, split: str) -> Dataset:
        window = self.context_length + 1
        batches = self.train_batches if split == "train" else self.val_batches
        length = batches * self.batch_size
        seed = self.seed if split == "train" else self.seed + 7919
        if self.source == "synthetic":
            return SyntheticWindows(self.vocab_size, window, length, seed)
        tokens = self.train_tokens if split == "train" else self.val_tokens
        return TokenWindows(tokens, window, length, seed, random_offsets=split == "train")

    def _loader(self, split: str) -> DataLoader:
        return DataLoader(
            self._dataset(split),
            batch_size=self.batch_size,
            shuffle=False,  # windows are already random
            drop_last=True,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        loader = self._loader("train")
        if isinstance(loader.dataset, TokenWindows) and self.trainer is not None:
            loader.dataset.epoch = self.trainer.current_epoch
        return loader

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("val")
