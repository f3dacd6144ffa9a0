"""prepare: train a byte-level BPE tokenizer on text and write token files that ``data.source: tokens`` reads.

    python -m lmtrain prepare --input corpus/ --out data/corpus            # train a 10,000-token BPE, encode
    python -m lmtrain prepare --input 'books/*.txt' --out data/books --vocab-size 32000
    python -m lmtrain prepare --input more.txt --out data/more --tokenizer data/corpus/tokenizer.json
    python -m lmtrain prepare --input corpus/ --out data/corpus --context-length 128   # each split holds a window

The input is a text file, a folder (every file below it, recursively; binary files, recognised by a NUL byte
or invalid UTF-8 in their first 64 KiB, are skipped) or a glob (``**`` recurses); ``python-stdlib`` is the running
Python's standard-library source (``*.py``). Files are read in sorted order, as UTF-8 (an invalid byte later in a
file becomes U+FFFD), and the first special token (``<|endoftext|>`` by default) goes between files.

The tokenizer is Hugging Face ``tokenizers``' byte-level BPE (GPT-2's: ByteLevel pre-tokenizer and decoder,
all 256 byte symbols in the initial alphabet, so any text encodes without unknown tokens), trained with
``BpeTrainer`` from an iterator over chunks of the files. ``--tokenizer FILE`` skips the training and encodes
with that tokenizer (it must hold the special tokens).

``--out DIR`` receives:

    tokenizer.json   the tokenizer (``tokenizers.Tokenizer.from_file``)
    train.bin        token ids, raw uint16 (vocabulary of at most 65,536) or uint32, in corpus order
    val.bin          the next ``--val-fraction`` of the tokens
    test.bin         the last ``--test-fraction`` (empty with 0)
    dataset.json     the manifest: vocabulary size, dtype, token counts per split, the tokenizer file, the source

``data.source: tokens`` with ``data.path`` at DIR (or at ``DIR/train.bin``) reads these splits memory-mapped
and finds ``tokenizer.json`` beside them (``lmtrain.data``); ``configs/tiny_bpe.yaml`` trains the tiny model
on such a folder.

Memory stays flat as the corpus grows: both passes read the files in chunks of ``CHUNK_BYTES``, the tokenizer
trains from that iterator (its memory grows with the number of distinct pre-tokenised words, not with the corpus),
and the encoder writes each batch of chunks to disk before reading the next. Progress goes to stderr (bytes
done, total, rate), after a line naming the files and their size, when the input is larger than
``PROGRESS_MIN_BYTES``; a summary line ends every run.

Bad input (a missing input, an empty corpus, a corpus too small to give each split that ``fit`` reads one window of
``--context-length`` + 1 tokens, an out folder that cannot be written or already holds another dataset, a
vocabulary too small for the 256 byte symbols and the special tokens) stops with one line and exit 2, and nothing is
written. The splits checked are train, val and, unless ``--test-fraction`` is 0, test; without ``--context-length``
each needs 2 tokens (a window of the shortest context, 1), and the summary line says the longest context_length the
splits serve. The data module refuses a split shorter than the run's window at setup in any case;
``--context-length`` says so before anything is written. The outputs are written to temporary files and renamed
into place at the end, so an interrupted run leaves the folder as it was.
"""

from __future__ import annotations

import argparse
import codecs
import glob
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmtrain.errors import LmtrainError

#: Bytes read (and handed to the tokenizer) at a time; a chunk ends at a line end when there is one. Small enough
#: that the tokenizer trainer's read-ahead buffer of a few hundred chunks stays at a few MB.
CHUNK_BYTES = 64 << 10
#: Chunks encoded per call of the tokenizer's (multi-threaded) batch encoder.
ENCODE_BATCH = 64
#: Inputs larger than this get progress lines on stderr.
PROGRESS_MIN_BYTES = 16 << 20
#: Seconds between two progress lines.
PROGRESS_EVERY_S = 5.0
#: The manifest's name and format tag, and the tokenizer's file name; ``lmtrain.data`` reads them.
MANIFEST = "dataset.json"
FORMAT = "lmtrain-tokens"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val", "test")
#: ``--input`` (and ``data.path`` of text data) naming the running Python's standard-library source.
STDLIB_ALIAS = "python-stdlib"
_SNIFF_BYTES = 64 << 10
_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class Corpus:
    """The text files of an input, in reading order.

    Attributes:
        spec: the input as given (a file, a folder, a glob or ``python-stdlib``).
        files: the files read, sorted.
        total_bytes: their total size.
        skipped: files left out as binary.
    """

    spec: str
    files: tuple[Path, ...]
    total_bytes: int
    skipped: int = 0


def _is_text(path: Path) -> bool:
    """Whether the file's first 64 KiB look like UTF-8 text (no NUL byte, valid UTF-8 up to a cut character)."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def find_corpus(spec: str) -> Corpus:
    """The files of ``spec``: a text file, a folder (recursive), a glob or ``python-stdlib``.

    Raises:
        LmtrainError: nothing matches, or the matched files hold no text.
    """
    suffix = None
    if spec == STDLIB_ALIAS:
        root, suffix = Path(sysconfig.get_paths()["stdlib"]), ".py"
        candidates = sorted(p for p in root.rglob("*.py") if p.is_file())
    elif Path(spec).is_file():
        candidates = [Path(spec)]
    elif Path(spec).is_dir():
        candidates = sorted(p for p in Path(spec).rglob("*") if p.is_file())
    elif _GLOB_CHARS & set(spec):
        candidates = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
    else:
        raise LmtrainError("--input", f"{spec} does not exist.", "give a text file, a folder of text files or a "
                           "glob such as 'texts/**/*.txt' (quoted).")
    if not candidates:
        raise LmtrainError("--input", f"{spec} matches no file.", "check the path or the pattern.")
    single = len(candidates) == 1 and suffix is None and Path(spec).is_file()
    files, skipped = [], 0
    for path in candidates:
        if _is_text(path):
            files.append(path)
        elif single:
            raise LmtrainError("--input", f"{path} is not UTF-8 text.", "convert it to UTF-8, or give a text file.")
        else:
            skipped += 1
    total = sum(p.stat().st_size for p in files)
    if total == 0:
        raise LmtrainError("--input", f"{spec} holds no text ({len(candidates)} file(s), "
                           f"{skipped} of them binary, the rest empty).", "give files with some UTF-8 text.")
    return Corpus(spec, tuple(files), total, skipped)


class Progress:
    """Periodic ``prepare: <stage> <done> / <total> MB (<pct>%), <rate> MB/s`` lines on stderr (large inputs only)."""

    def __init__(self, stage: str, total_bytes: int, quiet: bool = False, min_bytes: int = PROGRESS_MIN_BYTES,
                 every_s: float = PROGRESS_EVERY_S) -> None:
        self.stage, self.total, self.every_s = stage, total_bytes, every_s
        self.enabled = not quiet and total_bytes > min_bytes
        self.start = self.last = time.perf_counter()
        self.done = 0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if self.enabled and now - self.last >= self.every_s:
            self.last = now
            self._line(now)

    def finish(self) -> None:
        if self.enabled:
            self._line(time.perf_counter())

    def _line(self, now: float) -> None:
        rate = self.done / max(now - self.start, 1e-9) / 1e6
        pct = 100.0 * self.done / max(self.total, 1)
        print(f"prepare: {self.stage} {self.done / 1e6:,.1f} / {self.total / 1e6:,.1f} MB ({pct:.0f}%), "
              f"{rate:.1f} MB/s", file=sys.stderr, flush=True)


def iter_chunks(corpus: Corpus, separator: str | None, progress: Progress | None = None,
                chunk_bytes: int = CHUNK_BYTES) -> Iterator[str]:
    """The corpus as text chunks of about ``chunk_bytes``, each ending at a line end where the chunk has one.

    ``separator`` (the end-of-text token) is yielded alone between two files. Chunks never span two files, so
    no BPE token crosses a file boundary.
    """
    for index, path in enumerate(corpus.files):
        if index and separator:
            yield separator
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        carry = ""
        with open(path, "rb") as f:
            while True:
                raw = f.read(chunk_bytes)
                if progress is not None:
                    progress.advance(len(raw))
                text = carry + decoder.decode(raw, final=not raw)
                if not raw:
                    if text:
                        yield text
                    break
                cut = text.rfind("\n") + 1  # 0 when there is no line end: keep the whole chunk
                if cut == 0 and len(text) < 4 * chunk_bytes:
                    carry = text  # a very long line: wait for its end, up to a bound
                    continue
                cut = cut or len(text)
                if cut:
                    yield text[:cut]
                carry = text[cut:]


def train_tokenizer(corpus: Corpus, vocab_size: int, special_tokens: list[str], quiet: bool = False) -> Any:
    """A byte-level BPE of ``vocab_size`` tokens trained on ``corpus`` (a ``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    progress = Progress("reading for the tokenizer", corpus.total_bytes, quiet)
    # The separator is not fed to training: the special tokens are in the vocabulary already.
    tokenizer.train_from_iterator(iter_chunks(corpus, None, progress), trainer=trainer)
    progress.finish()
    return tokenizer


def load_tokenizer(path: str, special_tokens: list[str]) -> Any:
    """The tokenizer saved at ``path``, checked to hold ``special_tokens``.

    Raises:
        LmtrainError: the file is missing, unreadable or lacks a special token.
    """
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise LmtrainError("--tokenizer", f"{path} does not exist.", "give a tokenizer.json written by prepare "
                           "(or by Hugging Face tokenizers), or leave --tokenizer out to train one.")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise LmtrainError("--tokenizer", f"{path} is not a tokenizers JSON file ({str(e).splitlines()[0]}).",
                           "give a tokenizer.json written by prepare.") from None
    missing = [t for t in special_tokens if tokenizer.token_to_id(t) is None]
    if missing:
        raise LmtrainError("--special-tokens", f"{path} has no token {missing[0]!r}.",
                           "pass the tokenizer's own special tokens with --special-tokens, or train a new one.")
    return tokenizer


def token_dtype(vocab_size: int) -> str:
    """``uint16`` when every id fits in 16 bits, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def encode_corpus(tokenizer: Any, corpus: Corpus, separator: str | None, dtype: str, out: Any,
                  quiet: bool = False) -> int:
    """Encode ``corpus`` batch by batch into the open binary file ``out``; returns the number of tokens."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets: less memory, faster
    progress = Progress("encoding", corpus.total_bytes, quiet)
    count, batch = 0, []

    def flush() -> int:
        ids = [np.asarray(e.ids, dtype=dtype) for e in encode(batch, add_special_tokens=False)]
        array = np.concatenate(ids) if ids else np.empty(0, dtype=dtype)
        out.write(array.tobytes())
        batch.clear()
        return len(array)

    for chunk in iter_chunks(corpus, separator, progress):
        batch.append(chunk)
        if len(batch) >= ENCODE_BATCH:
            count += flush()
    if batch:
        count += flush()
    progress.finish()
    return count


def split_sizes(n: int, val_fraction: float, test_fraction: float) -> tuple[int, int, int]:
    """(train, val, test) token counts: validation the next ``val_fraction`` after training, test the last
    ``test_fraction`` (the order and rounding of ``LMDataModule``'s own split of one file)."""
    n_val = int(n * val_fraction)
    n_test = int(n * test_fraction)
    return n - n_val - n_test, n_val, n_test


def _identity(manifest: dict[str, Any]) -> dict[str, Any]:
    """What makes two datasets the same: the inputs, the tokenizer's settings and the split."""
    keys = ("source", "vocab_size_requested", "special_tokens", "tokenizer_source", "val_fraction", "test_fraction")
    return {k: manifest.get(k) for k in keys}


def _check_out_dir(out: Path, manifest: dict[str, Any], force: bool) -> None:
    existing = out / MANIFEST
    if out.exists() and not out.is_dir():
        raise LmtrainError("--out", f"{out} is a file.", "give a folder (it is created if missing).")
    if existing.is_file() and not force:
        try:
            old = json.loads(existing.read_text())
        except (OSError, ValueError):
            old = {}
        if _identity(old) != _identity(manifest):
            raise LmtrainError("--out", f"{out} already holds another dataset ({MANIFEST}: source "
                               f"{old.get('source', {}).get('input')!r}, vocabulary {old.get('vocab_size')}).",
                               "choose another --out folder, or pass --force to replace it.")
    parent = out if out.is_dir() else next((p for p in out.parents if p.exists()), Path("."))
    if not parent.is_dir():
        raise LmtrainError("--out", f"{out} cannot be created: {parent} is a file.", "choose another folder.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LmtrainError("--out", f"{parent} cannot be written.", "choose a folder you can write to.")


def _check_arguments(args: argparse.Namespace) -> list[str]:
    specials = [t for t in args.special_tokens.split(",") if t] if args.special_tokens else []
    if len(set(specials)) != len(specials):
        raise LmtrainError("--special-tokens", f"{args.special_tokens!r} names a token twice.",
                           "list each special token once, comma-separated.")
    if args.tokenizer is None and args.vocab_size < 256 + len(specials):
        raise LmtrainError("--vocab-size", f"{args.vocab_size} is smaller than the 256 byte symbols plus "
                           f"{len(specials)} special token(s).", f"use at least {256 + len(specials)} (e.g. 10000).")
    if args.vocab_size >= 1 << 32:
        raise LmtrainError("--vocab-size", f"{args.vocab_size} does not fit in uint32 ids.", "use e.g. 10000.")
    if not 0.0 < args.val_fraction < 1.0:
        raise LmtrainError("--val-fraction", f"must lie strictly between 0 and 1, got {args.val_fraction}.",
                           "use e.g. 0.1.")
    if not 0.0 <= args.test_fraction < 1.0 or args.val_fraction + args.test_fraction >= 1.0:
        raise LmtrainError("--test-fraction", f"must lie in [0, 1) and leave training data next to "
                           f"--val-fraction={args.val_fraction}, got {args.test_fraction}.", "use e.g. 0.05.")
    if args.context_length is not None and args.context_length < 1:
        raise LmtrainError("--context-length", f"must be a positive integer, got {args.context_length}.",
                           "give the model.context_length that fit will use (e.g. 128), or leave it out.")
    return specials


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``prepare`` (see the module docstring); returns the manifest written.

    Raises:
        LmtrainError: bad arguments or input, or an out folder that cannot take the dataset.
    """
    specials = _check_arguments(args)
    corpus = find_corpus(args.input)
    out = Path(args.out)
    tokenizer_source = str(Path(args.tokenizer).resolve()) if args.tokenizer else "trained"
    identity = {"source": {"input": args.input, "files": len(corpus.files), "bytes": corpus.total_bytes},
                "vocab_size_requested": None if args.tokenizer else args.vocab_size, "special_tokens": specials,
                "tokenizer_source": tokenizer_source, "val_fraction": args.val_fraction,
                "test_fraction": args.test_fraction}
    _check_out_dir(out, identity, args.force)
    tokenizer = load_tokenizer(args.tokenizer, specials) if args.tokenizer else None
    quiet = args.quiet
    files = f"{len(corpus.files):,} file(s)" + (f" ({corpus.skipped} binary skipped)" if corpus.skipped else "")
    if not quiet and corpus.total_bytes > PROGRESS_MIN_BYTES:
        # Said at the start only where progress lines follow: a small input's refusal stays the only line.
        print(f"prepare: {files}, {corpus.total_bytes / 1e6:,.1f} MB", file=sys.stderr)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out))
    try:
        if tokenizer is None:
            # BPE learns at most one merge per byte of the corpus: asking for more only makes the trainer allocate
            # for them (2**32 - 1 aborted the process); the vocabulary it learns is the same
            reachable = 256 + len(specials) + corpus.total_bytes
            tokenizer = train_tokenizer(corpus, min(args.vocab_size, reachable), specials, quiet)
        vocab_size = tokenizer.get_vocab_size()
        dtype = token_dtype(vocab_size)
        with open(tmp / "all.bin", "wb") as f:
            n = encode_corpus(tokenizer, corpus, specials[0] if specials else None, dtype, f, quiet)
        if n == 0:
            raise LmtrainError("--input", f"{args.input} encodes to no tokens.", "give files with some text.")
        counts = dict(zip(SPLITS, split_sizes(n, args.val_fraction, args.test_fraction), strict=True))
        _check_split_sizes(args, n, counts)
        _split_file(tmp / "all.bin", np.dtype(dtype).itemsize, counts, tmp)
        tokenizer.save(str(tmp / TOKENIZER_FILE))
        manifest = {"format": FORMAT, "version": 1, "vocab_size": vocab_size, "dtype": dtype,
                    "tokenizer": TOKENIZER_FILE,
                    "eot_id": tokenizer.token_to_id(specials[0]) if specials else None,
                    "splits": {s: {"file": f"{s}.bin", "tokens": counts[s]} for s in SPLITS},
                    "tokens": n, **identity}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        # The manifest last: a folder with a manifest always has the files it names.
        for name in (*(f"{s}.bin" for s in SPLITS), TOKENIZER_FILE, MANIFEST):
            os.replace(tmp / name, out / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)  # only our temporary folder was in it
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        parts = ", ".join(f"{s} {counts[s]:,}" for s in SPLITS)
        print(f"prepare: wrote {out} from {files}: vocabulary {vocab_size:,} ({dtype}), {n:,} tokens ({parts}), "
              f"{corpus.total_bytes / max(n, 1):.2f} bytes per token; splits long enough for a context_length up to "
              f"{min(counts[s] for s in splits_in_use(args.test_fraction)) - 1:,}", file=sys.stderr)
    return manifest


#: Per split: the prepare option that gives it more tokens (prepare's refusal and the data module's name it).
MORE_TOKENS_FOR = {"train": "a smaller --val-fraction or --test-fraction", "val": "a larger --val-fraction",
                   "test": "a larger --test-fraction (0 for no test split)"}


def splits_in_use(test_fraction: float) -> tuple[str, ...]:
    """The splits that ``fit``, ``validate`` and ``test`` read: all three, or no test split with a fraction of 0."""
    return SPLITS if test_fraction > 0 else ("train", "val")


def tokens_needed(window: int, val_fraction: float, test_fraction: float) -> int:
    """The fewest tokens from which on every corpus size gives each split in use at least ``window`` tokens.

    ``split_sizes`` rounds the held-out splits down, so the training split can lose a token as the corpus grows by
    one: the first size that serves may be followed by one that does not. From ``window / fraction + 1`` tokens on
    every split serves (with room for floating-point rounding); counting down from there finds the threshold. The
    count stops after ``2**20`` sizes, which only a training fraction under about 1e-6 reaches: the size returned
    then serves, but may not be the fewest.
    """
    used = [i for i, s in enumerate(SPLITS) if s in splits_in_use(test_fraction)]
    fractions = (1.0 - val_fraction - test_fraction, val_fraction, test_fraction)

    def serves(n: int) -> bool:
        sizes = split_sizes(n, val_fraction, test_fraction)
        return all(sizes[i] >= window for i in used)

    n = max(math.ceil(window / fractions[i]) + 1 for i in used)
    lowest = max(1, n - (1 << 20))
    while n > lowest and serves(n - 1):
        n -= 1
    return n


def _check_split_sizes(args: argparse.Namespace, n: int, counts: dict[str, int]) -> None:
    """Stop when a split that ``fit``/``validate``/``test`` read is shorter than one window of ``--context-length``
    + 1 tokens (without the option, of context_length 1, the least any model has): the data module would refuse
    the folder at setup, so it is not written."""
    context = args.context_length or 1
    window = context + 1
    used = splits_in_use(args.test_fraction)
    short = [s for s in ("val", "test", "train") if s in used and counts[s] < window]
    if not short:
        return
    split = short[0]
    parts = ", ".join(f"{s} {counts[s]:,}" for s in SPLITS)
    given = f"--context-length {context:,}" if args.context_length else "context_length 1 (the least)"
    fixes = [f"give more text (at least {tokens_needed(window, args.val_fraction, args.test_fraction):,} tokens "
             f"with these fractions{'' if args.context_length else '; many thousands for a useful model'})",
             MORE_TOKENS_FOR[split]]
    if args.context_length and counts[split] > 1:
        fixes.append(f"a shorter --context-length (at most {counts[split] - 1:,} for this {split} split)")
    raise LmtrainError("--input", f"{args.input} encodes to {n:,} tokens ({parts}): the {split} split holds "
                       f"{counts[split]:,}, fewer than one window of {given} + 1 = {window:,} tokens, which fit "
                       "needs in each split.", ", ".join(fixes[:-1]) + f", or {fixes[-1]}.")


def _split_file(path: Path, itemsize: int, counts: dict[str, int], folder: Path) -> None:
    """Copy the consecutive train/val/test ranges of ``path`` into ``folder/<split>.bin`` and remove it."""
    with open(path, "rb") as src:
        for split in SPLITS:
            remaining = counts[split] * itemsize
            with open(folder / f"{split}.bin", "wb") as dst:
                while remaining:
                    block = src.read(min(remaining, 16 << 20))
                    dst.write(block)
                    remaining -= len(block)
    path.unlink()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m lmtrain prepare``."""
    parser.add_argument("--input", required=True,
                        help="a text file, a folder of text files (recursive), a quoted glob, or python-stdlib")
    parser.add_argument("--out", required=True, help="folder for tokenizer.json, {train,val,test}.bin, dataset.json")
    parser.add_argument("--vocab-size", type=int, default=10_000, help="BPE vocabulary size (default 10000)")
    parser.add_argument("--special-tokens", default="<|endoftext|>",
                        help="comma-separated special tokens; the first goes between files (default <|endoftext|>)")
    parser.add_argument("--tokenizer", default=None, help="encode with this tokenizer.json instead of training one")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share of tokens for validation (0.1)")
    parser.add_argument("--test-fraction", type=float, default=0.05, help="share of tokens for test (0.05)")
    parser.add_argument("--context-length", type=int, default=None,
                        help="the context_length fit will use: refuse a split shorter than one window of it + 1 "
                             "tokens (default: only a split too short for any, under 2 tokens)")
    parser.add_argument("--force", action="store_true", help="replace a dataset of other inputs in --out")
    parser.add_argument("--quiet", action="store_true", help="no progress or summary lines")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m lmtrain prepare``."""
    prepare(args)
    return 0
