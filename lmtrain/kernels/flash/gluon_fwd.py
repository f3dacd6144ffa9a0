"""The Gluon FlashAttention forward for Hopper (sm_90): warp-specialised, the softmax of one key block overlapping
the matrix products of the next (see ``gluon_common`` for the schedule shared by the Gluon kernels).

The forward issues the scores of key block j+1 and ``O += P V`` of block j and waits for the scores only (ptxas moves
the wait for ``P V`` up to the start of the softmax's basic block, so ``P V`` runs beside the other consumers' work;
forcing that overlap measured slower). In a causal tile each consumer works only on the key blocks its 64 rows see
and passes the tile's later blocks on unread; with two consumers and 128-key blocks, a last block its rows see only
the first half of runs at half width. Block 0 is masked only where it needs it (two consumers), persistent pairs
find the next tile by multiply-high and shift (``fast_divisor``), and L leaves after O's copy with ``lg2.approx``.
"""

from __future__ import annotations

import torch
import triton

from lmtrain.kernels.flash.common import _LOG2E
from lmtrain.kernels.flash.gluon_common import _HAS_GLUON, _launch_shape, bind_context, descriptor, fast_divisor
from lmtrain.kernels.flash.launch_plans import launch_compiled
from lmtrain.kernels.flash.settings import current
from lmtrain.kernels.flash.tuning import FWD, WG_ROWS, Config, config

if _HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from lmtrain.kernels.flash.gluon_common import (
        _barriers,
        _batch_head,
        _causal_keep,
        _first_operand,
        _item_tile,
        _items,
        _pair_tile,
        _producer,
        _renewed,
        _store_tile,
        _streamed,
        _tile_coords,
        _turn_barriers,
        _turn_pass,
        _turn_wait,
        _wgmma_layout,
    )

#: The kernels as a profiler names them.
KERNEL_NAMES = ("_flash_gluon_fwd",)


if _HAS_GLUON:

    @gluon.jit
    def _log2_approx(x):
        """log2 of positive ``x`` on the multiplier's approximate unit (``lg2.approx``, relative error about 2^-22):
        ``gl.log2`` is a software polynomial of some 40 dependent instructions, run on every tile's end."""
        return gl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _online_softmax(s, m_i, l_i, qk_scale):
        """One block's step of the online softmax (log2 domain, scale folded in): (P, the rescale factor alpha of the
        earlier blocks' sums, the new row maxima m and sums l) from its masked scores ``s``. The rows of ``s`` may
        come in another layout than ``m_i``'s with the same rows per thread (the half-width diagonal block's): the
        conversions between the two move nothing."""
        rows: gl.constexpr = m_i.type.layout
        m_new = gl.maximum(m_i, gl.convert_layout(gl.max(s, 1) * qk_scale, rows))
        p = gl.exp2(s * qk_scale - gl.convert_layout(m_new, gl.SliceLayout(1, s.type.layout))[:, None])
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + gl.convert_layout(gl.sum(p, 1), rows)

    @gluon.jit
    def _fwd_consumer(o_desc, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                      turns, LSE, H, N_Q, N_K, NUM_TILES, qk_scale, PAIR_MUL, PAIR_SHIFT, HEAD_MUL, HEAD_SHIFT,
                      BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                      NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, WG: gl.constexpr, REG_A: gl.constexpr,
                      ITEMS: gl.constexpr, PINGPONG: gl.constexpr):
        """One warpgroup: query rows [start + 64 WG, start + 64 (WG + 1)) of each of the program's tiles. With
        PINGPONG the consumers issue each block's products in turns (``_turn_wait``).

        Causal: the warpgroup works only on the key blocks its own rows see (``n_mine``), not on all of the tile's;
        it passes the others' ring buffers on unread. And where its rows see only the first half of their last
        128-key block (the first warpgroup's rows on the diagonal), it multiplies with that half only (``half``):
        (64 x 64) scores and a 64-deep ``P V``."""
        NUM_WG: gl.constexpr = BLOCK_T // 64
        s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        HALF: gl.constexpr = 64
        SPLIT: gl.constexpr = IS_CAUSAL and BLOCK_N == 2 * HALF and NUM_WG == 2
        h_layout: gl.constexpr = _wgmma_layout(HALF)
        ha_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=h_layout, k_width=2)
        dtype: gl.constexpr = o_desc.dtype
        q = q_smem.index(WG).reshape([64, HEAD_DIM])
        zero_s = gl.zeros([64, BLOCK_N], gl.float32, s_layout)

        c = 0  # key/value blocks consumed so far: the ring position
        it = 0  # tiles done so far: the query barrier's phase
        turn = 0  # turns taken so far (PINGPONG)
        lo, hi, step = _items(NUM_TILES, N_Q, BLOCK_T, ITEMS)
        for item in range(lo, hi, step):
            if ITEMS == 1:
                valid, bh, start = _pair_tile(item, N_Q, BLOCK_T, IS_CAUSAL, PAIR_MUL, PAIR_SHIFT)
            else:
                tile, valid = _item_tile(item, N_Q, NUM_TILES, BLOCK_T, ITEMS)
                bh, _, _, start = _tile_coords(tile, N_Q, H, BLOCK_T, IS_CAUSAL)
            if valid:
                first, n_blocks, n_full = _streamed(start, N_Q, N_K, BLOCK_T, BLOCK_N, IS_CAUSAL, 0)
                row0 = start + WG * 64
                if IS_CAUSAL:
                    seen = gl.minimum(row0 + 63, N_K - 1)  # the last key any of these rows sees
                    n_mine = seen // BLOCK_N + 1
                else:
                    n_mine = n_blocks
                if SPLIT:
                    half = (seen % BLOCK_N < HALF) & (n_mine >= 2)
                else:
                    half = False
                offs_m = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
                offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

                # Key block 0: its scores and softmax, no P V yet.
                stage = c % NUM_STAGES
                mbarrier.wait(q_ready.index(WG), it & 1)
                q_a = _first_operand(q, a_layout, REG_A)
                mbarrier.wait(k_ready.index(stage), (c // NUM_STAGES) & 1)
                k = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
                _turn_wait(turns, turn, WG, PINGPONG)
                s_tok = warpgroup_mma(q_a, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                _turn_pass(turns, WG, NUM_WG, PINGPONG)
                turn += 1
                s = warpgroup_mma_wait(0, deps=(s_tok,))
                mbarrier.arrive(k_empty.index(stage), count=1)
                # Every row sees key 0, so each row's maximum is finite from here on: no NaN guard needed. With two
                # consumers the mask is applied only where block 0 needs one (it crosses the diagonal or the end of
                # the keys: the tile's first streamed block is not whole, n_full 0); elsewhere the selects cost some
                # 200 instructions per thread on each tile's start, outside the overlapped loop. Three consumers
                # always mask: the branch makes their kernel (160 registers) spill.
                if NUM_WG > 2:
                    s = gl.where(_causal_keep(offs_m, offs_n, N_K, IS_CAUSAL), s, float("-inf"))
                elif n_full == 0:
                    s = gl.where(_causal_keep(offs_m, offs_n, N_K, IS_CAUSAL), s, float("-inf"))
                m_i = gl.max(s, 1) * qk_scale
                p = gl.exp2(s * qk_scale - m_i[:, None])
                l_i = gl.sum(p, 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)

                for j in range(1, n_mine - half):
                    stage = (c + j) % NUM_STAGES
                    prev = (c + j - 1) % NUM_STAGES
                    mbarrier.wait(k_ready.index(stage), ((c + j) // NUM_STAGES) & 1)
                    k = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
                    _turn_wait(turns, turn, WG, PINGPONG)
                    s_tok = warpgroup_mma(q_a, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                    mbarrier.wait(v_ready.index(prev), ((c + j - 1) // NUM_STAGES) & 1)
                    v = v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM])
                    o_tok = warpgroup_mma(p_op, v, acc, is_async=True)
                    _turn_pass(turns, WG, NUM_WG, PINGPONG)
                    turn += 1
                    s = warpgroup_mma_wait(1, deps=(s_tok,))  # the scores; P V may still run
                    mbarrier.arrive(k_empty.index(stage), count=1)
                    if j >= n_full:
                        s = gl.where(_causal_keep(offs_m, j * BLOCK_N + offs_n, N_K, IS_CAUSAL), s, float("-inf"))
                    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale)
                    acc = warpgroup_mma_wait(0, deps=(o_tok,))
                    mbarrier.arrive(v_empty.index(prev), count=1)
                    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
                    p_op = gl.convert_layout(p.to(dtype), p_layout)
                    q_a = _renewed(q_a, N_K, REG_A)

                last = (c + n_mine - 1) % NUM_STAGES
                if half:
                    # The last block's first 64 keys only: its scores with the previous block's P V, as in the loop.
                    prev = (c + n_mine - 2) % NUM_STAGES
                    mbarrier.wait(k_ready.index(last), ((c + n_mine - 1) // NUM_STAGES) & 1)
                    k_h = k_smem.index(last).reshape([BLOCK_N, HEAD_DIM]).slice(0, HALF)
                    _turn_wait(turns, turn, WG, PINGPONG)
                    h_tok = warpgroup_mma(_first_operand(q, ha_layout, REG_A), k_h.permute((1, 0)),
                                          gl.zeros([64, HALF], gl.float32, h_layout), use_acc=False, is_async=True)
                    mbarrier.wait(v_ready.index(prev), ((c + n_mine - 2) // NUM_STAGES) & 1)
                    v = v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM])
                    o_tok = warpgroup_mma(p_op, v, acc, is_async=True)
                    _turn_pass(turns, WG, NUM_WG, PINGPONG)
                    turn += 1
                    s_h = warpgroup_mma_wait(1, deps=(h_tok,))
                    mbarrier.arrive(k_empty.index(last), count=1)
                    mbarrier.arrive(q_empty.index(WG), count=1)  # every Q K^T of the tile has completed
                    offs_mh = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, h_layout))
                    offs_nh = (n_mine - 1) * BLOCK_N + gl.arange(0, HALF, layout=gl.SliceLayout(0, h_layout))
                    s_h = gl.where(_causal_keep(offs_mh, offs_nh, N_K, IS_CAUSAL), s_h, float("-inf"))
                    p_h, alpha, m_i, l_i = _online_softmax(s_h, m_i, l_i, qk_scale)
                    acc = warpgroup_mma_wait(0, deps=(o_tok,))
                    mbarrier.arrive(v_empty.index(prev), count=1)
                    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
                    ph_op = gl.convert_layout(p_h.to(dtype), p_layout)
                    mbarrier.wait(v_ready.index(last), ((c + n_mine - 1) // NUM_STAGES) & 1)
                    v_h = v_smem.index(last).reshape([BLOCK_N, HEAD_DIM]).slice(0, HALF)
                    _turn_wait(turns, turn, WG, PINGPONG)
                    o_tok = warpgroup_mma(ph_op, v_h, acc, is_async=True)
                    _turn_pass(turns, WG, NUM_WG, PINGPONG)
                    # Waited for in the branch: a product still running where the branches join made ptxas
                    # serialise every warpgroup MMA of the kernel (C7512).
                    acc = warpgroup_mma_wait(0, deps=(o_tok,))
                else:
                    # Every Q K^T of the tile has completed: the producer may load queries into these buffers again.
                    mbarrier.arrive(q_empty.index(WG), count=1)
                    mbarrier.wait(v_ready.index(last), ((c + n_mine - 1) // NUM_STAGES) & 1)
                    v = v_smem.index(last).reshape([BLOCK_N, HEAD_DIM])
                    _turn_wait(turns, turn, WG, PINGPONG)
                    o_tok = warpgroup_mma(p_op, v, acc, is_async=True)
                    _turn_pass(turns, WG, NUM_WG, PINGPONG)
                    acc = warpgroup_mma_wait(0, deps=(o_tok,))
                turn += 1
                mbarrier.arrive(v_empty.index(last), count=1)
                # The tile's blocks after the last one these rows see: passed on unread, once they have arrived (an
                # early arrival would count towards the buffer's previous use), taking their turns.
                for j in range(n_mine, n_blocks):
                    stage = (c + j) % NUM_STAGES
                    mbarrier.wait(k_ready.index(stage), ((c + j) // NUM_STAGES) & 1)
                    mbarrier.arrive(k_empty.index(stage), count=1)
                    mbarrier.wait(v_ready.index(stage), ((c + j) // NUM_STAGES) & 1)
                    mbarrier.arrive(v_empty.index(stage), count=1)
                    _turn_wait(turns, turn, WG, PINGPONG)
                    _turn_pass(turns, WG, NUM_WG, PINGPONG)
                    turn += 1

                acc = acc * gl.convert_layout(1.0 / l_i, o_rows)[:, None]
                z, h = _batch_head(bh, H, HEAD_MUL, HEAD_SHIFT)
                _store_tile(o_desc, o_smem.index(WG), z, h, row0, acc.to(dtype), 0)
                # L after O: the fence before O's copy would otherwise wait for L's global stores to complete.
                lse = (m_i + _log2_approx(l_i)) * 0.6931471805599453  # log2 domain -> natural log
                gl.store(LSE + bh.to(gl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)
                c += n_blocks
                it += 1
        tma.store_wait(0)

    @gluon.jit
    def _flash_gluon_fwd(q_desc, k_desc, v_desc, o_desc, LSE, H, N_Q, N_K, NUM_TILES, qk_scale, PAIR_MUL, PAIR_SHIFT,
                    HEAD_MUL, HEAD_SHIFT,
                    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WG: gl.constexpr, NUM_STAGES: gl.constexpr,
                    IS_CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, REG_A: gl.constexpr,
                    ITEMS: gl.constexpr, PINGPONG: gl.constexpr):
        """Program p takes tiles p, p + grid, ... of the cdiv(N_Q, 64 NUM_WG) * Z * H, or with ITEMS the pairs
        of tiles p, p + grid, ... (``_items``). Shared memory and barriers are allocated here, then the warps split
        into NUM_WG consumers (the first in the default partition) and the producer."""
        BLOCK_T: gl.constexpr = NUM_WG * 64
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [NUM_WG] + q_desc.block_type.shape, q_desc.layout)
        o_smem = gl.allocate_shared_memory(dtype, [NUM_WG] + o_desc.block_type.shape, o_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_ready, q_empty = _barriers(NUM_WG, 1), _barriers(NUM_WG, 1)
        k_ready, k_empty = _barriers(NUM_STAGES, 1), _barriers(NUM_STAGES, NUM_WG)
        v_ready, v_empty = _barriers(NUM_STAGES, 1), _barriers(NUM_STAGES, NUM_WG)
        turns = _turn_barriers(NUM_WG, q_ready, PINGPONG)
        # Partitions take their arguments spelled out: a tuple built here would turn constexprs into values.
        if NUM_WG == 2:
            gl.warp_specialize([
                (_fwd_consumer, (o_desc, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                                 v_empty, turns, LSE, H, N_Q, N_K, NUM_TILES, qk_scale, PAIR_MUL, PAIR_SHIFT,
                                 HEAD_MUL, HEAD_SHIFT, BLOCK_T, BLOCK_N, HEAD_DIM, NUM_STAGES, IS_CAUSAL,
                                 0, REG_A, ITEMS, PINGPONG)),
                (_fwd_consumer, (o_desc, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                                 v_empty, turns, LSE, H, N_Q, N_K, NUM_TILES, qk_scale, PAIR_MUL, PAIR_SHIFT,
                                 HEAD_MUL, HEAD_SHIFT, BLOCK_T, BLOCK_N, HEAD_DIM, NUM_STAGES, IS_CAUSAL,
                                 1, REG_A, ITEMS, PINGPONG)),
                (_producer, (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_smem, v_smem, q_ready, q_empty,
                             k_ready, k_empty, v_ready, v_empty, H, N_Q, N_K, NUM_TILES, BLOCK_N, NUM_WG, NUM_STAGES,
                             IS_CAUSAL, 0, ITEMS)),
            ], [4, 1], [CONSUMER_REGS, 24])  # 24: _PRODUCER_REGS
        else:
            gl.warp_specialize([
                (_fwd_consumer, (o_desc, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                                 v_empty, turns, LSE, H, N_Q, N_K, NUM_TILES, qk_scale, PAIR_MUL, PAIR_SHIFT,
                                 HEAD_MUL, HEAD_SHIFT, BLOCK_T, BLOCK_N, HEAD_DIM, NUM_STAGES, IS_CAUSAL,
                                 0, REG_A, ITEMS, PINGPONG)),
                (_fwd_consumer, (o_desc, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                                 v_empty, turns, LSE, H, N_Q, N_K, NUM_TILES, qk_scale, PAIR_MUL, PAIR_SHIFT,
                                 HEAD_MUL, HEAD_SHIFT, BLOCK_T, BLOCK_N, HEAD_DIM, NUM_STAGES, IS_CAUSAL,
                                 1, REG_A, ITEMS, PINGPONG)),
                (_fwd_consumer, (o_desc, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                                 v_empty, turns, LSE, H, N_Q, N_K, NUM_TILES, qk_scale, PAIR_MUL, PAIR_SHIFT,
                                 HEAD_MUL, HEAD_SHIFT, BLOCK_T, BLOCK_N, HEAD_DIM, NUM_STAGES, IS_CAUSAL,
                                 2, REG_A, ITEMS, PINGPONG)),
                (_producer, (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_smem, v_smem, q_ready, q_empty,
                             k_ready, k_empty, v_ready, v_empty, H, N_Q, N_K, NUM_TILES, BLOCK_N, NUM_WG, NUM_STAGES,
                             IS_CAUSAL, 0, ITEMS)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])  # 24: _PRODUCER_REGS



def forward_args(q4, k4, v4, o4, lse, is_causal: bool, cfg: Config | None = None,
                 programs: int | None = None) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, keyword arguments) of one launch of the forward kernel; ``programs`` (default:
    as ``cfg.schedule`` says) caps the grid, each program then taking the work items p, p + grid, ... (tiles, or
    with schedules 1 and 2 pairs of tiles)."""
    z, h, n_q, d = q4.shape
    cfg = cfg or config(FWD, d, k4.shape[2], override=current().gluon_config("fwd"))
    grid, tiles, options = _launch_shape(n_q, z, h, cfg, programs, q4.device)
    pairs_per_head = (triton.cdiv(n_q, cfg.tile_rows) + 1) // 2
    args = (descriptor(q4, WG_ROWS), descriptor(k4, cfg.block), descriptor(v4, cfg.block), descriptor(o4, WG_ROWS),
            lse, h, n_q, k4.shape[2], tiles, d**-0.5 * _LOG2E, *fast_divisor(pairs_per_head), *fast_divisor(h))
    return grid, args, dict(HEAD_DIM=d, BLOCK_N=cfg.block, IS_CAUSAL=bool(is_causal), **options)


def forward(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, lse: torch.Tensor,
            is_causal: bool, cfg: Config | None = None) -> None:
    """O into ``o4`` and L into ``lse`` for (Z, H, N, d) views that ``usable`` accepted."""
    bind_context(q4.device)
    grid, args, kwargs = forward_args(q4, k4, v4, o4, lse, is_causal, cfg)
    launch_compiled(_flash_gluon_fwd, grid, args, kwargs)


__all__ = ["KERNEL_NAMES", "forward", "forward_args"]
