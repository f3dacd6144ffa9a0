"""GenerateSamples: a few text samples from the model under training, to TensorBoard's Text tab every N steps."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lmtrain.callbacks._common import WarnOnce, check_int, log_text
from lmtrain.errors import LmtrainError
from lmtrain.generate import Codec, check_sampling, check_vocabularies, sample

_OWNER = "GenerateSamples"


class GenerateSamples(pl.Callback):
    """Sample a continuation of each prompt every ``every_n_steps`` optimizer steps and log it as text.

    Logged (TensorBoard Text tab, rank 0, at the step's ``trainer.global_step``):

    - ``samples/<i>``: prompt ``i`` (0-based, in the order given) followed by its sampled continuation, as a
      Markdown code block, decoded with the run's tokenizer (``LMDataModule.tokenizer``: bytes for text data,
      the ``prepare`` folder's ``tokenizer.json`` for token data).

    The samples come from ``lmtrain.generate.sample`` (the loop of ``python -m lmtrain generate``) on the module's
    ``model`` in eval mode under the trainer's precision context, with a generator of its own (seeded by ``seed``
    and the step), so sampling leaves the global random state, and hence training, unchanged; train mode is
    restored afterwards. Only ids the tokenizer has are drawn (a model vocabulary of 10,000 on byte-level data
    samples bytes only); a tokenizer larger than the model's vocabulary is refused in ``setup``. Between samples
    the callback costs one integer comparison per batch. Only rank 0 samples, except under FSDP2
    (``ModelParallelStrategy``), where every rank must run the sharded forward pass. A compiled model may compile
    again for the sampling shapes. With data that has no tokenizer (``synthetic``), the callback warns once and logs
    nothing.

    Args:
        every_n_steps: sample after every this many optimizer steps (at steps N, 2N, ...).
        prompts: the texts to continue (an empty prompt starts from the tokenizer's ``<|endoftext|>``, or from a
            newline on byte-level data).
        max_new_tokens: tokens sampled per prompt.
        temperature: softmax temperature (0: greedy).
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the nucleus of this probability (1: all).
        seed: seed of the draws (step ``s`` uses ``seed + s``).
    """

    def __init__(self, every_n_steps: int = 100, prompts: list[str] | tuple[str, ...] = ("\n",),
                 max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0) -> None:
        self.every_n_steps, self.prompts, self.max_new_tokens = every_n_steps, prompts, max_new_tokens
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self._codec: Codec | None = None
        self._prompt_ids: list[list[int]] = []
        self._last_step: int | None = None
        self._warn = WarnOnce()

    def check_arguments(self, world_size: int = 1) -> None:
        """Check the arguments: ``setup`` calls it, and the command line before any log folder exists.

        Args:
            world_size: the number of processes of the run (unused here).

        Raises:
            LmtrainError: an argument is out of range, naming it.
        """
        check_int(_OWNER, "every_n_steps", self.every_n_steps, 1)
        check_int(_OWNER, "seed", self.seed, 0)
        check_sampling(self.temperature, self.top_k, self.top_p, self.max_new_tokens, prefix=f"callbacks.{_OWNER}.")
        if isinstance(self.prompts, str) or not self.prompts or not all(isinstance(p, str) for p in self.prompts):
            raise LmtrainError(f"callbacks.{_OWNER}.prompts", f"must be a non-empty list of strings, got "
                               f"{self.prompts!r}.", 'use e.g. ["def ", "class "].')

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.check_arguments()
        self.check_data(trainer.datamodule, pl_module)
        if self._codec is None:
            self._warn(f"{_OWNER}: the data has no tokenizer (synthetic ids, or a token file without tokenizer.json "
                       "beside it), so no samples are logged.")
        self._last_step = None

    def check_data(self, datamodule: Any, pl_module: Any) -> None:
        """Encode the prompts with ``datamodule``'s tokenizer and check it against ``pl_module``'s vocabulary.

        The command line calls it before the trainer exists, so that a prompt the tokenizer cannot encode stops
        before the log folder is made; ``setup`` calls it again with the trainer's data module.

        Raises:
            LmtrainError: the module has no model to sample from, the tokenizer is larger than the model's
                vocabulary, or a prompt cannot be encoded.
        """
        if not hasattr(pl_module, "model"):
            raise LmtrainError(f"callbacks.{_OWNER}", f"{type(pl_module).__name__} has no `model` attribute to "
                               "sample from.", "use it with lmtrain.LMModule.")
        spec = getattr(datamodule, "tokenizer", None) if datamodule is not None else None
        self._codec = Codec(spec) if spec else None
        if self._codec is None:
            return
        hparams = getattr(pl_module, "hparams", None)
        model_vocab_size = hparams.get("vocab_size") if hparams is not None else None
        if model_vocab_size is not None:
            check_vocabularies(self._codec, int(model_vocab_size), "model.vocab_size",
                               f"set model.vocab_size to at least {self._codec.vocab_size:,}, the tokenizer's.")
        field = f"callbacks.{_OWNER}.prompts"
        self._prompt_ids = [self._codec.prompt_ids(prompt, field=field) for prompt in self.prompts]

    def _samples_here(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        return trainer.global_rank == 0 or getattr(pl_module, "device_mesh", None) is not None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self._codec is None or step == 0 or step % self.every_n_steps or step == self._last_step:
            return  # the usual case: one comparison
        self._last_step = step  # micro-batches of one step (gradient accumulation) sample once
        if not self._samples_here(trainer, pl_module):
            return
        for i, text in enumerate(self.generate(trainer, pl_module, step)):
            log_text(trainer, f"samples/{i}", f"```\n{text}\n```", step=step)

    def generate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> list[str]:
        """The texts (prompt and continuation) of every prompt at ``step``; the model's train mode is kept."""
        model = pl_module.model
        device = next(model.parameters()).device
        context_length = int(pl_module.hparams.get("context_length") or model.cfg.context_length)
        generator = torch.Generator(device)
        generator.manual_seed(self.seed + step)
        was_training = pl_module.training
        pl_module.eval()
        texts = []
        try:
            with trainer.precision_plugin.forward_context():
                for ids in self._prompt_ids:
                    prompt = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
                    out = sample(model, prompt, self.max_new_tokens, context_length, self.temperature, self.top_k,
                                 self.top_p, generator, vocab_size=self._codec.vocab_size)
                    texts.append(self._codec.decode(out[0].tolist()))
        finally:
            pl_module.train(was_training)
        return texts
