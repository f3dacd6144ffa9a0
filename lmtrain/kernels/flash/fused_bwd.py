"""The fused FlashAttention backward for Hopper (sm_90) in Gluon: dQ, dK and dV in one kernel, dQ summed by TMA
reductions, with the two small ``tl`` kernels around it (D and zeroed sums before, dQ from the sums after).

The dK/dV kernel's consumers (``gluon_bwd._dkdv_consumer`` with ``FUSED``) also compute each query block's dQ over
the tile's keys (``dS K``), five products per block pair instead of the seven of the dQ and dK/dV kernels: the two
consumers split dQ's columns, each multiplying both consumers' dS^T tiles (through double-buffered shared memory, a
barrier per block) by its half of both K tiles' columns. Each consumer adds its (block x d/2) product into an fp32
(Z, H, N_q, d) tensor of sums by a TMA reduction (``cp.reduce.async.bulk.tensor ... .add``, which Gluon's Hopper
module does not wrap: ``gluon_common._tma_reduce_add`` builds Triton's own op) from one of two shared-memory slots,
so the reduction runs in L2 while the consumer goes on. ``_flash_bwd_delta`` first writes D and zeroes the sums,
``_flash_bwd_dq_convert`` scales them into dQ. At head dim 128 dK and dV leave through the sum slots.

The order in which key tiles add into a block varies, so dQ may differ in its last bits from run to run: under
``torch.use_deterministic_algorithms(True)`` the dispatcher never selects this backward. At head dims 64 and 128,
bf16 and causal on an H100 it took 0.90-0.99x the dQ and dK/dV kernels' time at 4096 to 16384 keys and 1.07-1.19x at
1024, hence its default from 4096 keys (``tuning.FUSED_FROM``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmtrain.kernels.flash.gluon_bwd import dkdv_args
from lmtrain.kernels.flash.gluon_common import _HAS_GLUON, bind_context, descriptor
from lmtrain.kernels.flash.launch_plans import launch_compiled
from lmtrain.kernels.flash.tuning import Config

if _HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from lmtrain.kernels.flash.gluon_bwd import _dkdv_buffers, _dkdv_consumer, _stats_buffers
    from lmtrain.kernels.flash.gluon_common import _barriers, _producer, _turn_barriers

#: The kernels as a profiler names them.
KERNEL_NAMES = ("_flash_fused_bwd_atomic", "_flash_bwd_delta", "_flash_bwd_dq_convert")


if _HAS_GLUON:

    @gluon.jit
    def _flash_fused_bwd_atomic(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, acc_desc, lse_desc, delta_desc,
                           H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale,
                           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, NUM_WG: gl.constexpr,
                           NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           REG_A: gl.constexpr, ITEMS: gl.constexpr, PINGPONG: gl.constexpr,
                           SMEM_STATS: gl.constexpr, NUM_SLOTS: gl.constexpr, OUT_IN_SLOTS: gl.constexpr):
        """Over key tiles as ``_dkdv_kernel``: dK and dV of each, and every tile's share of dQ (``dS K`` over its
        128 keys, each consumer computing half of dQ's columns, ``acc_desc``'s box) added into fp32 sums (zeroed
        before) by TMA reductions from NUM_SLOTS shared-memory tiles per consumer. Five products per block pair; the
        sums' order of addition varies from run to run. Reads D, which ``_flash_bwd_delta`` writes. OUT_IN_SLOTS: dK
        and dV leave through the sum slots at the end of a tile rather than tiles of their own, which leaves shared
        memory for the sums (head dim 128)."""
        dtype: gl.constexpr = q_desc.dtype
        BLOCK_T: gl.constexpr = NUM_WG * 64
        gl.static_assert(NUM_WG == 2, "the fused backward runs two consumer warpgroups")
        (k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready, kv_empty, q_ready, q_empty, do_ready,
         do_empty) = _dkdv_buffers(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, NUM_WG, NUM_STAGES,
                                   not OUT_IN_SLOTS, NUM_WG)
        lse_smem, delta_smem = _stats_buffers(lse_desc, delta_desc, k_smem, NUM_STAGES, SMEM_STATS)
        ds_smem = gl.allocate_shared_memory(dtype, [2 * NUM_WG, 64, BLOCK_M],
                                            gl.NVMMASharedLayout.get_default_for([64, BLOCK_M], dtype))
        ds_ready = _barriers(2, NUM_WG)
        slots = gl.allocate_shared_memory(gl.float32, [NUM_SLOTS * NUM_WG] + acc_desc.block_type.shape,
                                          acc_desc.layout)
        turns = _turn_barriers(NUM_WG, kv_ready, PINGPONG)
        gl.warp_specialize([
            (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready,
                              kv_empty, q_ready, q_empty, do_ready, do_empty, ds_smem, slots, ds_ready,
                              turns, lse_desc, delta_desc, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                              BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 0, REG_A, True, ITEMS, PINGPONG,
                              lse_smem, delta_smem, SMEM_STATS, acc_desc, NUM_SLOTS, OUT_IN_SLOTS)),
            (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready,
                              kv_empty, q_ready, q_empty, do_ready, do_empty, ds_smem, slots, ds_ready,
                              turns, lse_desc, delta_desc, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                              BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 1, REG_A, True, ITEMS, PINGPONG,
                              lse_smem, delta_smem, SMEM_STATS, acc_desc, NUM_SLOTS, OUT_IN_SLOTS)),
            (_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty,
                         q_ready, q_empty, do_ready, do_empty, H, N_Q, N_K, NUM_TILES, BLOCK_M, NUM_WG, NUM_STAGES,
                         IS_CAUSAL, 2, ITEMS, lse_desc, delta_desc, lse_smem, delta_smem, SMEM_STATS)),
        ], [4, 1], [CONSUMER_REGS, 24])  # 24: _PRODUCER_REGS


def bwd_atomic_args(q4, k4, v4, do4, dk4, dv4, acc, lse, delta, is_causal: bool, cfg: Config | None = None,
                    programs: int | None = None) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, keyword arguments) of one launch of ``_flash_fused_bwd_atomic``: those of the dK/dV
    kernel (``dkdv_args``, the same configuration) with ``acc``, the dense fp32 (Z, H, N_Q, d) tensor of dQ sums
    (zeroed), moved in boxes of d / 2 columns (one consumer's half); at head dim 128 dK and dV leave through the sum
    slots (shared memory holds no tiles of their own beside them)."""
    grid, args, kwargs = dkdv_args(q4, k4, v4, do4, dk4, dv4, lse, delta, is_causal, cfg, programs)
    args = (*args[:6], descriptor(acc, kwargs["BLOCK_M"], q4.shape[-1] // kwargs["NUM_WG"]), *args[6:])
    return grid, args, dict(kwargs, NUM_SLOTS=2, OUT_IN_SLOTS=q4.shape[-1] > 64)


@triton.jit
def _flash_bwd_dq_convert(ACC, DQ, stride_z, stride_h, stride_n, H, N_Q, scale, HEAD_DIM: tl.constexpr,
                          BLOCK: tl.constexpr):
    """dQ = scale * the fp32 sums of the fused backward, in dQ's dtype, for BLOCK rows of one head (grid:
    ``_row_grid``)."""
    bh = tl.program_id(0)
    z, h = bh // H, bh % H
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    ok = (rows < N_Q)[:, None]
    acc = tl.load(ACC + (bh.to(tl.int64) * N_Q + rows)[:, None] * HEAD_DIM + cols[None, :], mask=ok, other=0.0)
    tl.store(DQ + z.to(tl.int64) * stride_z + h.to(tl.int64) * stride_h + rows.to(tl.int64)[:, None] * stride_n
             + cols[None, :], (acc * scale).to(DQ.dtype.element_ty), mask=ok)


def backward_atomic(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, do4: torch.Tensor,
                    dq4: torch.Tensor, dk4: torch.Tensor, dv4: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                    acc: torch.Tensor, is_causal: bool, cfg: Config | None = None) -> None:
    """dQ, dK and dV into ``dq4``, ``dk4``, ``dv4`` with ``_flash_fused_bwd_atomic``, for views the dispatcher gave it:
    D into ``delta`` and zeros into ``acc`` (dense fp32 (Z, H, N_Q, d), ``_flash_bwd_delta``), the fused kernel, then
    dQ from the sums (``_flash_bwd_dq_convert``)."""
    bind_context(q4.device)
    z, h, n_q, d = q4.shape
    launch_compiled(_flash_bwd_delta, *delta_args(o4, do4, delta, acc))
    launch_compiled(_flash_fused_bwd_atomic,
                    *bwd_atomic_args(q4, k4, v4, do4, dk4, dv4, acc, lse, delta, is_causal, cfg))
    launch_compiled(_flash_bwd_dq_convert, _row_grid(z * h, n_q),
                    (acc, dq4, *dq4.stride()[:3], h, n_q, d**-0.5), dict(HEAD_DIM=d, BLOCK=_ROW_BLOCK, num_warps=4))


_ROW_BLOCK = 64  # rows per program of the small tl kernels around the backward (D and zeroing, dQ from the sums)


def _row_grid(heads: int, n: int) -> tuple[int, int]:
    """The grid of the small tl kernels over ``heads`` x ``n`` rows: heads on the first axis, which takes up to
    2^31 - 1 programs, row blocks on the second (at most 65535, so up to some 4 million rows). With the heads on the
    second axis, a call of more than 65535 batch x heads failed to launch."""
    return heads, triton.cdiv(n, _ROW_BLOCK)


@triton.jit
def _flash_bwd_delta(OUT, DO, DELTA, stride_oz, stride_oh, stride_on, stride_dz, stride_dh, stride_dn, H, N_Q,
                     ACC, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ZERO_ACC: tl.constexpr = False):
    """D = rowsum(O * dO) in fp32 for BLOCK rows of one head; ZERO_ACC: also zeros for those rows of the dense fp32
    (Z, H, N_Q, d) sums ``ACC`` (grid: ``_row_grid``)."""
    bh = tl.program_id(0)
    z, h = bh // H, bh % H
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    ok = (rows < N_Q)[:, None]
    o = tl.load(OUT + z.to(tl.int64) * stride_oz + h.to(tl.int64) * stride_oh + rows.to(tl.int64)[:, None] * stride_on
                + cols[None, :], mask=ok, other=0.0)
    do = tl.load(DO + z.to(tl.int64) * stride_dz + h.to(tl.int64) * stride_dh + rows.to(tl.int64)[:, None] * stride_dn
                 + cols[None, :], mask=ok, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * N_Q + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < N_Q)
    if ZERO_ACC:
        tl.store(ACC + (bh.to(tl.int64) * N_Q + rows)[:, None] * HEAD_DIM + cols[None, :],
                 tl.zeros([BLOCK, HEAD_DIM], tl.float32), mask=ok)


def delta_args(o4, do4, delta, acc=None) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, keyword arguments) of ``_flash_bwd_delta`` over (Z, H, N, d) O and dO, zeroing
    ``acc`` if given."""
    z, h, n_q, d = o4.shape
    return (_row_grid(z * h, n_q),
            (o4, do4, delta, *o4.stride()[:3], *do4.stride()[:3], h, n_q, delta if acc is None else acc),
            dict(HEAD_DIM=d, BLOCK=_ROW_BLOCK, ZERO_ACC=acc is not None, num_warps=4))


__all__ = ["KERNEL_NAMES", "backward_atomic", "bwd_atomic_args", "delta_args"]
