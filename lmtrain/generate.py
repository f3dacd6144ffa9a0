"""generate: sample text from a trained checkpoint (temperature, top-k, top-p), decoded with the run's tokenizer.

    python -m lmtrain generate --ckpt_path last --prompt "def "
    python -m lmtrain generate --ckpt_path run.ckpt --prompt "Once" --num-samples 3 --temperature 0.8 --top-p 0.95

``--ckpt_path last`` is the newest ``last.ckpt`` under ``logs/lmtrain/`` (as for ``validate`` and ``test``): a file,
or under FSDP2 a distributed checkpoint folder, whose shards are read into one full model on this process (no
process group). The checkpoint's hyperparameters (of a folder: its ``meta.pt``) give the model; its data module
state gives the tokenizer the run trained with (raw UTF-8 bytes for ``data.source: text``, decoded with U+FFFD for a
cut character; the ``tokenizer.json`` of a ``prepare`` folder for ``data.source: tokens``); ``--tokenizer FILE``
overrides it.

Sampling is a plain loop over the model's forward pass (no KV cache): each new token sees at most the model's
``context_length`` last tokens (the window is cropped), only the logits of ids the tokenizer has are kept (a model
vocabulary larger than the tokenizer's, such as 10,000 for 256 byte ids, has ids that decode to nothing), the logits
of the last position are divided by the temperature, filtered by top-k and top-p, and one token is drawn.
Temperature 0, or any below ``MIN_TEMPERATURE``, is greedy (argmax). The same ``--seed`` gives the same samples on
the same device. An empty prompt starts from the tokenizer's first special token (``<|endoftext|>``), or from a
newline where there is none (byte-level runs). A prompt that is not UTF-8 text (bytes passed on the command line) is
refused with one line, whatever the tokenizer.

The checkpoint is memory-mapped, and the model is built on the ``meta`` device and given the checkpoint's tensors
(``load_state_dict(assign=True)``): no random initialisation, and the optimizer states are never read, so host
memory holds about one copy of the weights, not the whole checkpoint.

The pieces (:func:`filter_top_k`, :func:`filter_top_p`, :func:`sample_next`, :func:`sample`, :class:`Codec`,
:func:`check_vocabularies`) also serve the ``GenerateSamples`` callback.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lmtrain.errors import LmtrainError


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits`` (..., V) with every entry below the k-th largest of its row set to -inf (ties at the k-th
    value are kept); ``k <= 0`` or ``k >= V`` keeps everything."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """``logits`` (..., V) restricted to the nucleus: the most probable tokens whose probabilities, taken in
    decreasing order, first reach a total of ``p`` (the most probable token is always kept); ``p >= 1`` keeps all."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass of the tokens ranked above each one
    drop_sorted = before >= p
    drop_sorted[..., 0] = False  # the most probable token, also where p rounds to 0 in the probabilities' dtype
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


#: Temperatures below this sample as temperature 0 does (argmax): the distribution is one-hot to fp32 precision
#: long before, and dividing by a denormal temperature (1e-45) would turn logits into infinities.
MIN_TEMPERATURE = 1e-6


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of ``logits`` (B, V): argmax at a temperature below :data:`MIN_TEMPERATURE` (0), else a
    draw from ``softmax(logits / temperature)`` after :func:`filter_top_k` and :func:`filter_top_p`. Returns (B,)
    int64."""
    if temperature < MIN_TEMPERATURE:
        return logits.argmax(dim=-1)
    logits = logits.float()
    # Shifted so that the largest logit is 0 before the division: a small temperature then makes large negative
    # values (or -inf), never +inf, whose softmax would be NaN.
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    scaled = filter_top_p(filter_top_k(shifted / temperature, top_k), top_p)
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def sample(forward: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor, max_new_tokens: int,
           context_length: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None, vocab_size: int | None = None) -> torch.Tensor:
    """Extend ``prompt`` (B, T) int64 by ``max_new_tokens`` sampled ids; returns (B, T + max_new_tokens).

    Args:
        forward: token ids (B, t) -> logits (B, t, V), e.g. a ``TransformerLM``.
        prompt: the starting ids, on the model's device (T >= 1).
        max_new_tokens: tokens to add.
        context_length: the most tokens ``forward`` sees at once; older ones are cropped from the window.
        temperature, top_k, top_p: see :func:`sample_next`.
        generator: the random source of the draws (its device must be the prompt's).
        vocab_size: only ids below this are drawn (the tokenizer's vocabulary, :attr:`Codec.vocab_size`): the
            model's logits of higher ids are left out, as if they were -inf. None draws from all V.
    """
    tokens = prompt
    for _ in range(max_new_tokens):
        logits = forward(tokens[:, -context_length:])  # (B, t, V)
        # Ids the tokenizer lacks would fail to decode (bytes >= 256) or vanish from the text (BPE): never drawn.
        nxt = sample_next(logits[:, -1, :vocab_size], temperature, top_k, top_p, generator)  # (B,)
        tokens = torch.cat([tokens, nxt[:, None].to(tokens.dtype)], dim=1)
    return tokens


def check_sampling(temperature: float, top_k: int, top_p: float, max_new_tokens: int, prefix: str = "--") -> None:
    """Stop with one line on a sampling setting out of range (``prefix`` names the options: ``--`` or a callback).

    Raises:
        LmtrainError: temperature negative or not finite, top-k negative, top-p outside (0, 1], no new tokens.
    """
    def name(option: str) -> str:
        return f"{prefix}{option.replace('_', '-')}" if prefix == "--" else f"{prefix}{option}"

    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise LmtrainError(name("temperature"), f"must be a finite number >= 0, got {temperature!r}.",
                           "use e.g. 0.8 (0 picks the most likely token every time).")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise LmtrainError(name("top_k"), f"must be a whole number >= 0, got {top_k!r}.",
                           "use e.g. 50, or 0 to keep every token.")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise LmtrainError(name("top_p"), f"must lie in (0, 1], got {top_p!r}.", "use e.g. 0.95, or 1 to keep all.")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise LmtrainError(name("max_new_tokens"), f"must be a whole number >= 1, got {max_new_tokens!r}.",
                           "use e.g. 200.")


# -- tokenizers -------------------------------------------------------------------------------------


#: Where an empty prompt starts on byte-level data, which has no end-of-text token: a newline, as after a file's
#: last line.
NEWLINE_BYTE = ord("\n")


class Codec:
    """Text <-> token ids of a run: raw UTF-8 bytes (``kind: bytes``) or a Hugging Face tokenizer (``kind: bpe``).

    Args:
        spec: the data module's ``tokenizer`` entry: ``{"kind": "bytes"}`` or ``{"kind": "bpe", "json": ...}``
            (the tokenizer file's text; ``path`` is where it was).
    """

    def __init__(self, spec: dict[str, str]) -> None:
        self.kind = spec["kind"]
        self.name = spec.get("path", "UTF-8 bytes") if self.kind == "bpe" else "UTF-8 bytes"
        self._tokenizer: Any = None
        if self.kind == "bpe":
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(spec["json"])
        elif self.kind != "bytes":
            raise LmtrainError("tokenizer", f"unknown tokenizer kind {self.kind!r}.", "use bytes or bpe.")

    @classmethod
    def from_file(cls, path: str | Path) -> Codec:
        """The tokenizer saved at ``path`` (a ``tokenizer.json``).

        Raises:
            LmtrainError: the file is missing or not a tokenizer.
        """
        path = Path(path)
        if not path.is_file():
            raise LmtrainError("--tokenizer", f"{path} does not exist.", "give the tokenizer.json the run used.")
        try:
            return cls({"kind": "bpe", "path": str(path), "json": path.read_text(encoding="utf-8")})
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise LmtrainError("--tokenizer", f"{path} is not a tokenizers JSON file ({str(e).splitlines()[0]}).",
                               "give the tokenizer.json the run used.") from None

    @property
    def vocab_size(self) -> int:
        """The number of ids the tokenizer decodes (0 .. vocab_size - 1); sampling draws no others."""
        return 256 if self._tokenizer is None else self._tokenizer.get_vocab_size()

    @property
    def start_id(self) -> int | None:
        """The id an empty prompt starts from: the tokenizer's first special token (``<|endoftext|>``) if it has one,
        else a newline when that is one known token (always for bytes and byte-level BPE); None otherwise."""
        if self._tokenizer is None:
            return NEWLINE_BYTE
        specials = [t for t in self._tokenizer.get_added_tokens_decoder().values() if t.special]
        if specials:
            return self._tokenizer.token_to_id(specials[0].content)
        ids = self._tokenizer.encode("\n", add_special_tokens=False).ids
        return ids[0] if len(ids) == 1 and ids[0] != self._unk_id() else None

    def _unk_id(self) -> int | None:
        unk_token = getattr(self._tokenizer.model, "unk_token", None)
        return self._tokenizer.token_to_id(unk_token) if unk_token else None

    def encode(self, text: str, field: str = "--prompt") -> list[int]:
        """The ids of ``text``.

        Raises:
            LmtrainError: the text is not valid Unicode (undecodable bytes from the command line, which Python keeps
                as lone surrogates), or has characters the tokenizer cannot represent.
        """
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            # Python keeps a byte b of argv that is not UTF-8 as the surrogate U+DC00 + b (PEP 383).
            bad = " ".join(f"byte 0x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else f"U+{ord(c):04X}"
                           for c in text[e.start:e.end])
            raise LmtrainError(field, f"holds {bad}, which is not UTF-8 text.",
                               "pass the prompt as UTF-8 text.") from None
        if self._tokenizer is None:
            return list(data)
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        unk = self._unk_id()
        if (unk is not None and unk in ids) or (text and not ids):
            raise LmtrainError(field, f"{text!r} has characters that the tokenizer {self.name} does not know.",
                               "leave those characters out of the prompt.")
        return ids

    def prompt_ids(self, text: str, field: str = "--prompt") -> list[int]:
        """The ids a prompt starts from: those of ``text``, or for an empty one :attr:`start_id`.

        Raises:
            LmtrainError: as :meth:`encode`, or the prompt is empty and the tokenizer has nothing to start from.
        """
        ids = self.encode(text, field)
        if ids:
            return ids
        if self.start_id is None:
            raise LmtrainError(field, f"is empty, and the tokenizer {self.name} has neither an end-of-text token nor "
                               "a newline token to start from.", "give a prompt of at least one character.")
        return [self.start_id]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (a cut UTF-8 character becomes U+FFFD)."""
        if self._tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def check_vocabularies(codec: Codec, model_vocab_size: int, field: str, fix: str) -> None:
    """Stop with one line when ``codec`` has more tokens than the model: it cannot be the tokenizer the model learnt
    (a prompt would encode to ids the model's embedding lacks). A model vocabulary larger than the tokenizer's is
    fine: :func:`sample` draws only the tokenizer's ids.

    Raises:
        LmtrainError: ``codec.vocab_size > model_vocab_size``, naming ``field`` and ``fix``.
    """
    if codec.vocab_size > model_vocab_size:
        raise LmtrainError(field, f"the tokenizer {codec.name} has {codec.vocab_size:,} tokens, more than the model's "
                           f"vocabulary of {model_vocab_size:,}.", fix)


def codec_of_checkpoint(checkpoint: dict[str, Any]) -> Codec | None:
    """The tokenizer a checkpoint's run trained with, from its data module state (or, for checkpoints written
    before the state held it, from its data options: bytes for ``text``, ``tokenizer.json`` beside the tokens);
    None when the run had none (synthetic ids)."""
    state = checkpoint.get("LMDataModule") or {}
    if state.get("tokenizer"):
        return Codec(state["tokenizer"])
    data = checkpoint.get("datamodule_hyper_parameters") or {}
    if data.get("source") == "text":
        return Codec({"kind": "bytes"})
    if data.get("source") == "tokens" and data.get("path"):
        path = Path(data["path"])
        from lmtrain.prepare import TOKENIZER_FILE

        candidate = (path if path.is_dir() else path.parent) / TOKENIZER_FILE
        if candidate.is_file():
            return Codec.from_file(candidate)
    return None


# -- the command ------------------------------------------------------------------------------------


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path`` (on the CPU), checked to hold an lmtrain model: a file, memory-mapped (its tensors
    are read from disk only when used, so the optimizer states never are), or the folder that FSDP2 runs save (a
    distributed checkpoint, read whole on this one process, without its optimizer states).

    Raises:
        LmtrainError: the file or folder is missing, unreadable or not an lmtrain checkpoint.
    """
    from lmtrain.checkpoints import DISTRIBUTED_METADATA, is_distributed_checkpoint, read_full_checkpoint

    path = Path(path)
    if is_distributed_checkpoint(path):
        checkpoint = read_full_checkpoint(path)
    elif not path.is_file():
        what = f"is a folder without {DISTRIBUTED_METADATA}" if path.is_dir() else "does not exist"
        raise LmtrainError("--ckpt_path", f"checkpoint {path} {what}.",
                           "give a .ckpt file or a distributed checkpoint folder (last.ckpt of an FSDP2 run), or "
                           "--ckpt_path last for the newest run's last.ckpt.")
    else:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # truncated or foreign files fail in many ways (pickle, zip, EOF)
            raise LmtrainError("--ckpt_path", f"{path} is not a readable checkpoint "
                               f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}).",
                               "give a checkpoint written by lmtrain fit (logs/lmtrain/version_N/checkpoints/)."
                               ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "hyper_parameters" not in checkpoint:
        raise LmtrainError("--ckpt_path", f"{path} holds no lmtrain model (no state_dict and hyper_parameters).",
                           "give a checkpoint written by lmtrain fit.")
    return checkpoint


def build_model(checkpoint: dict[str, Any], device: torch.device) -> Any:
    """The checkpoint's ``TransformerLM`` in eval mode, fp32, on ``device``, without gradients.

    The model is built on the ``meta`` device (no memory, no random initialisation) and takes the checkpoint's
    tensors as its parameters (``load_state_dict(assign=True)``), each moved to ``device`` and fp32 on its own: host
    memory holds the weights once (shared with a memory-mapped file where they are fp32 on a CPU), not the
    initialised model, the checkpoint and a copy besides.
    """
    from lmtrain.attention import needs_gpu
    from lmtrain.config import ModelConfig
    from lmtrain.model import RotaryEmbedding, TransformerLM

    config = ModelConfig.from_module_kwargs(checkpoint["hyper_parameters"])
    # Sampling needs no memory savings; a GPU-only attention backend falls back to PyTorch's on a CPU.
    changes: dict[str, Any] = {"activation_checkpointing": "none", "checkpoint_layers": None,
                               "checkpoint_rest": "none"}
    if needs_gpu(config.attention) and device.type != "cuda":
        changes["attention"] = "sdpa"
    config = config.replace(**changes)
    with torch.device("meta"):
        model = TransformerLM(config)
    weights = {k.removeprefix("model."): v.to(device=device, dtype=torch.float32)
               for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    try:
        model.load_state_dict(weights, assign=True)
    except RuntimeError as e:
        raise LmtrainError("--ckpt_path", f"the weights do not fit the model of its hyperparameters "
                           f"({str(e).splitlines()[0]}).", "give a checkpoint written by lmtrain fit.") from None
    # The RoPE tables are derived buffers, kept out of the state dict: made on the device (small: (T, hd/2) each).
    rope = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta).to(device)
    model.rope.cos, model.rope.sin = rope.cos, rope.sin
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"build_model: {', '.join(left)} of TransformerLM come neither from the checkpoint nor "
                           "from the derived buffers made here.")
    return model.requires_grad_(False).eval()


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise LmtrainError("--device", "cuda was asked for and no CUDA device is visible.", "use --device cpu.")
    return torch.device(name)


def resolve_ckpt_path(ckpt_path: str, log_dir: str) -> Path:
    """``last`` -> the newest ``last.ckpt`` under ``<log_dir>/lmtrain/``; any other value as given.

    Raises:
        LmtrainError: ``last`` and no run has a checkpoint yet.
    """
    from lmtrain.checkpoints import find_last_checkpoint

    if ckpt_path != "last":
        return Path(ckpt_path)
    found = find_last_checkpoint(log_dir, "lmtrain")
    if found is None:
        raise LmtrainError("--ckpt_path", f"'last' asks for the newest run's last.ckpt, and there is none under "
                           f"{Path(log_dir) / 'lmtrain' / 'version_*' / 'checkpoints'}.",
                           "train first (python -m lmtrain fit --config configs/tiny.yaml), or pass a checkpoint file.")
    return found


def generate(args: argparse.Namespace) -> list[str]:
    """Run ``generate``: the samples' texts (prompt included), also printed to stdout.

    Raises:
        LmtrainError: bad options, no usable checkpoint or tokenizer, or a prompt the tokenizer cannot encode.
    """
    check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens)
    if args.num_samples < 1:
        raise LmtrainError("--num-samples", f"must be a whole number >= 1, got {args.num_samples}.", "use e.g. 3.")
    if args.seed is not None and not -(2**63) <= args.seed < 2**64:  # what torch.Generator.manual_seed takes
        raise LmtrainError("--seed", f"must lie in [-2**63, 2**64), got {args.seed}.", "use e.g. 0.")
    if args.threads is not None and args.threads < 1:
        raise LmtrainError("--threads", f"must be a whole number >= 1, got {args.threads}.", "use e.g. 1.")
    device = _device(args.device)
    if device.type == "cpu":
        # Sampling runs one short sequence at a time: its operations are too small to gain from several CPU
        # threads, and each waits for the slowest thread, which costs 50x on a busy machine.
        torch.set_num_threads(args.threads or 1)
    path = resolve_ckpt_path(args.ckpt_path, args.log_dir)
    checkpoint = load_checkpoint(path)
    codec = Codec.from_file(args.tokenizer) if args.tokenizer else codec_of_checkpoint(checkpoint)
    if codec is None:
        raise LmtrainError("--tokenizer", f"{path} was trained on token ids without a tokenizer (synthetic data, or "
                           "a token file with no tokenizer.json beside it).",
                           "pass the tokenizer.json that made its tokens with --tokenizer.")
    model = build_model(checkpoint, device)
    check_vocabularies(codec, model.cfg.vocab_size, "--tokenizer", "give the tokenizer the run trained with.")
    ids = codec.prompt_ids(args.prompt)
    generator = torch.Generator(device)
    if args.seed is None:
        generator.seed()  # a fresh, non-deterministic seed
    else:
        generator.manual_seed(args.seed)
    prompt = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)  # (num_samples, T)
    step = checkpoint.get("global_step")
    print(f"generate: {path} (step {step}), tokenizer {codec.name}, {device.type}", file=sys.stderr)
    out = sample(model, prompt, args.max_new_tokens, model.cfg.context_length, args.temperature, args.top_k,
                 args.top_p, generator, vocab_size=codec.vocab_size)
    texts = [codec.decode(row.tolist()) for row in out]
    for i, text in enumerate(texts):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(text)
    return texts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m lmtrain generate``."""
    from lmtrain.cli_config import LOG_DIR

    parser.add_argument("--ckpt_path", "--ckpt-path", dest="ckpt_path", default="last",
                        help="checkpoint file or FSDP2 checkpoint folder, or last: the newest last.ckpt under "
                        "LOG_DIR/lmtrain (default)")
    parser.add_argument("--prompt", default="", help="text to continue, UTF-8 (default empty: start from the "
                        "tokenizer's <|endoftext|>, or from a newline on byte-level runs)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (200)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="softmax temperature; 0 (or below 1e-6) is greedy (0.8)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 keeps all (0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="keep the nucleus of this probability (1.0: all)")
    parser.add_argument("--num-samples", type=int, default=1, help="independent samples of the prompt (1)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the draws (default: a fresh one)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json to decode with instead of the run's")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to run (auto)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default 1: sampling's operations "
                        "are small)")
    parser.add_argument("--log-dir", default=LOG_DIR, help=f"where --ckpt_path last looks ({LOG_DIR})")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m lmtrain generate``."""
    generate(args)
    return 0
