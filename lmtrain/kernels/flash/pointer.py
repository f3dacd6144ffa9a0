"""FlashAttention-2 forward and backward as Triton kernels with pointer loads: every GPU, dtype and head dim.

Algorithm (Dao, "FlashAttention-2", 2023). For one (batch, head), queries are cut into blocks of ``BLOCK_M`` rows and
keys/values into blocks of ``BLOCK_N`` rows. The forward kernel holds one query block and streams over the key/value
blocks, keeping a running row maximum ``m``, a running denominator ``l`` and an fp32 output accumulator (online
softmax); it writes the output O and the logsumexp ``L = m + log(l)`` (natural log, fp32, one value per query row).
No N x N tensor is ever stored. The backward pass recomputes ``P = exp(S - L)`` tile by tile:

* ``_flash_ptr_bwd_dq``: one program per query block, looping over key blocks: ``dQ += dS K`` with
  ``dS = P * (dO V^T - D)``; it first computes ``D = rowsum(O * dO)`` (fp32, one value per query row) for its rows
  and writes it out (a separate kernel for ``D`` would cost another launch, which short calls wait on);
* ``_flash_ptr_bwd_dkdv``: one program per key block, looping over query blocks: ``dV += P^T dO``,
  ``dK += dS^T Q``, reading the ``D`` that the dQ kernel wrote.

Every output element is written by exactly one program and there are no atomics, so the backward is deterministic.

Causal masking keeps the lower triangle including the diagonal, aligned to the top-left corner (query i sees keys
0..i). Key blocks entirely above the diagonal are skipped; each kernel runs its loop in two parts, an unmasked part
over whole blocks and a masked part (diagonal blocks and the ragged tail). Causal forward and dQ programs start with
the longest rows (reverse block order) so the short ones fill the tail.

Dtypes: fp16, bf16 and fp32; products and softmax statistics accumulate in fp32, P and dS are cast to the input
dtype before their matrix products. fp32 products use ``input_precision="ieee"`` unless TF32 is allowed. Head dims
1..256 are padded to the next power of two (at least 16) inside the kernel and masked. Leading dims are viewed as
(Z, H) with their own strides; the grid is one-dimensional (blocks x batch-heads) and offsets are int64.

Block sizes are autotuned per (head dim, sequence-length bucket, causal, dtype) among a few configurations chosen
for Hopper GPUs (``autotune=False`` in the settings takes the first that fits). With Triton 3.4 and later the
autotuner keeps each choice's timings in Triton's cache folder (``cache_results``), which lmtrain's compile cache
points at, so a later process skips the tuning. Under Triton's interpreter
(``TRITON_INTERPRET=1`` set before the first use) the kernels run on CPU tensors with one small configuration, for
tests.
"""

import inspect

import torch
import triton
import triton.language as tl

from lmtrain.kernels.flash.common import (  # shared with the TMA kernels
    _INTERPRET,
    _LOG2E,
    _NO_SPECIALIZE,
    _TUNE_KEY,
    _block_of,
    _keep,
    _key_range,
    _launch,
    _prune_held_m,
    _prune_held_n,
    _query_block,
    _softmax_step,
    _tuning_bench,
)

#: ``triton.autotune(cache_results=True)`` where Triton has it (3.4 and later): the timings of each tuning key go to
#: Triton's cache folder (``TRITON_CACHE_DIR``), keyed by Triton, the GPU architecture, the kernel's source, the key
#: and the candidates, and a later process reads them instead of timing again. Older Triton versions, which run
#: these kernels too (the dispatcher falls back to them), lack the argument.
_AUTOTUNE_CACHE = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}

#: The kernels as a profiler names them.
KERNEL_NAMES = ("_flash_ptr_fwd", "_flash_ptr_bwd_dq", "_flash_ptr_bwd_dkdv")

# ---------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------


def _configs(blocks: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tuples -> triton configs."""
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in blocks]


if _INTERPRET:
    # One small configuration: the interpreter runs every program on the CPU, one after the other.
    _FWD_CONFIGS = _configs([(32, 16, 4, 1)])
    _DKDV_CONFIGS = _configs([(16, 32, 4, 1)])
    _DQ_CONFIGS = _configs([(32, 16, 4, 1)])
else:
    # Hopper-oriented candidates, first one is the default when autotuning is off.
    _FWD_CONFIGS = _configs([(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3), (64, 32, 4, 2)])
    _DKDV_CONFIGS = _configs([(64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 2), (16, 32, 4, 2)])
    _DQ_CONFIGS = _configs([(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2), (32, 16, 4, 2)])


def _n_key(n_q: int, n_k: int) -> int:
    """Sequence-length bucket for the autotuning key: re-tune per power of two, not per length."""
    return min(triton.next_power_of_2(max(n_q, n_k)), 16384)


# ---------------------------------------------------------------------------------------------
# Shared pieces of the kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_rows(ptrs, rows, n_rows, d_ok, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Load a (rows x BLOCK_D) tile. Rows at or past ``n_rows`` (only if MASKED) and the padded head-dim columns
    (only if BLOCK_D > HEAD_DIM) read as 0; a full tile of an unpadded head dim loads without a mask."""
    if MASKED:
        x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & d_ok, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        x = tl.load(ptrs, mask=d_ok, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _row_tiles(stride_a, stride_b, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """For a loop streaming (ROWS x BLOCK_D) tiles of two tensors with row strides ``stride_a`` and ``stride_b``:
    (row offsets 0..ROWS-1, head-dim mask, element offsets of a tile of the first, of the second)."""
    offs = tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    tile_a = offs[:, None] * stride_a + offs_d[None, :]
    tile_b = offs[:, None] * stride_b + offs_d[None, :]
    return offs, offs_d[None, :] < HEAD_DIM, tile_a, tile_b


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, lo, hi, N_K, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of one query block over key blocks [lo, hi)."""
    offs_n, d_ok, k_tile, v_tile = _row_tiles(stride_kn, stride_vn, BLOCK_N, HEAD_DIM, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        n_idx = start_n + offs_n
        start = tl.cast(start_n, tl.int64)
        k = _load_rows(k_base + start * stride_kn + k_tile, n_idx, N_K, d_ok, MASKED, HEAD_DIM, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        if MASKED:
            qk = tl.where(_keep(offs_m, n_idx, N_K, IS_CAUSAL), qk, float("-inf"))
        # Every row sees key 0 in the first block it processes, so the new maximum is finite: no NaN guard needed.
        p, alpha, l_i, m_i = _softmax_step(qk, l_i, m_i, qk_scale)
        v = _load_rows(v_base + start * stride_vn + v_tile, n_idx, N_K, d_ok, MASKED, HEAD_DIM, BLOCK_D)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.autotune(configs=_FWD_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune_held_m},
                 do_bench=_tuning_bench, **_AUTOTUNE_CACHE)
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _flash_ptr_fwd(
    Q, K, V, OUT, LSE,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    H, N_Q, N_K, N_KEY, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program = one block of BLOCK_M query rows of one (batch, head). Grid: (cdiv(N_Q, BLOCK_M) * Z * H,)."""
    bh, z, h, start_m = _query_block(N_Q, H, BLOCK_M, IS_CAUSAL)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = (offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM)

    q_ptrs = Q + z * stride_qz + h * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok, other=0.0)
    k_base = K + z * stride_kz + h * stride_kh
    v_base = V + z * stride_vz + h * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_end, hi = _key_range(start_m, N_K, BLOCK_M, BLOCK_N, IS_CAUSAL)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, 0, full_end, N_K, qk_scale,
        HEAD_DIM, BLOCK_N, BLOCK_D, IS_CAUSAL, False, DOT_PRECISION,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, full_end, hi, N_K, qk_scale,
        HEAD_DIM, BLOCK_N, BLOCK_D, IS_CAUSAL, True, DOT_PRECISION,
    )

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # log2 domain -> natural log
    o_ptrs = OUT + z * stride_oz + h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok)
    tl.store(LSE + bh.to(tl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, lo, hi, N_K, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Accumulate dQ of one query block over key blocks [lo, hi)."""
    offs_n, d_ok, k_tile, v_tile = _row_tiles(stride_kn, stride_vn, BLOCK_N, HEAD_DIM, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        n_idx = start_n + offs_n
        start = tl.cast(start_n, tl.int64)
        k = _load_rows(k_base + start * stride_kn + k_tile, n_idx, N_K, d_ok, MASKED, HEAD_DIM, BLOCK_D)
        v = _load_rows(v_base + start * stride_vn + v_tile, n_idx, N_K, d_ok, MASKED, HEAD_DIM, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(_keep(offs_m, n_idx, N_K, IS_CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.autotune(configs=_DQ_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune_held_m},
                 do_bench=_tuning_bench, **_AUTOTUNE_CACHE)
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _flash_ptr_bwd_dq(
    Q, K, V, OUT, DO, LSE, DELTA, DQ,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    stride_doz, stride_doh, stride_dom,
    stride_dqz, stride_dqh, stride_dqm,
    H, N_Q, N_K, N_KEY, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program = one block of BLOCK_M query rows of one (batch, head). Grid: (cdiv(N_Q, BLOCK_M) * Z * H,).

    Also writes ``D = rowsum(O * dO)`` (fp32) of its rows, which it needs itself and the dK/dV kernel reads after it.
    """
    bh, z, h, start_m = _query_block(N_Q, H, BLOCK_M, IS_CAUSAL)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m.to(tl.int64)[:, None]
    m_ok = offs_m < N_Q
    row_ok = m_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + z * stride_qz + h * stride_qh + rows * stride_qm + offs_d[None, :], mask=row_ok, other=0.0)
    do = tl.load(DO + z * stride_doz + h * stride_doh + rows * stride_dom + offs_d[None, :], mask=row_ok, other=0.0)
    o = tl.load(OUT + z * stride_oz + h * stride_oh + rows * stride_om + offs_d[None, :], mask=row_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh.to(tl.int64) * N_Q + offs_m, delta, mask=m_ok)
    lse2 = tl.load(LSE + bh.to(tl.int64) * N_Q + offs_m, mask=m_ok, other=float("inf")) * 1.4426950408889634
    k_base = K + z * stride_kz + h * stride_kh
    v_base = V + z * stride_vz + h * stride_vh

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_end, hi = _key_range(start_m, N_K, BLOCK_M, BLOCK_N, IS_CAUSAL)
    dq = _bwd_dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, 0, full_end, N_K, qk_scale,
        HEAD_DIM, BLOCK_N, BLOCK_D, IS_CAUSAL, False, DOT_PRECISION,
    )
    dq = _bwd_dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, full_end, hi, N_K, qk_scale,
        HEAD_DIM, BLOCK_N, BLOCK_D, IS_CAUSAL, True, DOT_PRECISION,
    )
    dq = dq * sm_scale
    tl.store(DQ + z * stride_dqz + h * stride_dqh + rows * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_ok)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom, offs_n, lo, hi, N_Q, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query blocks [lo, hi). Works on transposed tiles (keys x queries)."""
    offs_i, d_ok, q_tile, do_tile = _row_tiles(stride_qm, stride_dom, BLOCK_M, HEAD_DIM, BLOCK_D)
    for start_m in range(lo, hi, BLOCK_M):
        m_idx = start_m + offs_i
        start = tl.cast(start_m, tl.int64)
        q = _load_rows(q_base + start * stride_qm + q_tile, m_idx, N_Q, d_ok, MASKED, HEAD_DIM, BLOCK_D)
        do = _load_rows(do_base + start * stride_dom + do_tile, m_idx, N_Q, d_ok, MASKED, HEAD_DIM, BLOCK_D)
        if MASKED:
            m_ok = m_idx < N_Q
            lse = tl.load(lse_base + m_idx, mask=m_ok, other=float("inf"))  # padded rows: P = 0
            delta = tl.load(delta_base + m_idx, mask=m_ok, other=0.0)
        else:
            lse = tl.load(lse_base + m_idx)
            delta = tl.load(delta_base + m_idx)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :] * 1.4426950408889634)
        if MASKED:
            if IS_CAUSAL:
                p_t = tl.where(m_idx[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.autotune(configs=_DKDV_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune_held_n},
                 do_bench=_tuning_bench, **_AUTOTUNE_CACHE)
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _flash_ptr_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_doz, stride_doh, stride_dom,
    stride_dkz, stride_dkh, stride_dkn,
    stride_dvz, stride_dvh, stride_dvn,
    H, N_Q, N_K, N_KEY, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program = one block of BLOCK_N keys of one (batch, head). Grid: (cdiv(N_K, BLOCK_N) * Z * H,).

    Causal programs start at their diagonal, so low key blocks (the longest loops) come first in launch order.
    Reads ``D`` (DELTA), which the dQ kernel writes, so it runs after that kernel.
    """
    bh, z, h, start_n = _block_of(tl.program_id(0), N_K, H, BLOCK_N, False)
    z, h = z.to(tl.int64), h.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_n.to(tl.int64)[:, None]
    kv_ok = (offs_n[:, None] < N_K) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + z * stride_kz + h * stride_kh + rows * stride_kn + offs_d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(V + z * stride_vz + h * stride_vh + rows * stride_vn + offs_d[None, :], mask=kv_ok, other=0.0)
    q_base = Q + z * stride_qz + h * stride_qh
    do_base = DO + z * stride_doz + h * stride_doh
    lse_base = LSE + bh.to(tl.int64) * N_Q
    delta_base = DELTA + bh.to(tl.int64) * N_Q

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    full_end = (N_Q // BLOCK_M) * BLOCK_M
    if IS_CAUSAL:
        # Queries before start_n see none of these keys. Diagonal blocks first (masked), then the rest.
        diag_end = tl.minimum(start_n + BLOCK_N, N_Q)
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom, offs_n,
            start_n, diag_end, N_Q, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_D, IS_CAUSAL, True, DOT_PRECISION,
        )
        below = start_n + BLOCK_N
    else:
        below = 0
    dk, dv = _bwd_dkdv_inner(
        dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom, offs_n,
        below, full_end, N_Q, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_D, IS_CAUSAL, False, DOT_PRECISION,
    )
    dk, dv = _bwd_dkdv_inner(
        dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom, offs_n,
        tl.maximum(full_end, below), N_Q, N_Q, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_D, IS_CAUSAL, True,
        DOT_PRECISION,
    )
    dk = dk * sm_scale
    tl.store(DK + z * stride_dkz + h * stride_dkh + rows * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + z * stride_dvz + h * stride_dvh + rows * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_ok)


# ---------------------------------------------------------------------------------------------
# Launchers: (Z, H, N, d) views prepared and checked by ``api``
# ---------------------------------------------------------------------------------------------


def _strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """The (Z, H, N) strides of each 4-D tensor in turn, as the pointer kernels take them."""
    return tuple(s for t in tensors for s in t.stride()[:3])


def forward(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, lse: torch.Tensor,
            consts: dict, key: tuple) -> None:
    """Launch the forward kernel: O into o4, L into lse (``consts``: the constexprs; ``key``: the tuning key)."""
    z, h, n_q, d = q4.shape
    _launch(_flash_ptr_fwd, lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]) * z * h,), (
        q4, k4, v4, o4, lse, *_strides(q4, k4, v4, o4),
        h, n_q, k4.shape[2], key[0], d**-0.5 * _LOG2E,
    ), consts, key)


def dq(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, do4: torch.Tensor,
       lse: torch.Tensor, delta: torch.Tensor, dq4: torch.Tensor, consts: dict, key: tuple) -> None:
    """Launch the dQ kernel, which also writes D into ``delta``."""
    z, h, n_q, d = q4.shape
    sm_scale = d**-0.5
    _launch(_flash_ptr_bwd_dq, lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]) * z * h,), (
        q4, k4, v4, o4, do4, lse, delta, dq4, *_strides(q4, k4, v4, o4, do4, dq4),
        h, n_q, k4.shape[2], key[0], sm_scale * _LOG2E, sm_scale,
    ), consts, key)


def dkdv(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, do4: torch.Tensor, lse: torch.Tensor,
         delta: torch.Tensor, dk4: torch.Tensor, dv4: torch.Tensor, consts: dict, key: tuple) -> None:
    """Launch the dK/dV kernel, which reads the D that a dQ kernel wrote into ``delta``."""
    z, h, n_k, d = k4.shape
    sm_scale = d**-0.5
    _launch(_flash_ptr_bwd_dkdv, lambda meta: (triton.cdiv(n_k, meta["BLOCK_N"]) * z * h,), (
        q4, k4, v4, do4, lse, delta, dk4, dv4, *_strides(q4, k4, v4, do4, dk4, dv4),
        h, q4.shape[2], n_k, key[0], sm_scale * _LOG2E, sm_scale,
    ), consts, key)


__all__ = ["KERNEL_NAMES", "dkdv", "dq", "forward"]
