"""FlashAttention-2 in plain PyTorch: the tiled algorithm, readable, as a teaching aid and a reference.

This is the same algorithm as the Triton kernels in ``lmtrain.kernels.flash``, written with tensor slices
so that each step can be read and printed. It is not fast (Python loops over tiles) but it never
materialises the N_q x N_k score matrix: at most one (TILE_Q x TILE_K) tile per batch element.

Forward, for each query tile Q_i (rows i0:i1):
    m = -inf, l = 0, acc = 0                      running max, denominator, unnormalised output
    for each key tile K_j, V_j (skipping tiles entirely above the diagonal when causal):
        S = Q_i K_j^T / sqrt(d)                   mask S[r, c] = -inf where key c > query r (causal)
        m_new = max(m, rowmax(S))
        P = exp(S - m_new)
        l = exp(m - m_new) * l + rowsum(P)
        acc = exp(m - m_new) * acc + P V_j
        m = m_new
    O_i = acc / l,  L_i = m + log(l)              L: logsumexp, the only per-row statistic saved

Backward, with D = rowsum(O * dO), for each key tile j and each query tile i that sees it:
    P = exp(Q_i K_j^T / sqrt(d) - L_i)            recomputed from L, not stored in the forward
    dV_j += P^T dO_i
    dS = P * (dO_i V_j^T - D_i)
    dQ_i += dS K_j / sqrt(d),  dK_j += dS^T Q_i / sqrt(d)

Dtypes: any floating dtype; tiles are computed in fp32 (float64 stays float64) and results are
cast back to the input dtype. Shapes: q (..., N_q, d), k and v (..., N_k, d) with the same leading
dims; any N_q, N_k, d. Causal masking keeps the lower triangle with the diagonal, top-left aligned
(query r sees keys 0..r), like ``scaled_dot_product_attention(is_causal=True)``.
"""

from __future__ import annotations

import torch

TILE_Q = 64
"""Query rows per tile (the algorithm works with any size >= 1; the kernels use 16 or more)."""
TILE_K = 64
"""Key rows per tile."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _causal_tile_mask(i0: int, i1: int, j0: int, j1: int, device: torch.device) -> torch.Tensor | None:
    """Boolean (i1-i0, j1-j0) mask, True where key c <= query r; None when the whole tile is visible."""
    if j1 - 1 <= i0:
        return None  # tile entirely on or below the diagonal
    rows = torch.arange(i0, i1, device=device)[:, None]
    cols = torch.arange(j0, j1, device=device)[None, :]
    return cols <= rows


def flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, tile_q: int = TILE_Q, tile_k: int = TILE_K
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled forward pass. Returns O (like q) and the logsumexp L (shape q.shape[:-1]; fp32, fp64 for fp64 inputs)."""
    n_q, d = q.shape[-2:]
    n_k = k.shape[-2]
    scale = d**-0.5
    acc_dtype = _compute_dtype(q.dtype)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=acc_dtype, device=q.device)
    for i0 in range(0, n_q, tile_q):
        i1 = min(i0 + tile_q, n_q)
        q_i = q[..., i0:i1, :].to(acc_dtype)  # (..., Bq, d)
        m = torch.full(q_i.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)  # (..., Bq)
        denom = torch.zeros_like(m)
        acc = torch.zeros_like(q_i)  # (..., Bq, d)
        k_end = min(n_k, i1) if is_causal else n_k  # keys >= i1 are masked for every row of this tile
        for j0 in range(0, k_end, tile_k):
            j1 = min(j0 + tile_k, n_k)
            k_j = k[..., j0:j1, :].to(acc_dtype)  # (..., Bk, d)
            v_j = v[..., j0:j1, :].to(acc_dtype)
            s = q_i @ k_j.transpose(-1, -2) * scale  # (..., Bq, Bk)
            if is_causal and (mask := _causal_tile_mask(i0, i1, j0, j1, q.device)) is not None:
                s = s.masked_fill(~mask, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)  # rescales what was accumulated under the old maximum
            denom = alpha * denom + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ v_j
            m = m_new
        o[..., i0:i1, :] = (acc / denom[..., None]).to(q.dtype)
        lse[..., i0:i1] = m + torch.log(denom)
    return o, lse


def flash_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    tile_q: int = TILE_Q,
    tile_k: int = TILE_K,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled backward pass recomputing P from L. Returns (dQ, dK, dV) in the input dtypes."""
    n_q, d = q.shape[-2:]
    n_k = k.shape[-2]
    scale = d**-0.5
    acc_dtype = _compute_dtype(q.dtype)
    delta = (o.to(acc_dtype) * do.to(acc_dtype)).sum(dim=-1)  # D = rowsum(O * dO), (..., N_q)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for j0 in range(0, n_k, tile_k):
        j1 = min(j0 + tile_k, n_k)
        k_j = k[..., j0:j1, :].to(acc_dtype)
        v_j = v[..., j0:j1, :].to(acc_dtype)
        dk_j = torch.zeros_like(k_j)
        dv_j = torch.zeros_like(v_j)
        first_i = (j0 // tile_q) * tile_q if is_causal else 0  # query tiles above this key tile see none of it
        for i0 in range(first_i, n_q, tile_q):
            i1 = min(i0 + tile_q, n_q)
            q_i = q[..., i0:i1, :].to(acc_dtype)
            do_i = do[..., i0:i1, :].to(acc_dtype)
            s = q_i @ k_j.transpose(-1, -2) * scale  # (..., Bq, Bk)
            p = torch.exp(s - lse[..., i0:i1, None].to(acc_dtype))
            if is_causal and (mask := _causal_tile_mask(i0, i1, j0, j1, q.device)) is not None:
                p = p.masked_fill(~mask, 0.0)
            dv_j += p.transpose(-1, -2) @ do_i
            dp = do_i @ v_j.transpose(-1, -2)
            ds = p * (dp - delta[..., i0:i1, None])
            dq[..., i0:i1, :] += ds @ k_j * scale
            dk_j += ds.transpose(-1, -2) @ q_i * scale
        dk[..., j0:j1, :] = dk_j.to(k.dtype)
        dv[..., j0:j1, :] = dv_j.to(v.dtype)
    return dq.to(q.dtype), dk, dv


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if (q.ndim < 2 or q.ndim != k.ndim or k.shape != v.shape or q.shape[:-2] != k.shape[:-2]
            or q.shape[-1] != k.shape[-1]):
        raise ValueError(
            "flash_attention_pytorch: expected q (..., N_q, d), k and v (..., N_k, d) with the same leading dims, "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(
            f"flash_attention_pytorch: q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}."
        )
    if k.shape[-2] == 0:
        raise ValueError("flash_attention_pytorch: k and v have no keys (N_k = 0); attention needs at least one key.")


class FlashAttentionPyTorch(torch.autograd.Function):
    """FlashAttention-2 in plain PyTorch: ``FlashAttentionPyTorch.apply(q, k, v, is_causal)``.

    q (..., N_q, d), k and v (..., N_k, d); 3-D (batch, N, d) in the course's assignment tests. The forward saves
    L (logsumexp, natural log, fp32, shape q.shape[:-1]) with q, k, v and O; the backward recomputes P.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        _check_inputs(q, k, v)
        o, lse = flash_forward(q, k, v, bool(is_causal))
        ctx.save_for_backward(lse, q, k, v, o)
        ctx.is_causal = bool(is_causal)
        return o

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor):
        lse, q, k, v, o = ctx.saved_tensors
        dq, dk, dv = flash_backward(grad_o, q, k, v, o, lse, ctx.is_causal)
        return dq, dk, dv, None


def flash_attention_pytorch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v by tiled FlashAttention-2 in plain PyTorch (any device, any leading dims).

    Args:
        q: queries (..., N_q, d).
        k: keys (..., N_k, d), same leading dims and dtype as q.
        v: values (..., N_k, d).
        causal: mask keys after each query (lower triangle with the diagonal, top-left aligned).

    Returns:
        (..., N_q, d) in q's dtype.
    """
    return FlashAttentionPyTorch.apply(q, k, v, causal)


__all__ = ["FlashAttentionPyTorch", "flash_attention_pytorch", "flash_forward", "flash_backward"]
