"""FlashAttention-2 forward and backward for Hopper GPUs (sm_90 and later): the pointer kernels' algorithm with every
tile moved through TMA tensor descriptors.

Same algorithm, outputs and properties as ``pointer`` (online-softmax forward writing O and the natural-log logsumexp
L; a dQ kernel that also writes ``D = rowsum(O * dO)``, then a dK/dV kernel; no atomics, so the backward is
deterministic; causal top-left aligned with the loops split into unmasked and masked parts). What differs is how
tiles reach shared memory: every q/k/v/O/dO tile is loaded, and every O/dQ/dK/dV tile stored, through a tensor
descriptor, which Triton lowers to the Hopper bulk tensor copy engine (TMA).

The descriptors are built on the host, one per tensor and launch (``TensorDescriptor`` over the whole (Z, H, N, d)
tensor with its own strides, moving (1, 1, rows, width) boxes), and a program addresses its tiles by (batch, head,
row, column). Host descriptors beat descriptors built per program in the kernel, most at short sequences, where each
program's descriptor writes and fence are a large part of its work. The box shapes depend on the autotuned block
sizes, so each configuration's pre-launch hook sets them (``_set_boxes``). What the copy engine does at the edges
keeps the general shapes working without masks in the loads:

* any N: rows past N (of this batch and head: the box never crosses into the next head) read as zeros and are not
  written; the score mask still removes keys past N_k, as in the pointer kernels;
* head dims that are not powers of two are split into two column tiles (``split_head_dim``: 80 -> 64 + 16,
  96 -> 64 + 32, 48 -> 32 + 16; one padded tile where two would not be narrower, 112 -> 128), each moved through
  its own descriptor, so d 80 does 80 columns of matrix work instead of 128. The setting ``tma_split_head_dim=False``
  pads to one tile instead;
* strided q/k/v (e.g. heads of a fused qkv projection): the descriptors take the tensors' own strides.

The copy engine needs 16-byte alignment of the base pointers and of every stride but the last (which must be 1);
``dispatch.aligned`` checks that. Which calls these kernels serve (fp16/bf16, head dims a multiple of 8 up to 128,
compute capability 9.0 or later, aligned tensors) is the dispatcher's decision (``lmtrain.kernels.flash.dispatch``).

Causal programs of one (batch, head) are launched longest rows first (forward, dQ) or longest columns first (dK/dV),
and heads one after the other, so the programs that run together share their K/V (or Q/dO) tiles in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmtrain.kernels.flash.common import (
    _LOG2E,
    _NO_SPECIALIZE,
    _TUNE_KEY,
    _block_of,
    _keep,
    _key_range,
    _launch,
    _prune_held_m,
    _prune_held_n,
    _softmax_step,
    _tuning_bench,
)
from lmtrain.kernels.flash.dispatch import tma_strides
from lmtrain.kernels.flash.launch_plans import unchecked
from lmtrain.kernels.flash.settings import current

try:  # host-side tensor descriptors: Triton 3.4 and later
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer kernels serve every call
    TensorDescriptor = None

#: The kernels as a profiler names them.
KERNEL_NAMES = ("_flash_tma_fwd", "_flash_tma_bwd_dq", "_flash_tma_bwd_dkdv")

def _set_boxes(rows: dict[str, str]):
    """A configuration's pre-launch hook: give each descriptor argument its box for the configuration,
    (1, 1, rows, width) with rows ``BLOCK_M`` or ``BLOCK_N`` as ``rows`` says (argument name -> block) and width
    ``BLOCK_D`` (the argument X) or ``BLOCK_D1`` (X1, the second column tile of a split head dim)."""

    def hook(nargs: dict) -> None:
        for name, block in rows.items():
            for suffix, width in (("", "BLOCK_D"), ("1", "BLOCK_D1")):
                desc = nargs.get(name + suffix)
                if desc is not None:
                    desc.block_shape = [1, 1, nargs[block], nargs[width]]

    return hook


def _configs(blocks: list[tuple[int, int, int, int, bool]], rows: dict[str, str]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, warp-specialised loops) tuples -> triton configs whose pre-launch
    hook sets the descriptors' boxes (``_set_boxes``)."""
    hook = _set_boxes(rows)
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WARP_SPEC": ws}, num_warps=w, num_stages=s, pre_hook=hook)
            for bm, bn, w, s, ws in blocks]


_M, _N = "BLOCK_M", "BLOCK_N"

# Candidates from pinned sweeps on an H100 (bf16, causal, B*H*N = 2^21, N 1024 and 16384, head dims 64/80/128).
# Forward: 128 x 128 with 8 warps at d 128, 128 x 64 with 4
# warps at d 64 and split 80. dQ: 128 x 64 with 8 warps at long N, 64/128 x 32 with 4 warps at N 1024. dK/dV
# (keys x queries held x streamed): 64 x 64 with 4 warps at d 64/80, 64 x 32 with 4 warps and 2 stages at d 128,
# 128 x 64 with 8 warps close behind. Warp-specialised loops (``WARP_SPEC``) were no faster than the plain ones on the
# earlier sweep, 16-warp and 256-row tiles slower; none is a candidate. The first fitting one is the default when
# autotuning is off; the last is the smallest (what the pruning keeps when nothing else fits).
_FWD_CONFIGS = _configs([(128, 128, 8, 3, False), (128, 64, 4, 3, False), (128, 64, 8, 3, False)],
                        {"Q": _M, "K": _N, "V": _N, "OUT": _M})
_DQ_CONFIGS = _configs([(128, 128, 8, 2, False), (128, 64, 8, 3, False), (64, 64, 4, 3, False),
                        (128, 32, 4, 3, False), (64, 32, 4, 3, False)],
                       {"Q": _M, "K": _N, "V": _N, "OUT": _M, "DO": _M, "DQ": _M})
_DKDV_CONFIGS = _configs([(64, 128, 8, 3, False), (32, 128, 4, 3, False), (64, 128, 8, 2, False),
                          (64, 64, 4, 3, False), (32, 64, 4, 2, False)],
                         {"Q": _M, "K": _N, "V": _N, "DO": _M, "DK": _N, "DV": _N})


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

# Every q/k/v/O/dO/dQ/dK/dV argument of the kernels below is a host descriptor of the whole (Z, H, N, d) tensor,
# moving (1, 1, rows, width) boxes; a program addresses its tiles by (batch, head, row, column). The head dim is
# covered by one or two column tiles (``split_head_dim``): columns [0, BLOCK_D) through the descriptor X and, where
# BLOCK_D1 > 0, [BLOCK_D, BLOCK_D + BLOCK_D1) through the descriptor X1 (None without a split). The helpers hold
# the two parts of a row block as a pair (first, second); with one tile the second member is a stand-in that no
# helper reads or updates.


@triton.jit
def _load_tile(desc, z, h, row, col):
    """The (rows, width) tile of (batch z, head h) at (row, col): the descriptor's box without its two unit dims."""
    t = desc.load([z, h, row, col])
    return tl.reshape(t, [t.shape[2], t.shape[3]])


@triton.jit
def _store_tile(desc, z, h, row, col, x):
    desc.store([z, h, row, col], tl.reshape(x, [1, 1, x.shape[0], x.shape[1]]))


@triton.jit
def _load_cols(descs, z, h, row, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr):
    """The row block from ``row`` on: its tile at column 0 and its tile at column BLOCK_D."""
    first = _load_tile(descs[0], z, h, row, 0)
    second = first
    if BLOCK_D1 > 0:
        second = _load_tile(descs[1], z, h, row, BLOCK_D)
    return first, second


@triton.jit
def _store_cols(descs, z, h, row, acc, scale, dtype: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr):
    """Store ``acc * scale`` (a pair of fp32 tiles) in ``dtype`` as the row block from ``row`` on."""
    _store_tile(descs[0], z, h, row, 0, (acc[0] * scale).to(dtype))
    if BLOCK_D1 > 0:
        _store_tile(descs[1], z, h, row, BLOCK_D, (acc[1] * scale).to(dtype))


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
    acc, l_i, m_i, q, k_descs, v_descs, z, h, offs_m, lo, hi, N_K, qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """Online-softmax update of one query block over key blocks [lo, hi)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        k = _load_cols(k_descs, z, h, start_n, BLOCK_D, BLOCK_D1)
        qk = _dot_cols_t(q, k, BLOCK_D1)  # (BLOCK_M, BLOCK_N) fp32
        if MASKED:
            qk = tl.where(_keep(offs_m, start_n + offs_n, N_K, IS_CAUSAL), qk, float("-inf"))
        # Every row sees key 0 in the first block it processes, so the new maximum is finite: no NaN guard needed.
        p, alpha, l_i, m_i = _softmax_step(qk, l_i, m_i, qk_scale)
        v = _load_cols(v_descs, z, h, start_n, BLOCK_D, BLOCK_D1)
        acc = _dot_into_cols(p.to(v[0].dtype), v, _scale_cols(acc, alpha[:, None], BLOCK_D1), BLOCK_D1)
    return acc, l_i, m_i


@triton.autotune(configs=_FWD_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune_held_m},
                 do_bench=_tuning_bench)
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _flash_tma_fwd(
    Q, Q1, K, K1, V, V1, OUT, OUT1, LSE,
    H, N_Q, N_K, N_KEY, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """One program = one block of BLOCK_M query rows of one (batch, head). Grid: (cdiv(N_Q, BLOCK_M) * Z * H,).
    Causal programs of a head take the longest rows first, so the short ones fill the tail."""
    bh, z, h, start_m = _block_of(tl.program_id(0), N_Q, H, BLOCK_M, IS_CAUSAL)
    q = _load_cols((Q, Q1), z, h, start_m, BLOCK_D, BLOCK_D1)
    offs_m = start_m + tl.arange(0, BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = _zeros_cols(BLOCK_M, BLOCK_D, BLOCK_D1)
    full_end, hi = _key_range(start_m, N_K, BLOCK_M, BLOCK_N, IS_CAUSAL)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, (K, K1), (V, V1), z, h, offs_m, 0, full_end, N_K, qk_scale,
                               BLOCK_N, BLOCK_D, BLOCK_D1, IS_CAUSAL, False, WARP_SPEC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, (K, K1), (V, V1), z, h, offs_m, full_end, hi, N_K, qk_scale,
                               BLOCK_N, BLOCK_D, BLOCK_D1, IS_CAUSAL, True, WARP_SPEC)

    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # log2 domain -> natural log
    _store_cols((OUT, OUT1), z, h, start_m, acc, (1.0 / l_i)[:, None], q[0].dtype, BLOCK_D, BLOCK_D1)
    tl.store(LSE + bh.to(tl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta, k_descs, v_descs, z, h, offs_m, lo, hi, N_K, qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """Accumulate dQ of one query block over key blocks [lo, hi)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        k = _load_cols(k_descs, z, h, start_n, BLOCK_D, BLOCK_D1)
        v = _load_cols(v_descs, z, h, start_n, BLOCK_D, BLOCK_D1)
        p = tl.math.exp2(_dot_cols_t(q, k, BLOCK_D1) * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(_keep(offs_m, start_n + offs_n, N_K, IS_CAUSAL), p, 0.0)
        ds = p * (_dot_cols_t(do, v, BLOCK_D1) - delta[:, None])
        dq = _dot_into_cols(ds.to(k[0].dtype), k, dq, BLOCK_D1)
    return dq


@triton.autotune(configs=_DQ_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune_held_m},
                 do_bench=_tuning_bench)
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _flash_tma_bwd_dq(
    Q, Q1, K, K1, V, V1, OUT, OUT1, DO, DO1, DQ, DQ1, LSE, DELTA,
    H, N_Q, N_K, N_KEY, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """One program = one block of BLOCK_M query rows of one (batch, head). Grid: (cdiv(N_Q, BLOCK_M) * Z * H,).

    Also writes ``D = rowsum(O * dO)`` (fp32) of its rows, which it needs itself and the dK/dV kernel reads after it.
    """
    bh, z, h, start_m = _block_of(tl.program_id(0), N_Q, H, BLOCK_M, IS_CAUSAL)
    q = _load_cols((Q, Q1), z, h, start_m, BLOCK_D, BLOCK_D1)
    do = _load_cols((DO, DO1), z, h, start_m, BLOCK_D, BLOCK_D1)
    o = _load_cols((OUT, OUT1), z, h, start_m, BLOCK_D, BLOCK_D1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < N_Q
    delta = tl.sum(o[0].to(tl.float32) * do[0].to(tl.float32), axis=1)
    if BLOCK_D1 > 0:
        delta += tl.sum(o[1].to(tl.float32) * do[1].to(tl.float32), axis=1)
    tl.store(DELTA + bh.to(tl.int64) * N_Q + offs_m, delta, mask=m_ok)
    lse2 = tl.load(LSE + bh.to(tl.int64) * N_Q + offs_m, mask=m_ok, other=float("inf")) * 1.4426950408889634

    dq = _zeros_cols(BLOCK_M, BLOCK_D, BLOCK_D1)
    full_end, hi = _key_range(start_m, N_K, BLOCK_M, BLOCK_N, IS_CAUSAL)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, (K, K1), (V, V1), z, h, offs_m, 0, full_end, N_K, qk_scale,
                       BLOCK_N, BLOCK_D, BLOCK_D1, IS_CAUSAL, False, WARP_SPEC)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, (K, K1), (V, V1), z, h, offs_m, full_end, hi, N_K, qk_scale,
                       BLOCK_N, BLOCK_D, BLOCK_D1, IS_CAUSAL, True, WARP_SPEC)
    _store_cols((DQ, DQ1), z, h, start_m, dq, sm_scale, q[0].dtype, BLOCK_D, BLOCK_D1)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, q_descs, do_descs, z, h, lse_base, delta_base, offs_n, lo, hi, N_Q, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query blocks [lo, hi). Works on transposed tiles (keys x queries)."""
    offs_i = tl.arange(0, BLOCK_M)
    for start_m in tl.range(lo, hi, BLOCK_M, warp_specialize=WARP_SPEC):
        m_idx = start_m + offs_i
        q = _load_cols(q_descs, z, h, start_m, BLOCK_D, BLOCK_D1)
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
        do = _load_cols(do_descs, z, h, start_m, BLOCK_D, BLOCK_D1)
        dv = _dot_into_cols(p_t.to(do[0].dtype), do, dv, BLOCK_D1)
        ds_t = p_t * (_dot_cols_t(v, do, BLOCK_D1) - delta[None, :])
        dk = _dot_into_cols(ds_t.to(q[0].dtype), q, dk, BLOCK_D1)
    return dk, dv


@triton.autotune(configs=_DKDV_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune_held_n},
                 do_bench=_tuning_bench)
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _flash_tma_bwd_dkdv(
    Q, Q1, K, K1, V, V1, DO, DO1, DK, DK1, DV, DV1, LSE, DELTA,
    H, N_Q, N_K, N_KEY, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """One program = one block of BLOCK_N keys of one (batch, head). Grid: (cdiv(N_K, BLOCK_N) * Z * H,).

    Causal programs start at their diagonal, so low key blocks (the longest loops) come first in launch order.
    Reads ``D`` (DELTA), which the dQ kernel writes, so it runs after that kernel.
    """
    bh, z, h, start_n = _block_of(tl.program_id(0), N_K, H, BLOCK_N, False)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_cols((K, K1), z, h, start_n, BLOCK_D, BLOCK_D1)
    v = _load_cols((V, V1), z, h, start_n, BLOCK_D, BLOCK_D1)
    lse_base = LSE + bh.to(tl.int64) * N_Q
    delta_base = DELTA + bh.to(tl.int64) * N_Q

    dk = _zeros_cols(BLOCK_N, BLOCK_D, BLOCK_D1)
    dv = _zeros_cols(BLOCK_N, BLOCK_D, BLOCK_D1)
    full_end = (N_Q // BLOCK_M) * BLOCK_M
    if IS_CAUSAL:
        # Queries before start_n see none of these keys. Diagonal blocks first (masked), then the rest.
        diag_end = tl.minimum(start_n + BLOCK_N, N_Q)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, (Q, Q1), (DO, DO1), z, h, lse_base, delta_base, offs_n, start_n,
                                 diag_end, N_Q, qk_scale, BLOCK_M, BLOCK_D, BLOCK_D1, IS_CAUSAL, True, WARP_SPEC)
        below = start_n + BLOCK_N
    else:
        below = 0
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, (Q, Q1), (DO, DO1), z, h, lse_base, delta_base, offs_n, below, full_end,
                             N_Q, qk_scale, BLOCK_M, BLOCK_D, BLOCK_D1, IS_CAUSAL, False, WARP_SPEC)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, (Q, Q1), (DO, DO1), z, h, lse_base, delta_base, offs_n,
                             tl.maximum(full_end, below), N_Q, N_Q, qk_scale, BLOCK_M, BLOCK_D, BLOCK_D1, IS_CAUSAL,
                             True, WARP_SPEC)
    _store_cols((DK, DK1), z, h, start_n, dk, sm_scale, k[0].dtype, BLOCK_D, BLOCK_D1)
    _store_cols((DV, DV1), z, h, start_n, dv, 1.0, k[0].dtype, BLOCK_D, BLOCK_D1)


# ---------------------------------------------------------------------------------------------
# Launchers: (Z, H, N, d) views prepared and checked by ``api``
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
    """``consts`` with the head dim's tile widths: split as ``split_head_dim`` says with the setting
    ``tma_split_head_dim`` (default), else one tile of the next power of two."""
    split = current().tma_split_head_dim
    block_d, block_d1 = split_head_dim(d) if split else (triton.next_power_of_2(d), 0)
    return {**consts, "BLOCK_D": block_d, "BLOCK_D1": block_d1}


def _descs(t: torch.Tensor, block_d: int, block_d1: int) -> tuple[TensorDescriptor, TensorDescriptor | None]:
    """Host descriptors of a (Z, H, N, d) tensor: columns from 0 in BLOCK_D-wide boxes and, with a split head dim,
    from BLOCK_D in BLOCK_D1-wide ones (None without). Box rows are set per configuration by ``_set_boxes``."""
    shape, strides = list(t.shape), tma_strides(t)
    first = unchecked(TensorDescriptor, base=t, shape=shape, strides=strides, block_shape=[1, 1, 16, block_d])
    return first, (unchecked(TensorDescriptor, base=t, shape=shape, strides=strides, block_shape=[1, 1, 16, block_d1])
                   if block_d1 else None)


def forward(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, lse: torch.Tensor,
            consts: dict, key: tuple) -> None:
    """Launch the TMA forward kernel: O into o4, L into lse (``consts``, ``key``: as flash_triton's launchers;
    the head dim's tiles as ``split_head_dim`` says)."""
    z, h, n_q, d = q4.shape
    n_k = k4.shape[2]
    consts = _with_head_dim_tiles(consts, d)
    widths = consts["BLOCK_D"], consts["BLOCK_D1"]
    _launch(_flash_tma_fwd, lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]) * z * h,), (
        *_descs(q4, *widths), *_descs(k4, *widths), *_descs(v4, *widths), *_descs(o4, *widths), lse,
        h, n_q, n_k, key[0], d**-0.5 * _LOG2E,
    ), consts, key)


def _descs_of(tensors: tuple[torch.Tensor, ...], widths: tuple[int, int], cache: dict | None) -> list:
    """``_descs`` of each tensor, in order, flattened; ``cache`` (a dict kept for one backward call) hands both backward
    kernels the same descriptor objects for the tensors they share. That is safe because each launch's pre-launch
    hook sets the boxes it needs just before the launch encodes them; it halves the descriptors a call builds on the
    host for q, k, v and dO."""
    out = []
    for t in tensors:
        pair = None if cache is None else cache.get(id(t))
        if pair is None:
            pair = _descs(t, *widths)
            if cache is not None:
                cache[id(t)] = pair
        out.extend(pair)
    return out


def dq(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, do4: torch.Tensor,
       lse: torch.Tensor, delta: torch.Tensor, dq4: torch.Tensor, consts: dict, key: tuple,
       cache: dict | None = None) -> None:
    """Launch the TMA dQ kernel, which also writes D into ``delta`` (the head dim's tiles as for ``forward``;
    ``cache`` as for ``_descs_of``)."""
    z, h, n_q, d = q4.shape
    sm_scale = d**-0.5
    consts = _with_head_dim_tiles(consts, d)
    widths = consts["BLOCK_D"], consts["BLOCK_D1"]
    _launch(_flash_tma_bwd_dq, lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]) * z * h,), (
        *_descs_of((q4, k4, v4, o4, do4, dq4), widths, cache), lse, delta,
        h, n_q, k4.shape[2], key[0], sm_scale * _LOG2E, sm_scale,
    ), consts, key)


def dkdv(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, do4: torch.Tensor, lse: torch.Tensor,
         delta: torch.Tensor, dk4: torch.Tensor, dv4: torch.Tensor, consts: dict, key: tuple,
         cache: dict | None = None) -> None:
    """Launch the TMA dK/dV kernel, which reads the D that a dQ kernel wrote into ``delta``."""
    z, h, n_k, d = k4.shape
    sm_scale = d**-0.5
    consts = _with_head_dim_tiles(consts, d)
    widths = consts["BLOCK_D"], consts["BLOCK_D1"]
    _launch(_flash_tma_bwd_dkdv, lambda meta: (triton.cdiv(n_k, meta["BLOCK_N"]) * z * h,), (
        *_descs_of((q4, k4, v4, do4, dk4, dv4), widths, cache), lse, delta,
        h, q4.shape[2], n_k, key[0], sm_scale * _LOG2E, sm_scale,
    ), consts, key)


def backward(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, do4: torch.Tensor,
             lse: torch.Tensor, delta: torch.Tensor, dq4: torch.Tensor, dk4: torch.Tensor, dv4: torch.Tensor,
             consts: dict, key: tuple) -> None:
    """The TMA dQ kernel (which writes D into ``delta``), then the TMA dK/dV kernel, sharing descriptors."""
    cache: dict = {}
    dq(q4, k4, v4, o4, do4, lse, delta, dq4, consts, key, cache)
    dkdv(q4, k4, v4, do4, lse, delta, dk4, dv4, consts, key, cache)


