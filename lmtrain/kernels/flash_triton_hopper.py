"""FlashAttention-2 forward and backward for Hopper GPUs (sm_90 and later): tiles moved by TMA.

Same algorithm, outputs and properties as ``flash_triton`` (online-softmax forward writing O and the natural-log
logsumexp L; a dQ kernel that also writes ``D = rowsum(O * dO)``, then a dK/dV kernel; no atomics, so the backward
is deterministic; causal top-left aligned with the loops split into unmasked and masked parts). What differs is how
tiles reach shared memory: every q/k/v/O/dO tile is loaded, and every O/dQ/dK/dV tile stored, through a tensor
descriptor (``tl.make_tensor_descriptor``), which Triton lowers to the Hopper bulk tensor copy engine (TMA) on
sm_90. Each program builds one 2-D descriptor per tensor (two with a split head dim, below) for its own (batch,
head): shape (N, d), row stride from the tensor. That is what keeps the general shapes working without masks in the
loads:

* any N: rows past N read as zeros and are not written (the copy engine clips at the descriptor's shape); the
  score mask still removes keys past N_k, as in the pointer kernels;
* head dims that are not powers of two (80): by default the tiles are ``BLOCK_D`` = next power of two wide, the
  columns past d read as zeros and are not written; the padded columns cost matrix-unit time (1.6x the products
  at d 80), not memory traffic. With ``LMTRAIN_FLASH_TMA_SPLIT=1`` all three kernels split such a head dim into two
  column tiles instead (``split_head_dim``, chosen on the launch side: the largest power of two below d, then the
  next power of two, at least 16, covering the rest: 80 -> 64 + 16, 96 -> 64 + 32, 48 -> 32 + 16; one padded tile
  where two would not be narrower, 112 -> 128). Each tensor then has two descriptors over the same (N, d) matrix,
  moving (rows, BLOCK_D) tiles from column 0 and (rows, BLOCK_D1) tiles from column BLOCK_D (a 16-bit second tile
  is at least 32 bytes wide, the copy engine's least being 16, and starts on a 16-byte boundary); each product over
  the head dim (S = Q K^T, dP = dO V^T) is a sum of two, and each head-dim-wide result (O, dQ, dK, dV) two
  accumulators, so 80 columns of matrix work are done instead of 128. The split forward was timed on an H100
  (docs/benchmarks/2026-11-23-H100-flash-split-d80.md); the split dQ and dK/dV kernels have not run on a GPU yet.
  Opt-in until the GPU test against float64 has run (under Triton's interpreter all three kernels match the float64
  reference, split and padded: tests/test_flash_hopper_split.py);
* strided q/k/v (e.g. heads of a fused qkv projection): the descriptor takes the tensor's own strides.

The copy engine needs 16-byte alignment of the base pointers and of every stride but the last (which must be 1);
``usable`` checks that and the dtype (fp16/bf16; fp32 stays on the pointer kernels, whose IEEE products run on CUDA
cores anyway), the head dim (a multiple of 8 up to 128) and the GPU (compute capability 9.0 or later, a Triton with
in-kernel descriptors). Anything else runs the pointer kernels of ``flash_triton``, which also serve older GPUs and
Triton's interpreter. By default only the forward takes this path (``LMTRAIN_FLASH_TMA=forward``): on an H100 the TMA
forward followed by the pointer backward was the fastest of the three choices on the leaderboard problem, and the TMA
backward was slower than the pointer one (docs/benchmarks/2026-11-23-H100-flash-hopper.md).
``LMTRAIN_FLASH_TMA=1`` takes it for both passes, ``LMTRAIN_FLASH_TMA=0`` for neither.

The descriptors are built in the kernel, in a small global-memory scratch area that Triton asks its allocator for at
launch (128 bytes per descriptor per program); ``_ensure_allocator`` installs one backed by PyTorch's caching
allocator when none is set. Triton keeps the allocator in a context variable, so the check runs at every launch:
the backward runs on autograd's own thread.

Causal programs of one (batch, head) are launched longest rows first (forward, dQ) or longest columns first (dK/dV),
and heads one after the other, so the programs that run together share their K/V (or Q/dO) tiles in L2.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lmtrain.kernels._flash_shared import (
    _INTERPRET,
    _LOG2E,
    _NO_SPECIALIZE,
    _TUNE_KEY,
    _keep,
    _key_range,
    _launch,
    _prune_held_m,
    _prune_held_n,
    _query_block,
    _tuning_bench,
)

_HAS_DESCRIPTORS = hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")
_TMA_DTYPES = (torch.float16, torch.bfloat16)


def _ws_configs(blocks: list[tuple[int, int, int, int, bool]]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, warp-specialised loops) tuples -> triton configs."""
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WARP_SPEC": ws}, num_warps=w, num_stages=s)
            for bm, bn, w, s, ws in blocks]


# Chosen from a sweep on an H100 (bf16, causal, B*H*N = 2^21; see docs/benchmarks/2026-11-23-H100-flash-hopper.md):
# forward 128 x 128 with 8 warps and 3 stages for head dims above 64, 128 x 64 with 4 warps for 64; dQ 128 x 128 (d 128)
# or 64 x 64 (d 64); dK/dV 128 keys x 64 queries with 8 warps (d 80, 128) or x 32 with 4 warps (d 64, where its
# two accumulators fit). Warp-specialised loops (``WARP_SPEC``) were no faster than the best plain ones there, or did
# not compile, so none of the candidates uses them. The first fitting one is the default when autotuning is off.
_FWD_CONFIGS = _ws_configs([(128, 128, 8, 3, False), (128, 64, 4, 3, False), (128, 64, 8, 3, False)])
_DQ_CONFIGS = _ws_configs([(128, 128, 8, 2, False), (64, 64, 4, 3, False), (128, 32, 4, 3, False)])
_DKDV_CONFIGS = _ws_configs([(64, 128, 8, 3, False), (32, 128, 4, 3, False), (32, 128, 8, 3, False)])


# ---------------------------------------------------------------------------------------------
# Which calls this path serves
# ---------------------------------------------------------------------------------------------

_CAPABILITY: dict[int, tuple[int, int]] = {}


def _capability(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def _aligned(t: torch.Tensor) -> bool:
    """16-byte aligned base and strides (but the last, which must be 1): what a TMA descriptor needs."""
    elt = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * elt % 16 == 0 for s in t.stride()[:-1])


def usable(*tensors: torch.Tensor, backward: bool = False) -> bool:
    """Whether the TMA kernels serve these (Z, H, N, d) tensors (inputs and output buffers alike).

    ``LMTRAIN_FLASH_TMA``: ``forward`` (default) the forward only, ``1`` forward and backward, ``0`` neither.
    """
    setting = os.environ.get("LMTRAIN_FLASH_TMA", "forward")
    if _INTERPRET or not _HAS_DESCRIPTORS or setting == "0" or (backward and setting == "forward"):
        return False
    q = tensors[0]
    d = q.shape[-1]
    if q.device.type != "cuda" or q.dtype not in _TMA_DTYPES or d % 8 != 0 or not 16 <= d <= 128:
        return False
    return _capability(q.device) >= (9, 0) and all(_aligned(t) for t in tensors)


def _alloc_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for in-kernel descriptors, from PyTorch's caching allocator (stream-ordered like the launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    if current is None or isinstance(current.get(), _allocation.NullAllocator):
        triton.set_allocator(_alloc_scratch)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tile_desc(base, n_rows, stride_row, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Descriptor of one (batch, head)'s (n_rows, HEAD_DIM) matrix, moved in (ROWS, BLOCK_D) tiles."""
    return tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride_row, 1],
                                     block_shape=[ROWS, BLOCK_D])


# The head dim is covered by one or two column tiles (``split_head_dim``): columns [0, BLOCK_D) and, where
# BLOCK_D1 > 0, [BLOCK_D, BLOCK_D + BLOCK_D1). The helpers below hold the two parts of a row block as a pair
# (first, second); with one tile (BLOCK_D1 = 0) the second member is a stand-in that no helper reads or updates.


@triton.jit
def _col_descs(base, n_rows, stride_row, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_D1: tl.constexpr):
    """Descriptors of the (ROWS, BLOCK_D) and (ROWS, BLOCK_D1) tiles of one (batch, head)'s (n_rows, HEAD_DIM)
    matrix: the same matrix moved in two tile widths."""
    first = _tile_desc(base, n_rows, stride_row, HEAD_DIM, ROWS, BLOCK_D)
    second = first
    if BLOCK_D1 > 0:
        second = _tile_desc(base, n_rows, stride_row, HEAD_DIM, ROWS, BLOCK_D1)
    return first, second


@triton.jit
def _load_cols(descs, row, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr):
    """The row block from ``row`` on: its tile at column 0 and its tile at column BLOCK_D."""
    first = descs[0].load([row, 0])
    second = first
    if BLOCK_D1 > 0:
        second = descs[1].load([row, BLOCK_D])
    return first, second


@triton.jit
def _store_cols(descs, row, acc, scale, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr):
    """Store ``acc * scale`` (a pair of fp32 tiles) as the row block from ``row`` on, in the descriptors' dtype."""
    descs[0].store([row, 0], (acc[0] * scale).to(descs[0].dtype))
    if BLOCK_D1 > 0:
        descs[1].store([row, BLOCK_D], (acc[1] * scale).to(descs[1].dtype))


@triton.jit
def _zeros_cols(ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr):
    """A pair of fp32 accumulators for ROWS rows of the head dim, zeroed."""
    first = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    second = first
    if BLOCK_D1 > 0:
        second = tl.zeros([ROWS, BLOCK_D1], dtype=tl.float32)
    return first, second


@triton.jit
def _scale_cols(acc, scale, BLOCK_D1: tl.constexpr):
    """``acc * scale`` for a pair of accumulators."""
    second = acc[1]
    if BLOCK_D1 > 0:
        second = second * scale
    return acc[0] * scale, second


@triton.jit
def _dot_cols_t(a, b, BLOCK_D1: tl.constexpr):
    """a b^T over the head dim, summed over its column parts: a (M, width) and b (N, width) tile pairs -> (M, N)
    fp32."""
    ab_t = tl.dot(a[0], b[0].T)
    if BLOCK_D1 > 0:
        ab_t = tl.dot(a[1], b[1].T, ab_t)
    return ab_t


@triton.jit
def _dot_into_cols(p, b, acc, BLOCK_D1: tl.constexpr):
    """acc + p b, column part by column part: p (M, N) times a (N, width) tile pair, added to a (M, width)
    accumulator pair."""
    first = tl.dot(p, b[0], acc[0])
    second = acc[1]
    if BLOCK_D1 > 0:
        second = tl.dot(p, b[1], second)
    return first, second


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_descs, v_descs, offs_m, lo, hi, N_K, qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """Online-softmax update of one query block over key blocks [lo, hi)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        qk = _dot_cols_t(q, _load_cols(k_descs, start_n, BLOCK_D, BLOCK_D1), BLOCK_D1)  # (BLOCK_M, BLOCK_N) fp32
        if MASKED:
            qk = tl.where(_keep(offs_m, start_n + offs_n, N_K, IS_CAUSAL), qk, float("-inf"))
        # Every row sees key 0 in the first block it processes, so m_new is finite: no NaN guard needed.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_cols(v_descs, start_n, BLOCK_D, BLOCK_D1)
        acc = _dot_into_cols(p.to(v[0].dtype), v, _scale_cols(acc, alpha[:, None], BLOCK_D1), BLOCK_D1)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_FWD_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune_held_m},
                 do_bench=_tuning_bench)
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _fwd_kernel(
    Q, K, V, OUT, LSE,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    H, N_Q, N_K, N_KEY, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """One program = one block of BLOCK_M query rows of one (batch, head). Grid: (cdiv(N_Q, BLOCK_M) * Z * H,)."""
    bh, z, h, start_m = _query_block(N_Q, H, BLOCK_M, IS_CAUSAL)
    q = _load_cols(_col_descs(Q + z * stride_qz + h * stride_qh, N_Q, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D,
                              BLOCK_D1), start_m, BLOCK_D, BLOCK_D1)
    k_descs = _col_descs(K + z * stride_kz + h * stride_kh, N_K, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_D1)
    v_descs = _col_descs(V + z * stride_vz + h * stride_vh, N_K, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_D1)
    offs_m = start_m + tl.arange(0, BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = _zeros_cols(BLOCK_M, BLOCK_D, BLOCK_D1)
    full_end, hi = _key_range(start_m, N_K, BLOCK_M, BLOCK_N, IS_CAUSAL)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_descs, v_descs, offs_m, 0, full_end, N_K, qk_scale,
                               BLOCK_N, BLOCK_D, BLOCK_D1, IS_CAUSAL, False, WARP_SPEC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_descs, v_descs, offs_m, full_end, hi, N_K, qk_scale,
                               BLOCK_N, BLOCK_D, BLOCK_D1, IS_CAUSAL, True, WARP_SPEC)

    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # log2 domain -> natural log
    o_descs = _col_descs(OUT + z * stride_oz + h * stride_oh, N_Q, stride_om, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_D1)
    _store_cols(o_descs, start_m, acc, (1.0 / l_i)[:, None], BLOCK_D, BLOCK_D1)
    tl.store(LSE + bh.to(tl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta, k_descs, v_descs, offs_m, lo, hi, N_K, qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """Accumulate dQ of one query block over key blocks [lo, hi)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        k = _load_cols(k_descs, start_n, BLOCK_D, BLOCK_D1)
        v = _load_cols(v_descs, start_n, BLOCK_D, BLOCK_D1)
        p = tl.math.exp2(_dot_cols_t(q, k, BLOCK_D1) * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(_keep(offs_m, start_n + offs_n, N_K, IS_CAUSAL), p, 0.0)
        ds = p * (_dot_cols_t(do, v, BLOCK_D1) - delta[:, None])
        dq = _dot_into_cols(ds.to(k[0].dtype), k, dq, BLOCK_D1)
    return dq


@triton.autotune(configs=_DQ_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune_held_m},
                 do_bench=_tuning_bench)
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bwd_dq_kernel(
    Q, K, V, OUT, DO, LSE, DELTA, DQ,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    stride_doz, stride_doh, stride_dom,
    stride_dqz, stride_dqh, stride_dqm,
    H, N_Q, N_K, N_KEY, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """One program = one block of BLOCK_M query rows of one (batch, head). Grid: (cdiv(N_Q, BLOCK_M) * Z * H,).

    Also writes ``D = rowsum(O * dO)`` (fp32) of its rows, which it needs itself and the dK/dV kernel reads after it.
    """
    bh, z, h, start_m = _query_block(N_Q, H, BLOCK_M, IS_CAUSAL)
    q = _load_cols(_col_descs(Q + z * stride_qz + h * stride_qh, N_Q, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D,
                              BLOCK_D1), start_m, BLOCK_D, BLOCK_D1)
    do = _load_cols(_col_descs(DO + z * stride_doz + h * stride_doh, N_Q, stride_dom, HEAD_DIM, BLOCK_M, BLOCK_D,
                               BLOCK_D1), start_m, BLOCK_D, BLOCK_D1)
    o = _load_cols(_col_descs(OUT + z * stride_oz + h * stride_oh, N_Q, stride_om, HEAD_DIM, BLOCK_M, BLOCK_D,
                              BLOCK_D1), start_m, BLOCK_D, BLOCK_D1)
    k_descs = _col_descs(K + z * stride_kz + h * stride_kh, N_K, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_D1)
    v_descs = _col_descs(V + z * stride_vz + h * stride_vh, N_K, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_D1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < N_Q
    delta = tl.sum(o[0].to(tl.float32) * do[0].to(tl.float32), axis=1)
    if BLOCK_D1 > 0:
        delta += tl.sum(o[1].to(tl.float32) * do[1].to(tl.float32), axis=1)
    tl.store(DELTA + bh.to(tl.int64) * N_Q + offs_m, delta, mask=m_ok)
    lse2 = tl.load(LSE + bh.to(tl.int64) * N_Q + offs_m, mask=m_ok, other=float("inf")) * 1.4426950408889634

    dq = _zeros_cols(BLOCK_M, BLOCK_D, BLOCK_D1)
    full_end, hi = _key_range(start_m, N_K, BLOCK_M, BLOCK_N, IS_CAUSAL)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_descs, v_descs, offs_m, 0, full_end, N_K, qk_scale,
                       BLOCK_N, BLOCK_D, BLOCK_D1, IS_CAUSAL, False, WARP_SPEC)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_descs, v_descs, offs_m, full_end, hi, N_K, qk_scale,
                       BLOCK_N, BLOCK_D, BLOCK_D1, IS_CAUSAL, True, WARP_SPEC)
    dq_descs = _col_descs(DQ + z * stride_dqz + h * stride_dqh, N_Q, stride_dqm, HEAD_DIM, BLOCK_M, BLOCK_D,
                          BLOCK_D1)
    _store_cols(dq_descs, start_m, dq, sm_scale, BLOCK_D, BLOCK_D1)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, q_descs, do_descs, lse_base, delta_base, offs_n, lo, hi, N_Q, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query blocks [lo, hi). Works on transposed tiles (keys x queries)."""
    offs_i = tl.arange(0, BLOCK_M)
    for start_m in tl.range(lo, hi, BLOCK_M, warp_specialize=WARP_SPEC):
        m_idx = start_m + offs_i
        q = _load_cols(q_descs, start_m, BLOCK_D, BLOCK_D1)
        if MASKED:
            m_ok = m_idx < N_Q
            lse = tl.load(lse_base + m_idx, mask=m_ok, other=float("inf"))  # padded rows: P = 0
            delta = tl.load(delta_base + m_idx, mask=m_ok, other=0.0)
        else:
            lse = tl.load(lse_base + m_idx)
            delta = tl.load(delta_base + m_idx)
        qk_t = _dot_cols_t(k, q, BLOCK_D1)  # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :] * 1.4426950408889634)
        if MASKED:
            if IS_CAUSAL:
                p_t = tl.where(m_idx[None, :] >= offs_n[:, None], p_t, 0.0)
        do = _load_cols(do_descs, start_m, BLOCK_D, BLOCK_D1)
        dv = _dot_into_cols(p_t.to(do[0].dtype), do, dv, BLOCK_D1)
        ds_t = p_t * (_dot_cols_t(v, do, BLOCK_D1) - delta[None, :])
        dk = _dot_into_cols(ds_t.to(q[0].dtype), q, dk, BLOCK_D1)
    return dk, dv


@triton.autotune(configs=_DKDV_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune_held_n},
                 do_bench=_tuning_bench)
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_doz, stride_doh, stride_dom,
    stride_dkz, stride_dkh, stride_dkn,
    stride_dvz, stride_dvh, stride_dvn,
    H, N_Q, N_K, N_KEY, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """One program = one block of BLOCK_N keys of one (batch, head). Grid: (cdiv(N_K, BLOCK_N) * Z * H,).

    Causal programs start at their diagonal, so low key blocks (the longest loops) come first in launch order.
    Reads ``D`` (DELTA), which the dQ kernel writes, so it runs after that kernel.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N_K, BLOCK_N)
    bh = pid // num_n
    start_n = (pid % num_n) * BLOCK_N
    z = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_cols(_col_descs(K + z * stride_kz + h * stride_kh, N_K, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D,
                              BLOCK_D1), start_n, BLOCK_D, BLOCK_D1)
    v = _load_cols(_col_descs(V + z * stride_vz + h * stride_vh, N_K, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D,
                              BLOCK_D1), start_n, BLOCK_D, BLOCK_D1)
    q_descs = _col_descs(Q + z * stride_qz + h * stride_qh, N_Q, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_D1)
    do_descs = _col_descs(DO + z * stride_doz + h * stride_doh, N_Q, stride_dom, HEAD_DIM, BLOCK_M, BLOCK_D,
                          BLOCK_D1)
    lse_base = LSE + bh.to(tl.int64) * N_Q
    delta_base = DELTA + bh.to(tl.int64) * N_Q

    dk = _zeros_cols(BLOCK_N, BLOCK_D, BLOCK_D1)
    dv = _zeros_cols(BLOCK_N, BLOCK_D, BLOCK_D1)
    full_end = (N_Q // BLOCK_M) * BLOCK_M
    if IS_CAUSAL:
        # Queries before start_n see none of these keys. Diagonal blocks first (masked), then the rest.
        diag_end = tl.minimum(start_n + BLOCK_N, N_Q)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_descs, do_descs, lse_base, delta_base, offs_n, start_n, diag_end,
                                 N_Q, qk_scale, BLOCK_M, BLOCK_D, BLOCK_D1, IS_CAUSAL, True, WARP_SPEC)
        below = start_n + BLOCK_N
    else:
        below = 0
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_descs, do_descs, lse_base, delta_base, offs_n, below, full_end,
                             N_Q, qk_scale, BLOCK_M, BLOCK_D, BLOCK_D1, IS_CAUSAL, False, WARP_SPEC)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_descs, do_descs, lse_base, delta_base, offs_n,
                             tl.maximum(full_end, below), N_Q, N_Q, qk_scale, BLOCK_M, BLOCK_D, BLOCK_D1, IS_CAUSAL,
                             True, WARP_SPEC)
    dk_descs = _col_descs(DK + z * stride_dkz + h * stride_dkh, N_K, stride_dkn, HEAD_DIM, BLOCK_N, BLOCK_D,
                          BLOCK_D1)
    dv_descs = _col_descs(DV + z * stride_dvz + h * stride_dvh, N_K, stride_dvn, HEAD_DIM, BLOCK_N, BLOCK_D,
                          BLOCK_D1)
    _store_cols(dk_descs, start_n, dk, sm_scale, BLOCK_D, BLOCK_D1)
    _store_cols(dv_descs, start_n, dv, 1.0, BLOCK_D, BLOCK_D1)


# ---------------------------------------------------------------------------------------------
# Launchers: (Z, H, N, d) views prepared and checked by flash_triton's _forward / _backward
# ---------------------------------------------------------------------------------------------


def split_head_dim(d: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_D1): the widths of the two column tiles for head dim ``d``, BLOCK_D1 = 0 for one.

    A head dim that is a power of two is one tile. Otherwise the first tile is the largest power of two below d
    and the second the next power of two (at least 16, the least a matrix product takes) covering the rest, where
    that is narrower than one padded tile: 80 -> 64 + 16 (80 columns of matrix work instead of 128), 96 -> 64 + 32,
    48 -> 32 + 16, 72 -> 64 + 16; 112 -> one tile of 128 (64 + 64 saves nothing).
    """
    padded = triton.next_power_of_2(d)
    if padded == d:
        return d, 0
    first = padded // 2
    second = max(16, triton.next_power_of_2(d - first))
    return (first, second) if first + second < padded else (padded, 0)


def _with_head_dim_tiles(consts: dict, d: int) -> dict:
    """``consts`` with the head dim's tile widths: split as ``split_head_dim`` says with ``LMTRAIN_FLASH_TMA_SPLIT=1``,
    else one tile of the next power of two."""
    split = os.environ.get("LMTRAIN_FLASH_TMA_SPLIT", "0") == "1"
    block_d, block_d1 = split_head_dim(d) if split else (triton.next_power_of_2(d), 0)
    return {**consts, "BLOCK_D": block_d, "BLOCK_D1": block_d1}


def forward(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, lse: torch.Tensor,
            consts: dict, key: tuple) -> None:
    """Launch the TMA forward kernel: O into o4, L into lse (``consts``, ``key``: as flash_triton's launchers;
    the head dim's tiles as ``split_head_dim`` says)."""
    z, h, n_q, d = q4.shape
    n_k = k4.shape[2]
    consts = _with_head_dim_tiles(consts, d)
    _ensure_allocator()
    _launch(_fwd_kernel, lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]) * z * h,), (
        q4, k4, v4, o4, lse,
        q4.stride(0), q4.stride(1), q4.stride(2),
        k4.stride(0), k4.stride(1), k4.stride(2),
        v4.stride(0), v4.stride(1), v4.stride(2),
        o4.stride(0), o4.stride(1), o4.stride(2),
        h, n_q, n_k, key[0], d**-0.5 * _LOG2E,
    ), consts, key)


def backward(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, do4: torch.Tensor,
             lse: torch.Tensor, delta: torch.Tensor, dq4: torch.Tensor, dk4: torch.Tensor, dv4: torch.Tensor,
             consts: dict, key: tuple) -> None:
    """Launch the TMA dQ kernel (which writes D into ``delta``), then the TMA dK/dV kernel (the head dim's tiles as
    for ``forward``)."""
    z, h, n_q, d = q4.shape
    n_k = k4.shape[2]
    sm_scale = d**-0.5
    consts = _with_head_dim_tiles(consts, d)
    _ensure_allocator()
    _launch(_bwd_dq_kernel, lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]) * z * h,), (
        q4, k4, v4, o4, do4, lse, delta, dq4,
        q4.stride(0), q4.stride(1), q4.stride(2),
        k4.stride(0), k4.stride(1), k4.stride(2),
        v4.stride(0), v4.stride(1), v4.stride(2),
        o4.stride(0), o4.stride(1), o4.stride(2),
        do4.stride(0), do4.stride(1), do4.stride(2),
        dq4.stride(0), dq4.stride(1), dq4.stride(2),
        h, n_q, n_k, key[0], sm_scale * _LOG2E, sm_scale,
    ), consts, key)
    _launch(_bwd_dkdv_kernel, lambda meta: (triton.cdiv(n_k, meta["BLOCK_N"]) * z * h,), (
        q4, k4, v4, do4, lse, delta, dk4, dv4,
        q4.stride(0), q4.stride(1), q4.stride(2),
        k4.stride(0), k4.stride(1), k4.stride(2),
        v4.stride(0), v4.stride(1), v4.stride(2),
        do4.stride(0), do4.stride(1), do4.stride(2),
        dk4.stride(0), dk4.stride(1), dk4.stride(2),
        dv4.stride(0), dv4.stride(1), dv4.stride(2),
        h, n_q, n_k, key[0], sm_scale * _LOG2E, sm_scale,
    ), consts, key)


__all__ = ["backward", "forward", "split_head_dim", "usable"]
