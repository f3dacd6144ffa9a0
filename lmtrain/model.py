"""TransformerLM: the seeds' GPT-style language model, readable top to bottom. No Lightning in here.

Pre-norm blocks: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)); a final RMSNorm; an untied output
head. RoPE on queries and keys; no biases anywhere. The attention kernel is chosen by name
(``ModelConfig.attention``) from ``lmtrain.attention``.

Parameter count (exact, checked against the seeds' table by the tests)::

    2 * vocab * d_model                      embedding + output head
    + layers * (4 * d_model**2               q, k, v, out projections
                + 3 * d_model * d_ff         SwiGLU w1, w2, w3
                + 2 * d_model)               two RMSNorm gains
    + d_model                                final RMSNorm gain
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.attention = get_attention(cfg.attention)
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


class TransformerLM(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab_size)."""

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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[-1]
        if t > self.cfg.context_length:
            raise ValueError(f"sequence length {t} exceeds model.context_length={self.cfg.context_length}")
        x = self.embedding(tokens)  # (B, T, D)
        for block in self.blocks:
            if self.cfg.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.final_norm(x))  # (B, T, V)


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (works on the meta device)."""
    return sum(p.numel() for p in model.parameters())
