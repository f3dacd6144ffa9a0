"""TransformerLM: the GPT-style LM of the reference profiling study, readable top to bottom. No Lightning here.

Pre-norm blocks: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)); a final RMSNorm; an untied output
head. RoPE on queries and keys; no biases anywhere. The attention kernel is chosen by name
(``ModelConfig.attention``) from ``lmtrain.attention``.

Parameter count (exact, checked against the reference study's table by the tests)::

    2 * vocab * d_model                      embedding + output head
    + layers * (4 * d_model**2               q, k, v, out projections
                + 3 * d_model * d_ff         SwiGLU w1, w2, w3
                + 2 * d_model)               two RMSNorm gains
    + d_model                                final RMSNorm gain

Memory options (``docs/long_context.md``): ``ModelConfig.activation_checkpointing`` picks what each block keeps
for the backward pass (``none``, ``full``, ``selective``, ``offload``), and ``ModelConfig.loss_chunk_tokens`` makes
:meth:`TransformerLM.loss` run the output head and the cross-entropy a chunk of tokens at a time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lmtrain.attention import get_attention
from lmtrain.config import ModelConfig


class RMSNorm(nn.Module):
    """y = x / rms(x) * g, computed in fp32 whatever the input dtype, returned in the input dtype."""

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight.float()
        return y.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE (theta 10000 by default), rotating pairs (x[2i], x[2i+1]) of each head by position * freq_i."""

    def __init__(self, head_dim: int, context_length: int, theta: float = 10_000.0) -> None:
        super().__init__()
        freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (hd/2,)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float32), freqs)  # (T, hd/2)
        # Buffers are derived, not learnt: kept out of the state dict.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, H, T, hd) -> same shape, rotated; computed in fp32."""
        t = x.shape[-2]
        cos, sin = self.cos[:t], self.sin[:t]  # (T, hd/2)
        x32 = x.float().unflatten(-1, (-1, 2))  # (B, H, T, hd/2, 2)
        x_even, x_odd = x32[..., 0], x32[..., 1]
        out = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return out.flatten(-2).to(x.dtype)


def _flash_triton_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """flash_triton through its custom op ``lmtrain::flash_attn_fwd`` (differentiable; one dispatcher call).

    In eager mode ``flash_triton`` launches its kernels from an ``autograd.Function``: a selective-checkpoint
    policy sees only the empty output buffers, never the attention itself, and could not keep its output.
    Called as the custom op, the attention is one operation the policy saves (``_SELECTIVE_SAVE``). The op's
    dispatch costs some host time per call (tens of microseconds), nothing next to a long-context layer.
    """
    from lmtrain.kernels.flash import api  # noqa: F401  (registers torch.ops.lmtrain.flash_attn_fwd)

    out, _ = torch.ops.lmtrain.flash_attn_fwd(q, k, v, bool(causal), False)
    return out


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        selective = "selective" in (cfg.activation_checkpointing, cfg.checkpoint_rest)
        self.attention = _flash_triton_op if selective and cfg.attention == "flash_triton" else get_attention(
            cfg.attention)
        self.rope = rope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads)  # (B, T, 3, H, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, hd), views
        q, k = self.rope(q), self.rope(k)
        y = self.attention(q, k, v, True)  # (B, H, T, hd)
        return self.out(y.transpose(1, 2).reshape(b, t, d))  # (B, T, D)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg, rope)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def _selective_save_ops() -> frozenset[Any]:
    """The operations whose outputs ``selective`` checkpointing keeps: matrix products and attention kernels.

    ``mm`` and ``addmm`` are every linear layer (a (B, T, D) input reaches the dispatcher as a 2-D ``mm``). Batched
    products (``bmm``) are left out on purpose: in this model they occur only inside the ``naive`` and
    ``flash_pytorch`` attention backends, whose score and tile products would make the kept set grow with the
    square of the context; those two backends are recomputed instead.
    """
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten._scaled_mm.default}  # _scaled_mm: float8 layers (lmtrain.float8)
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    return frozenset(ops)


_SELECTIVE_SAVE = _selective_save_ops()


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of matrix products and attention; recompute everything else (elementwise, cheap)."""
    if op in _SELECTIVE_SAVE or _is_flash_triton_op(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _is_flash_triton_op(op: Any) -> bool:
    # The custom op exists only once lmtrain.kernels.flash.api is imported (it needs Triton): look it up by
    # its registered name instead of importing Triton here.
    return getattr(op, "_schema", None) is not None and op._schema.name == "lmtrain::flash_attn_fwd"


_selective_contexts = functools.partial(create_selective_checkpoint_contexts, _selective_policy)


def _offload_context(x: torch.Tensor) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks keeping what autograd saves in host memory (pinned on a CUDA device, for fast copies).

    Around a fully checkpointed block the only tensor saved is the block's input, so this moves exactly the
    per-block residual input off the device. On a CPU the tensor is already in host memory: nothing moves.
    """
    return torch.autograd.graph.save_on_cpu(pin_memory=x.is_cuda)


def chunked_cross_entropy(
    hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Mean cross-entropy of ``head(hidden)`` against ``targets``, ``chunk_tokens`` tokens at a time.

    Each chunk's logits -> fp32 -> summed cross-entropy runs inside ``torch.utils.checkpoint``: the forward pass
    keeps only the chunk's input (a view of ``hidden``), and the backward pass recomputes that chunk's logits,
    takes their gradient and frees them before the next chunk. So at most one chunk's (chunk_tokens, V) logits,
    fp32 copy, log-softmax and their gradients exist at a time, never the whole (n, V). The price is the head's
    forward product once more per step (2 n D V FLOPs; well under 1% of a 2.7B step). The loss equals the
    unchunked mean (sum of chunk sums / n) and so do the gradients, up to summation order.

    Args:
        hidden: final-norm output (n, D).
        head: the output projection (V rows).
        targets: token ids (n,).
        chunk_tokens: tokens per chunk (> 0).

    Returns:
        The scalar mean loss, fp32.
    """
    n = hidden.shape[0]
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, n, chunk_tokens):
        h, t = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]  # (c, D), (c,)
        if torch.is_grad_enabled():
            total = total + checkpoint(_head_loss_sum, h, head.weight, t, use_reentrant=False)
        else:
            total = total + _head_loss_sum(h, head.weight, t)
    return total / n


def _head_loss_sum(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed fp32 cross-entropy of one chunk: (c, D) x (V, D) -> (c, V) logits -> scalar."""
    return F.cross_entropy(F.linear(h, weight).float(), targets, reduction="sum")


class TransformerLM(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab_size); :meth:`loss` gives the mean next-token cross-entropy."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # One RoPE table shared by all blocks (buffers, no parameters).
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.context_length, cfg.rope_theta)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, self.rope) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style: N(0, 0.02) truncated at 3 sigma; residual output projections scaled by 1/sqrt(2 L)."""
        if self.embedding.weight.is_meta:
            return
        std = 0.02
        for name, p in self.named_parameters():
            if p.ndim == 1:  # RMSNorm gains
                p.fill_(1.0)
                continue
            s = std / math.sqrt(2 * self.cfg.num_layers) if name.endswith(("attn.out.weight", "mlp.w2.weight")) else std
            nn.init.trunc_normal_(p, mean=0.0, std=s, a=-3 * s, b=3 * s)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) of token ids (B, T); with ``targets`` (B, T), the mean cross-entropy instead.

        With targets and ``cfg.loss_chunk_tokens > 0`` the logits are never made whole
        (:func:`chunked_cross_entropy`); without, the whole (B*T, V) logits and their fp32 copy are made.
        The loss goes through ``forward`` so that ``torch.compile`` (which wraps ``__call__``) covers it too.
        """
        x = self.final_norm(self.hidden(tokens))  # (B, T, D)
        if targets is None:
            return self.lm_head(x)  # (B, T, V)
        if self.cfg.loss_chunk_tokens:
            return chunked_cross_entropy(x.flatten(0, 1), self.lm_head, targets.flatten(), self.cfg.loss_chunk_tokens)
        return F.cross_entropy(self.lm_head(x).float().flatten(0, 1), targets.flatten())

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32) of inputs (B, T) against targets (B, T)."""
        return self(tokens, targets)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Residual stream after the last block (B, T, D), before the final norm."""
        t = tokens.shape[-1]
        if t > self.cfg.context_length:
            raise ValueError(f"sequence length {t} exceeds model.context_length={self.cfg.context_length}")
        x = self.embedding(tokens)  # (B, T, D)
        run = self._block_runner(self.cfg.activation_checkpointing)
        rest = self._block_runner(self.cfg.checkpoint_rest)
        checkpointed = self.cfg.num_layers if self.cfg.checkpoint_layers is None else self.cfg.checkpoint_layers
        for i, block in enumerate(self.blocks):
            x = run(block, x) if i < checkpointed else rest(block, x)
        return x

    @staticmethod
    def _block_runner(policy: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
        """How a block runs under checkpointing ``policy`` (plain when no gradients are taken)."""
        if policy == "none" or not torch.is_grad_enabled():
            return lambda block, x: block(x)
        if policy == "full":
            return lambda block, x: checkpoint(block, x, use_reentrant=False)
        if policy == "selective":
            return lambda block, x: checkpoint(block, x, use_reentrant=False, context_fn=_selective_contexts)
        return _offloaded_block


def _offloaded_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A fully checkpointed block whose saved input (its only saved tensor) lives in host memory."""
    with _offload_context(x):
        return checkpoint(block, x, use_reentrant=False)


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (works on the meta device)."""
    return sum(p.numel() for p in model.parameters())
