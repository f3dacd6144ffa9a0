"""The Gluon FlashAttention backward kernels for Hopper (sm_90): dQ (which also writes D), then dK/dV
(see ``gluon_common`` for the schedule shared by the Gluon kernels).

Both issue the two score-like products (``Q K^T`` and ``dO V^T``), compute P while the second runs, issue
``dV += P^T dO`` before computing dS, and wait for the gradient products at the end of the block. The dK/dV kernel
works on transposed scores (keys x queries), so P^T and dS^T come out of its products already as the first operands
of ``dV += P^T dO`` and ``dK += dS^T Q``: no score tile goes through shared memory. Each streamed query block also
needs its queries' L and D: the producer copies them (TMA, boxes of one row of the (Z * H, N_q) statistics) into the
ring with the block's queries, and each consumer reads its slice from shared memory just before use (loaded from
global memory at the block's start instead, they waited on memory latency and held registers across the block).
Where TMA cannot copy them (N_q not a multiple of 4), the consumers load them (``tuning._DKDV_LOADS``).

``_dkdv_consumer`` also serves the fused backward (``fused_bwd``) with ``FUSED`` set.
"""

from __future__ import annotations

import torch

from lmtrain.kernels.flash.common import _LOG2E
from lmtrain.kernels.flash.gluon_common import (
    _HAS_GLUON,
    _launch_shape,
    _rows_aligned,
    _rows_descriptor,
    bind_context,
    descriptor,
)
from lmtrain.kernels.flash.launch_plans import launch_compiled
from lmtrain.kernels.flash.settings import current
from lmtrain.kernels.flash.tuning import DKDV, DQ, WG_ROWS, Config, config

if _HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from lmtrain.kernels.flash.gluon_common import (
        _barriers,
        _causal_keep,
        _first_operand,
        _item_tile,
        _items,
        _producer,
        _renewed,
        _smem_view,
        _store_tile,
        _streamed,
        _tile_coords,
        _tma_reduce_add,
        _turn_barriers,
        _turn_pass,
        _turn_wait,
        _wgmma_layout,
    )

#: The kernels as a profiler names them.
KERNEL_NAMES = ("_flash_gluon_bwd_dq", "_flash_gluon_bwd_dkdv")


if _HAS_GLUON:

    @gluon.jit
    def _dq_consumer(dq_desc, q_smem, do_smem, dq_smem, k_smem, v_smem, qdo_ready, qdo_empty, k_ready, k_empty,
                     v_ready, v_empty, turns, OUT, stride_oz, stride_oh, stride_on, LSE, DELTA, H, N_Q, N_K,
                     NUM_TILES, qk_scale, sm_scale, BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, WG: gl.constexpr,
                     REG_A: gl.constexpr, ITEMS: gl.constexpr, PINGPONG: gl.constexpr):
        """One warpgroup: dQ of query rows [start + 64 WG, start + 64 (WG + 1)) of each tile, and their D. With
        PINGPONG the consumers issue each block's score products in turns (``_turn_wait``)."""
        NUM_WG: gl.constexpr = BLOCK_T // 64
        s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        dq_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
        ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
        rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        COLS_T: gl.constexpr = HEAD_DIM // 8  # threads along the head dim when reading O and dO, 8 elements each
        od_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // COLS_T, COLS_T], [4, 1], [1, 0])
        dtype: gl.constexpr = dq_desc.dtype
        q = q_smem.index(WG).reshape([64, HEAD_DIM])
        do = do_smem.index(WG).reshape([64, HEAD_DIM])
        zero_s = gl.zeros([64, BLOCK_N], gl.float32, s_layout)

        c = 0
        it = 0
        turn = 0
        lo, hi, step = _items(NUM_TILES, N_Q, BLOCK_T, ITEMS)
        for item in range(lo, hi, step):
            tile, valid = _item_tile(item, N_Q, NUM_TILES, BLOCK_T, ITEMS)
            if valid:
                bh, z, h, start = _tile_coords(tile, N_Q, H, BLOCK_T, IS_CAUSAL)
                first, n_blocks, n_full = _streamed(start, N_Q, N_K, BLOCK_T, BLOCK_N, IS_CAUSAL, 1)
                row0 = start + WG * 64
                offs_m = row0 + gl.arange(0, 64, layout=rows)
                offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                m_ok = offs_m < N_Q
                lse2 = gl.load(LSE + bh.to(gl.int64) * N_Q + offs_m, mask=m_ok, other=float("inf")) * 1.4426950408889634

                # D = rowsum(O * dO) of these rows: O read here, dO from the tile the producer loaded.
                o_rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, od_layout))
                o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, od_layout))
                o_ptrs = (OUT + z.to(gl.int64) * stride_oz + h.to(gl.int64) * stride_oh
                          + o_rows.to(gl.int64)[:, None] * stride_on + o_cols[None, :])
                o = gl.load(o_ptrs, mask=(o_rows < N_Q)[:, None], other=0.0)
                mbarrier.wait(qdo_ready.index(WG), it & 1)
                delta = gl.convert_layout(gl.sum(o.to(gl.float32) * do.load(od_layout).to(gl.float32), 1), rows)
                gl.store(DELTA + bh.to(gl.int64) * N_Q + offs_m, delta, mask=m_ok)
                q_a, do_a = _first_operand(q, a_layout, REG_A), _first_operand(do, a_layout, REG_A)

                dq = gl.zeros([64, HEAD_DIM], gl.float32, dq_layout)
                for j in range(0, n_blocks):
                    stage = (c + j) % NUM_STAGES
                    phase = ((c + j) // NUM_STAGES) & 1
                    mbarrier.wait(k_ready.index(stage), phase)
                    k = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
                    _turn_wait(turns, turn, WG, PINGPONG)
                    s_tok = warpgroup_mma(q_a, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                    mbarrier.wait(v_ready.index(stage), phase)
                    v = v_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
                    dp_tok = warpgroup_mma(do_a, v.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                    _turn_pass(turns, WG, NUM_WG, PINGPONG)
                    turn += 1
                    s = warpgroup_mma_wait(1, deps=(s_tok,))
                    p = gl.exp2(s * qk_scale - lse2[:, None])
                    if j >= n_full:
                        p = gl.where(_causal_keep(offs_m, j * BLOCK_N + offs_n, N_K, IS_CAUSAL), p, 0.0)
                    dp = warpgroup_mma_wait(0, deps=(dp_tok,))
                    mbarrier.arrive(v_empty.index(stage), count=1)
                    ds = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), ds_layout)
                    # Waited for here, not overlapped with the next block's products: with three products in flight
                    # ptxas serialises every warpgroup MMA of the kernel (its C7512 "insufficient register resources").
                    dq = warpgroup_mma_wait(0, deps=(warpgroup_mma(ds, k, dq, is_async=True),))
                    mbarrier.arrive(k_empty.index(stage), count=1)
                    q_a, do_a = _renewed(q_a, N_K, REG_A), _renewed(do_a, N_K, REG_A)
                mbarrier.arrive(qdo_empty.index(WG), count=1)
                _store_tile(dq_desc, dq_smem.index(WG), z, h, row0, (dq * sm_scale).to(dtype), 0)
                c += n_blocks
                it += 1
        tma.store_wait(0)

    @gluon.jit
    def _flash_gluon_bwd_dq(q_desc, k_desc, v_desc, do_desc, dq_desc, OUT, stride_oz, stride_oh, stride_on, LSE, DELTA,
                   H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale,
                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WG: gl.constexpr, NUM_STAGES: gl.constexpr,
                   IS_CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, REG_A: gl.constexpr,
                   ITEMS: gl.constexpr, PINGPONG: gl.constexpr):
        """Over query tiles (as ``_flash_gluon_fwd``): dQ and D of each; queries and dO stationary, keys and
        values streamed."""
        BLOCK_T: gl.constexpr = NUM_WG * 64
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [NUM_WG] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [NUM_WG] + do_desc.block_type.shape, do_desc.layout)
        dq_smem = gl.allocate_shared_memory(dtype, [NUM_WG] + dq_desc.block_type.shape, dq_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
        qdo_ready, qdo_empty = _barriers(NUM_WG, 1), _barriers(NUM_WG, 1)
        k_ready, k_empty = _barriers(NUM_STAGES, 1), _barriers(NUM_STAGES, NUM_WG)
        v_ready, v_empty = _barriers(NUM_STAGES, 1), _barriers(NUM_STAGES, NUM_WG)
        turns = _turn_barriers(NUM_WG, qdo_ready, PINGPONG)
        if NUM_WG == 2:
            gl.warp_specialize([
                (_dq_consumer, (dq_desc, q_smem, do_smem, dq_smem, k_smem, v_smem, qdo_ready, qdo_empty, k_ready,
                                k_empty, v_ready, v_empty, turns, OUT, stride_oz, stride_oh, stride_on, LSE, DELTA, H,
                                N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T, BLOCK_N, HEAD_DIM, NUM_STAGES,
                                IS_CAUSAL, 0, REG_A, ITEMS, PINGPONG)),
                (_dq_consumer, (dq_desc, q_smem, do_smem, dq_smem, k_smem, v_smem, qdo_ready, qdo_empty, k_ready,
                                k_empty, v_ready, v_empty, turns, OUT, stride_oz, stride_oh, stride_on, LSE, DELTA, H,
                                N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T, BLOCK_N, HEAD_DIM, NUM_STAGES,
                                IS_CAUSAL, 1, REG_A, ITEMS, PINGPONG)),
                (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qdo_ready, qdo_empty,
                             k_ready, k_empty, v_ready, v_empty, H, N_Q, N_K, NUM_TILES, BLOCK_N, NUM_WG, NUM_STAGES,
                             IS_CAUSAL, 1, ITEMS)),
            ], [4, 1], [CONSUMER_REGS, 24])  # 24: _PRODUCER_REGS
        else:
            gl.warp_specialize([
                (_dq_consumer, (dq_desc, q_smem, do_smem, dq_smem, k_smem, v_smem, qdo_ready, qdo_empty, k_ready,
                                k_empty, v_ready, v_empty, turns, OUT, stride_oz, stride_oh, stride_on, LSE, DELTA, H,
                                N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T, BLOCK_N, HEAD_DIM, NUM_STAGES,
                                IS_CAUSAL, 0, REG_A, ITEMS, PINGPONG)),
                (_dq_consumer, (dq_desc, q_smem, do_smem, dq_smem, k_smem, v_smem, qdo_ready, qdo_empty, k_ready,
                                k_empty, v_ready, v_empty, turns, OUT, stride_oz, stride_oh, stride_on, LSE, DELTA, H,
                                N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T, BLOCK_N, HEAD_DIM, NUM_STAGES,
                                IS_CAUSAL, 1, REG_A, ITEMS, PINGPONG)),
                (_dq_consumer, (dq_desc, q_smem, do_smem, dq_smem, k_smem, v_smem, qdo_ready, qdo_empty, k_ready,
                                k_empty, v_ready, v_empty, turns, OUT, stride_oz, stride_oh, stride_on, LSE, DELTA, H,
                                N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T, BLOCK_N, HEAD_DIM, NUM_STAGES,
                                IS_CAUSAL, 2, REG_A, ITEMS, PINGPONG)),
                (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qdo_ready, qdo_empty,
                             k_ready, k_empty, v_ready, v_empty, H, N_Q, N_K, NUM_TILES, BLOCK_N, NUM_WG, NUM_STAGES,
                             IS_CAUSAL, 1, ITEMS)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])  # 24: _PRODUCER_REGS

    @gluon.jit
    def _dkdv_consumer(dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready, kv_empty,
                       q_ready, q_empty, do_ready, do_empty, ds_smem, part_smem, part_ready, turns,
                       LSE, DELTA, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale,
                       BLOCK_T: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                       NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, WG: gl.constexpr, REG_A: gl.constexpr,
                       FUSED: gl.constexpr, ITEMS: gl.constexpr, PINGPONG: gl.constexpr = False,
                       lse_smem=None, delta_smem=None, SMEM_STATS: gl.constexpr = False,
                       acc_desc=None, NUM_SLOTS: gl.constexpr = 2, OUT_IN_SLOTS: gl.constexpr = False):
        """One warpgroup: dK, dV of key rows [start + 64 WG, start + 64 (WG + 1)) of each tile, on transposed
        (keys x queries) score tiles. FUSED (``fused_bwd._flash_fused_bwd_atomic``): also this warpgroup's half of
        each query block's dQ columns over both consumers' keys (the two dS^T tiles through ``ds_smem``, double
        buffered, ``part_ready`` the two blocks' barriers), added into the sums of ``acc_desc`` by TMA reductions
        from ``part_smem``'s NUM_SLOTS slots of this warpgroup, and with OUT_IN_SLOTS dK and dV leaving through those
        slots (``ds_smem``, ``part_*``: unused without FUSED). With PINGPONG the consumers issue each block's score
        products in turns (``_turn_wait``).

        Each query block's L and D: with SMEM_STATS from the ring's ``lse_smem`` and ``delta_smem`` (the producer copies
        them with the block's queries; queries past N_Q read as L = D = 0 there, harmless beside their zero Q and
        dO rows), each read just before its use; otherwise loaded from ``LSE`` and ``DELTA`` at the block's start,
        queries past N_Q reading as L = inf (P = 0)."""
        NUM_WG: gl.constexpr = BLOCK_T // 64
        st_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
        acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=st_layout, k_width=2)
        cols: gl.constexpr = gl.SliceLayout(0, st_layout)
        dtype: gl.constexpr = k_smem.dtype
        k = k_smem.index(WG).reshape([64, HEAD_DIM])
        v = v_smem.index(WG).reshape([64, HEAD_DIM])
        zero_st = gl.zeros([64, BLOCK_M], gl.float32, st_layout)

        if FUSED:
            DQ_COLS: gl.constexpr = acc_desc.block_type.shape[3]
            dq_layout: gl.constexpr = _wgmma_layout(DQ_COLS)
            zero_dq = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
            part = 0  # partial dQ tiles handed over so far: the part ring's position

        c = 0
        it = 0
        turn = 0
        lo, hi, step = _items(NUM_TILES, N_K, BLOCK_T, ITEMS)
        for item in range(lo, hi, step):
            tile, valid = _item_tile(item, N_K, NUM_TILES, BLOCK_T, ITEMS)
            if valid:
                bh, z, h, start = _tile_coords(tile, N_K, H, BLOCK_T, False)
                first, end, boundary = _streamed(start, N_Q, N_K, BLOCK_T, BLOCK_M, IS_CAUSAL, 2)
                row0 = start + WG * 64
                offs_k = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, st_layout))
                offs_i = gl.arange(0, BLOCK_M, layout=cols)
                if not SMEM_STATS:
                    lse_base = LSE + bh.to(gl.int64) * N_Q
                    delta_base = DELTA + bh.to(gl.int64) * N_Q

                mbarrier.wait(kv_ready.index(WG), it & 1)
                k_a, v_a = _first_operand(k, a_layout, REG_A), _first_operand(v, a_layout, REG_A)
                dk = gl.zeros([64, HEAD_DIM], gl.float32, acc_layout)
                dv = gl.zeros([64, HEAD_DIM], gl.float32, acc_layout)
                for i in range(first, end):
                    n = c + i - first
                    stage = n % NUM_STAGES
                    phase = (n // NUM_STAGES) & 1
                    offs_q = i * BLOCK_M + offs_i
                    if not SMEM_STATS:
                        q_ok = offs_q < N_Q
                        lse2 = gl.load(lse_base + offs_q, mask=q_ok, other=float("inf")) * 1.4426950408889634
                        delta = gl.load(delta_base + offs_q, mask=q_ok, other=0.0)
                    mbarrier.wait(q_ready.index(stage), phase)
                    if SMEM_STATS:
                        lse2 = lse_smem.index(stage).reshape([BLOCK_M]).load(cols) * 1.4426950408889634
                    qs = q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
                    _turn_wait(turns, turn, WG, PINGPONG)
                    st_tok = warpgroup_mma(k_a, qs.permute((1, 0)), zero_st, use_acc=False, is_async=True)
                    mbarrier.wait(do_ready.index(stage), phase)
                    dos = do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
                    dpt_tok = warpgroup_mma(v_a, dos.permute((1, 0)), zero_st, use_acc=False, is_async=True)
                    _turn_pass(turns, WG, NUM_WG, PINGPONG)
                    turn += 1
                    st = warpgroup_mma_wait(1, deps=(st_tok,))
                    pt = gl.exp2(st * qk_scale - lse2[None, :])
                    if i < boundary:
                        # The diagonal: query i sees key j only when i >= j (keys past N_K are never stored).
                        pt = gl.where(offs_q[None, :] >= offs_k[:, None], pt, 0.0)
                    dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), dos, dv, is_async=True)
                    dpt = warpgroup_mma_wait(1, deps=(dpt_tok,))
                    if SMEM_STATS:
                        delta = delta_smem.index(stage).reshape([BLOCK_M]).load(cols)
                    dst = (pt * (dpt - delta[None, :])).to(dtype)
                    dk = warpgroup_mma(gl.convert_layout(dst, op_layout), qs, dk, is_async=True)
                    if FUSED:
                        # dQ's columns split between the two consumers: this one's DQ_COLS columns of the query
                        # block's dQ over both consumers' keys. Both dS^T tiles go through shared memory (double
                        # buffered by block, a barrier per block that both consumers arrive on) and are read
                        # transposed against the matching columns of both K tiles; the product is added into the
                        # fp32 sums by a TMA reduction from the next of this warpgroup's NUM_SLOTS slots, refilled
                        # once the reduction that read it last has (at most NUM_SLOTS - 1 later ones in flight).
                        # Against a per-consumer share of all d columns: half the bytes reduced, and at head dim 128
                        # one reduction per block instead of two.
                        buf = NUM_WG * (n % 2)
                        ds_smem.index(buf + WG).store(dst)
                        fence_async_shared()
                        mbarrier.arrive(part_ready.index(n % 2), count=1)
                        mbarrier.wait(part_ready.index(n % 2), (n // 2) & 1)
                        k0 = k_smem.index(0).reshape([64, HEAD_DIM]).slice(WG * DQ_COLS, DQ_COLS, dim=1)
                        k1 = k_smem.index(1).reshape([64, HEAD_DIM]).slice(WG * DQ_COLS, DQ_COLS, dim=1)
                        dq_tok = warpgroup_mma(ds_smem.index(buf).permute((1, 0)), k0, zero_dq, use_acc=False,
                                               is_async=True)
                        dq_tok = warpgroup_mma(ds_smem.index(buf + 1).permute((1, 0)), k1, dq_tok, is_async=True)
                        dk, dv, dq = warpgroup_mma_wait(0, deps=(dk, dv, dq_tok))
                        mbarrier.arrive(q_empty.index(stage), count=1)
                        mbarrier.arrive(do_empty.index(stage), count=1)
                        slot = part_smem.index(NUM_SLOTS * WG + part % NUM_SLOTS)
                        tma.store_wait(NUM_SLOTS - 1)
                        slot.reshape([BLOCK_M, DQ_COLS]).store(dq)
                        fence_async_shared()
                        _tma_reduce_add(acc_desc, [z, h, i * BLOCK_M, WG * DQ_COLS], slot)
                        part += 1
                    else:
                        # Both gradient products finish within the block (see _dq_consumer: overlapped with the next
                        # block's products, ptxas serialises them all).
                        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
                        mbarrier.arrive(q_empty.index(stage), count=1)
                        mbarrier.arrive(do_empty.index(stage), count=1)
                    k_a, v_a = _renewed(k_a, N_K, REG_A), _renewed(v_a, N_K, REG_A)
                n_blocks = end - first
                if FUSED:
                    # Both consumers read both K tiles (the dQ product): each tile is free once both are done.
                    for w in gl.static_range(NUM_WG):
                        mbarrier.arrive(kv_empty.index(w), count=1)
                else:
                    mbarrier.arrive(kv_empty.index(WG), count=1)
                # Stores go out dV, dK, dV, dK, ...: each buffer's previous store is the one before the last.
                if OUT_IN_SLOTS:
                    # dV and dK through this warpgroup's two sum slots (16 KiB each, a 64 x 128 tile of 16-bit values),
                    # once every reduction has read them (``_store_tile`` waits for all).
                    gl.static_assert(NUM_SLOTS == 2, "dV and dK leave through the two slots")
                    dv_buf = _smem_view(part_smem.index(NUM_SLOTS * WG), dtype, dv_desc.block_type.shape,
                                        dv_desc.layout)
                    dk_buf = _smem_view(part_smem.index(NUM_SLOTS * WG + 1), dtype, dk_desc.block_type.shape,
                                        dk_desc.layout)
                    _store_tile(dv_desc, dv_buf, z, h, row0, dv.to(dtype), 0)
                    _store_tile(dk_desc, dk_buf, z, h, row0, (dk * sm_scale).to(dtype), 1)
                    # The next reduction must refill slot 0 (dV's store, before the last in flight), not slot 1
                    # (dK's, the last): one reduction per block leaves ``part`` odd after an odd number of blocks.
                    part += part % 2
                else:
                    _store_tile(dv_desc, dv_smem.index(WG), z, h, row0, dv.to(dtype), 1)
                    _store_tile(dk_desc, dk_smem.index(WG), z, h, row0, (dk * sm_scale).to(dtype), 1)
                c += n_blocks
                it += 1
        tma.store_wait(0)

    @gluon.jit
    def _dkdv_buffers(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, NUM_WG: gl.constexpr,
                      NUM_STAGES: gl.constexpr, OUTPUTS: gl.constexpr = True, KV_READERS: gl.constexpr = 1):
        """The dK/dV kernels' shared memory and barriers: K, V and (OUTPUTS) the dK, dV output tiles (one 64-row
        tile per consumer; without OUTPUTS the K and V tiles stand in, unused), the Q and dO rings; the stationary
        tiles' ready/empty barriers and the rings'."""
        dtype: gl.constexpr = q_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, [NUM_WG] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_WG] + v_desc.block_type.shape, v_desc.layout)
        if OUTPUTS:
            dk_smem = gl.allocate_shared_memory(dtype, [NUM_WG] + dk_desc.block_type.shape, dk_desc.layout)
            dv_smem = gl.allocate_shared_memory(dtype, [NUM_WG] + dv_desc.block_type.shape, dv_desc.layout)
        else:
            dk_smem, dv_smem = k_smem, v_smem
        q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
        kv_ready, kv_empty = _barriers(NUM_WG, 1), _barriers(NUM_WG, KV_READERS)
        q_ready, q_empty = _barriers(NUM_STAGES, 1), _barriers(NUM_STAGES, NUM_WG)
        do_ready, do_empty = _barriers(NUM_STAGES, 1), _barriers(NUM_STAGES, NUM_WG)
        return (k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready, kv_empty, q_ready, q_empty, do_ready,
                do_empty)

    @gluon.jit
    def _stats_buffers(lse_desc, delta_desc, unused, NUM_STAGES: gl.constexpr, SMEM_STATS: gl.constexpr):
        """With SMEM_STATS, the ring's buffers of the streamed queries' L and D (``lse_desc``, ``delta_desc``:
        descriptors of (Z * H, N_Q) fp32 tensors moving (1, BLOCK_M) boxes); otherwise ``unused`` twice."""
        if SMEM_STATS:
            lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + lse_desc.block_type.shape,
                                                 lse_desc.layout)
            delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + delta_desc.block_type.shape,
                                                   delta_desc.layout)
        else:
            lse_smem, delta_smem = unused, unused
        return lse_smem, delta_smem

    @gluon.jit
    def _flash_gluon_bwd_dkdv(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc,
                     H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, NUM_WG: gl.constexpr, NUM_STAGES: gl.constexpr,
                     IS_CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, REG_A: gl.constexpr,
                     ITEMS: gl.constexpr, PINGPONG: gl.constexpr, SMEM_STATS: gl.constexpr):
        """Over key tiles (the first, longest causal ones first): dK and dV of each; keys and values
        stationary, queries and dO streamed. Reads D, which the dQ kernel writes, so it runs after that kernel.
        With SMEM_STATS, L and D of each query block come into shared memory with its queries (``lse_desc``,
        ``delta_desc``: descriptors of (Z * H, N_Q) fp32 tensors moving (1, BLOCK_M) boxes); without, they are the
        tensors themselves and the consumers load them."""
        BLOCK_T: gl.constexpr = NUM_WG * 64
        (k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready, kv_empty, q_ready, q_empty, do_ready,
         do_empty) = _dkdv_buffers(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, NUM_WG, NUM_STAGES)
        lse_smem, delta_smem = _stats_buffers(lse_desc, delta_desc, k_smem, NUM_STAGES, SMEM_STATS)
        turns = _turn_barriers(NUM_WG, kv_ready, PINGPONG)
        if NUM_WG == 2:
            gl.warp_specialize([
                (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready,
                                  kv_empty, q_ready, q_empty, do_ready, do_empty, k_smem, k_smem, kv_ready,
                                  turns, lse_desc, delta_desc, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                                  BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 0, REG_A, False, ITEMS, PINGPONG,
                                  lse_smem, delta_smem, SMEM_STATS)),
                (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready,
                                  kv_empty, q_ready, q_empty, do_ready, do_empty, k_smem, k_smem, kv_ready,
                                  turns, lse_desc, delta_desc, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                                  BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 1, REG_A, False, ITEMS, PINGPONG,
                                  lse_smem, delta_smem, SMEM_STATS)),
                (_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty,
                             q_ready, q_empty, do_ready, do_empty, H, N_Q, N_K, NUM_TILES, BLOCK_M, NUM_WG, NUM_STAGES,
                             IS_CAUSAL, 2, ITEMS, lse_desc, delta_desc, lse_smem, delta_smem, SMEM_STATS)),
            ], [4, 1], [CONSUMER_REGS, 24])  # 24: _PRODUCER_REGS
        else:
            gl.warp_specialize([
                (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready,
                                  kv_empty, q_ready, q_empty, do_ready, do_empty, k_smem, k_smem, kv_ready,
                                  turns, lse_desc, delta_desc, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                                  BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 0, REG_A, False, ITEMS, PINGPONG,
                                  lse_smem, delta_smem, SMEM_STATS)),
                (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready,
                                  kv_empty, q_ready, q_empty, do_ready, do_empty, k_smem, k_smem, kv_ready,
                                  turns, lse_desc, delta_desc, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                                  BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 1, REG_A, False, ITEMS, PINGPONG,
                                  lse_smem, delta_smem, SMEM_STATS)),
                (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready,
                                  kv_empty, q_ready, q_empty, do_ready, do_empty, k_smem, k_smem, kv_ready,
                                  turns, lse_desc, delta_desc, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                                  BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 2, REG_A, False, ITEMS, PINGPONG,
                                  lse_smem, delta_smem, SMEM_STATS)),
                (_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty,
                             q_ready, q_empty, do_ready, do_empty, H, N_Q, N_K, NUM_TILES, BLOCK_M, NUM_WG, NUM_STAGES,
                             IS_CAUSAL, 2, ITEMS, lse_desc, delta_desc, lse_smem, delta_smem, SMEM_STATS)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])  # 24: _PRODUCER_REGS



def dq_args(q4, k4, v4, o4, do4, dq4, lse, delta, is_causal: bool, cfg: Config | None = None,
            programs: int | None = None) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, keyword arguments) of one launch of the dQ kernel (which also writes D)."""
    z, h, n_q, d = q4.shape
    cfg = cfg or config(DQ, d, k4.shape[2], override=current().gluon_config("dq"))
    grid, tiles, options = _launch_shape(n_q, z, h, cfg, programs, q4.device)
    args = (descriptor(q4, WG_ROWS), descriptor(k4, cfg.block), descriptor(v4, cfg.block), descriptor(do4, WG_ROWS),
            descriptor(dq4, WG_ROWS), o4, o4.stride(0), o4.stride(1), o4.stride(2), lse, delta,
            h, n_q, k4.shape[2], tiles, d**-0.5 * _LOG2E, d**-0.5)
    return grid, args, dict(HEAD_DIM=d, BLOCK_N=cfg.block, IS_CAUSAL=bool(is_causal), **options)


def dkdv_args(q4, k4, v4, do4, dk4, dv4, lse, delta, is_causal: bool, cfg: Config | None = None,
              programs: int | None = None) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, keyword arguments) of one launch of the dK/dV kernel: L and D of each query
    block copied into shared memory with its queries where TMA can copy them (``_rows_aligned``), otherwise loaded by
    the consumers (with ``config``'s configuration for that)."""
    z, h, n_k, d = k4.shape
    n_q = q4.shape[2]
    rows = _rows_aligned(n_q, lse, delta)
    cfg = cfg or config(DKDV, d, n_k, loads=not rows, override=current().gluon_config("dkdv"))
    grid, tiles, options = _launch_shape(n_k, z, h, cfg, programs, k4.device)
    if rows:
        lse, delta = _rows_descriptor(lse, z * h, n_q, cfg.block), _rows_descriptor(delta, z * h, n_q, cfg.block)
    args = (descriptor(q4, cfg.block), descriptor(k4, WG_ROWS), descriptor(v4, WG_ROWS), descriptor(do4, cfg.block),
            descriptor(dk4, WG_ROWS), descriptor(dv4, WG_ROWS), lse, delta,
            h, n_q, n_k, tiles, d**-0.5 * _LOG2E, d**-0.5)
    return grid, args, dict(HEAD_DIM=d, BLOCK_M=cfg.block, IS_CAUSAL=bool(is_causal), SMEM_STATS=rows, **options)


def dq(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, do4: torch.Tensor, dq4: torch.Tensor,
       lse: torch.Tensor, delta: torch.Tensor, is_causal: bool, cfg: Config | None = None) -> None:
    """dQ into ``dq4`` and D into ``delta`` for views that ``usable(..., kernel=DQ)`` accepted."""
    bind_context(q4.device)
    grid, args, kwargs = dq_args(q4, k4, v4, o4, do4, dq4, lse, delta, is_causal, cfg)
    launch_compiled(_flash_gluon_bwd_dq, grid, args, kwargs)


def dkdv(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, do4: torch.Tensor, dk4: torch.Tensor,
         dv4: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, is_causal: bool, cfg: Config | None = None) -> None:
    """dK and dV into ``dk4``, ``dv4`` for views that ``usable(..., kernel=DKDV)`` accepted; reads the D that a dQ
    kernel (this module's or the tl one) wrote into ``delta``."""
    bind_context(q4.device)
    grid, args, kwargs = dkdv_args(q4, k4, v4, do4, dk4, dv4, lse, delta, is_causal, cfg)
    launch_compiled(_flash_gluon_bwd_dkdv, grid, args, kwargs)


__all__ = ["KERNEL_NAMES", "dkdv", "dkdv_args", "dq", "dq_args"]
