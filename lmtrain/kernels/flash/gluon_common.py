"""Shared parts of the Gluon FlashAttention kernels for Hopper (sm_90): imports, the producer warp, tile
scheduling, barriers and the host-side descriptors and launch shapes. The kernels live in ``gluon_fwd``
(forward), ``gluon_bwd`` (dQ, dK/dV) and ``fused_bwd`` (the fused backward with TMA reductions).

Same algorithm, outputs and properties as the pointer kernels (online softmax in the log2 domain with the scale
folded into one multiply-add before ``exp2``; O in the input dtype and the natural-log logsumexp L in fp32; a dQ
kernel that also writes ``D = rowsum(O * dO)``, then a dK/dV kernel, no atomics; causal masks top-left aligned;
any N_q and N_k; strided inputs), for fp16/bf16 inputs with head dims 64 and 128. What differs is the schedule,
which plain ``tl`` code does not let one write:

* **Warp specialisation.** A program runs ``NUM_WG`` consumer warpgroups of 4 warps, each owning 64 rows of the
  program's *stationary* tile (queries in the forward and dQ kernels, keys in the dK/dV kernel), and one producer
  warp that only issues TMA copies: the stationary tiles, then the *streamed* blocks (keys and values; queries and
  output gradients for dK/dV) into a ring of ``NUM_STAGES`` shared-memory buffers, each guarded by a "ready" barrier
  (the copy's bytes arrived) and an "empty" barrier (every consumer is done with it). Registers move from the
  producer to the consumers (``setmaxnreg``), so a consumer keeps its fp32 accumulators and score tiles in registers.
* **Overlap inside a warpgroup.** Matrix products are issued asynchronously and waited for only when their result is
  needed. (Letting the backward's gradient products run on into the next block's products put three or four products
  in flight, and ptxas then serialised every warpgroup MMA of the kernel, its C7512 "insufficient register
  resources". The CPU tests check the machine code for that.) P and dS stay in registers as the first operand of the
  products that need them; with ``reg_a`` the stationary rows do too (``tuning.Config``).
* **Tiles and programs** (``Config.schedule``). Schedule 0: one program per tile. Schedule 1: one program per *pair*
  of a head's tiles, its j-th longest and j-th shortest causal tile, so every program has the same work. Schedule 2:
  persistent pairs, ``per_sm`` programs per multiprocessor each taking pairs p, p + grid, .... Where the persistent
  programs' rounds would be less than 95% full on average (few pairs), the launcher takes one program per tile
  instead (``_persistent_programs``), and with few heads hands the tiles out position by position, every head's
  longest first (``_few_heads``).
* **Turns** (``Config.pingpong``, off in every default: it measured within noise). The consumers may issue each
  block's products in turns, passed round-robin through one mbarrier each.
* **Masks only where needed.** Blocks wholly visible to every row of the tile run without mask arithmetic; the causal
  diagonal and the ragged key tail are masked. Rows past N read as zeros (TMA) and are not written.

Tiles move through host-side TMA descriptors over the whole (Z, H, N, d) tensors, with (1, 1, rows, d) boxes, so
strided views (heads of a fused qkv projection) are read in place. Gluon kernels do not run under Triton's
interpreter: the CPU tests compile them for sm_90a (no GPU needed) and check their machine code, and the GPU tests
compare them with a float64 reference. Which calls they serve is the dispatcher's decision
(``lmtrain.kernels.flash.dispatch``).
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading

import torch
import triton

try:  # Gluon with Hopper's warpgroup MMA and TMA: Triton 3.5 and later
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # The TMA copies' names: async_copy_global_to_shared / async_copy_shared_to_global until Triton 3.6,
    # async_load / async_store after.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # A barrier of the calling partition's warps: thread_barrier until Triton 3.6, barrier after.
    _partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """``global[coord box] += src`` (a shared-memory tile) by the tensor memory accelerator: the reduction
        happens in L2, asynchronously, like a TMA store (``tma.store_wait`` counts it among the stores in flight).
        Gluon's Hopper module has the store but not the reduction; the op it builds is Triton's own (TTGIR
        ``async_tma_reduce``, what ``tl``'s ``descriptor.atomic_add`` lowers to)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    @_builtin
    def _smem_view(smem, dtype, shape, layout, _semantic=None):
        """``smem``'s bytes viewed as another dtype, shape and layout: ``_reinterpret`` until Triton 3.6,
        ``reinterpret`` after."""
        view = getattr(smem, "reinterpret", None) or smem._reinterpret
        return view(dtype, shape, layout, _semantic=_semantic)
    _HAS_GLUON = True
except ImportError:  # pragma: no cover - older Triton: the tl kernels serve every call
    _HAS_GLUON = False

from lmtrain.kernels.flash.dispatch import tma_strides
from lmtrain.kernels.flash.launch_plans import unchecked
from lmtrain.kernels.flash.tuning import _FULL_ROUNDS, _HEADS_PER_ROUND, Config

_BOUND = threading.local()


def bind_context(device: torch.device) -> None:
    """Make the device's primary CUDA context current in this thread, once per thread.

    The host descriptors are encoded (``cuTensorMapEncodeTiled``) before the launch, and that needs a current
    context; autograd runs the backward pass in its own threads, where none may be current yet (a kernel launch
    would bind one, but only after the encoding has failed). Done through the driver, which is legal at any time,
    also while a CUDA graph is being captured.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    if getattr(_BOUND, "index", None) == index:
        return
    cuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and not ctx.value:
        dev = ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(dev), index) != 0 or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) \
                or cuda.cuCtxSetCurrent(ctx):
            raise RuntimeError(f"flash_attention: could not make the CUDA context of device {index} current")
    _BOUND.index = index



if _HAS_GLUON:

    # -----------------------------------------------------------------------------------------
    # Tiles, streamed ranges, the producer
    # -----------------------------------------------------------------------------------------

    @gluon.constexpr_function
    def _wgmma_layout(n):
        """The register layout of one warpgroup's (64 x n) fp32 MMA accumulator."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])

    @gluon.jit
    def _tile_coords(tile, N, H, BLOCK_T: gl.constexpr, REVERSE: gl.constexpr):
        """(batch x head index, batch, head, first stationary row) of tile ``tile``, tiles numbered head by head;
        REVERSE takes a head's tiles last to first (causal query tiles: the longest first, the short ones fill the
        tail)."""
        num = gl.cdiv(N, BLOCK_T)
        bh = tile // num
        blk = tile % num
        if REVERSE:
            blk = num - 1 - blk
        return bh, bh // H, bh % H, blk * BLOCK_T

    @gluon.jit
    def _items(NUM_TILES, N, BLOCK_T: gl.constexpr, ITEMS: gl.constexpr):
        """(start, end, step) of this program's work items: items p, p + grid, ... of the NUM_TILES (cdiv(N, BLOCK_T)
        per head; ITEMS 0 or 2), or with ITEMS 1 items 0, 1, ...: both tiles of each pair p, p + grid, ...
        (``_item_tile``)."""
        pid = gl.program_id(0)
        if ITEMS == 1:
            num = gl.cdiv(N, BLOCK_T)
            pairs = NUM_TILES // num * ((num + 1) // 2)
            return pid * 0, 2 * gl.cdiv(pairs - pid, gl.num_programs(0)), 1
        return pid, NUM_TILES, gl.num_programs(0)

    @gluon.jit
    def _item_tile(item, N, NUM_TILES, BLOCK_T: gl.constexpr, ITEMS: gl.constexpr):
        """(tile, whether to do it) of work item ``item`` (``_items``), tiles numbered head by head as ``_tile_of``
        takes them (a head's longest causal tile at position 0). ITEMS 1: pair j of a head is its tiles at positions
        j and num - 1 - j: the j-th longest and the j-th shortest, together as long as any other pair (the middle
        tile of an odd count pairs with itself and is done once). ITEMS 2: single tiles position by position (every
        head's tile at position 0, then at position 1, ...), so that programs launched in order take the longest
        causal tiles of all heads first. ITEMS 0: single tiles head by head, the item is the tile."""
        if ITEMS == 1:
            num = gl.cdiv(N, BLOCK_T)
            per_head = (num + 1) // 2
            pair = gl.program_id(0) + (item // 2) * gl.num_programs(0)
            j = pair % per_head
            second = item % 2
            pos = j + second * (num - 1 - 2 * j)
            return pair // per_head * num + pos, (second == 0) | (2 * j + 1 != num)
        if ITEMS == 2:
            num = gl.cdiv(N, BLOCK_T)
            heads = NUM_TILES // num
            return item % heads * num + item // heads, True
        return item, True

    @gluon.jit
    def _fast_div(x, d, MUL, SHIFT):
        """x // d for 0 <= x < 2^31 and a divisor d >= 1 the same for the whole launch, by a multiply-high and a
        shift: (``MUL``, ``SHIFT``) is ``fast_divisor(d)`` (computed on the host; the multiplier's 32 bits passed as
        a signed int32, so that both come from the kernel's constant bank rather than from registers decoded once and
        held through the loops). A division by a value the compiler does not know is some 20 dependent instructions
        around a reciprocal; the tile loop of the forward consumers did three of them in a row between two tiles."""
        # to_tensor: Triton passes an integer argument equal to 1 as a constant
        mul = gl.to_tensor(MUL).to(gl.uint32, bitcast=True)
        q = gl.umulhi(x.to(gl.uint32), mul) >> gl.to_tensor(SHIFT).to(gl.uint32)
        return gl.where(d == 1, x, q.to(gl.int32))

    @gluon.jit
    def _pair_tile(item, N, BLOCK_T: gl.constexpr, REVERSE: gl.constexpr, PAIR_MUL, PAIR_SHIFT):
        """``_item_tile`` (ITEMS 1) and ``_tile_coords`` of work item ``item`` in one, less the batch and head: (whether
        to do it, batch x head index, first stationary row), dividing by the pairs per head with ``_fast_div``
        (``PAIR_MUL``, ``PAIR_SHIFT``) and without the division by the tiles per head that the two steps take one after
        the other (the pair gives the head and the position directly). ``_batch_head`` gives the batch and head where
        they are needed: computed here, they would stay in registers through the tile (spills with Triton 3.9)."""
        num = gl.cdiv(N, BLOCK_T)
        per_head = (num + 1) // 2
        pair = gl.program_id(0) + (item // 2) * gl.num_programs(0)
        bh = _fast_div(pair, per_head, PAIR_MUL, PAIR_SHIFT)
        j = pair - bh * per_head
        second = item % 2
        blk = j + second * (num - 1 - 2 * j)
        if REVERSE:
            blk = num - 1 - blk
        return (second == 0) | (2 * j + 1 != num), bh, blk * BLOCK_T

    @gluon.jit
    def _batch_head(bh, H, HEAD_MUL, HEAD_SHIFT):
        """(batch, head) of batch x head index ``bh`` (``HEAD_MUL``, ``HEAD_SHIFT``: ``fast_divisor(H)``)."""
        z = _fast_div(bh, H, HEAD_MUL, HEAD_SHIFT)
        return z, bh - z * H

    @gluon.jit
    def _tile_of(tile, N_Q, N_K, H, BLOCK_T: gl.constexpr, IS_CAUSAL: gl.constexpr, MODE: gl.constexpr):
        if MODE == 2:
            return _tile_coords(tile, N_K, H, BLOCK_T, False)  # key tiles: the first (longest causal) first
        return _tile_coords(tile, N_Q, H, BLOCK_T, IS_CAUSAL)

    @gluon.jit
    def _streamed(start, N_Q, N_K, BLOCK_T: gl.constexpr, BLOCK_S: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  MODE: gl.constexpr):
        """(first, end, boundary) streamed block indices of the tile whose stationary rows start at ``start``.

        Forward and dQ (keys streamed): blocks [first, boundary) are wholly visible to every query of the tile, the
        rest need the causal or key-range mask. dK/dV (queries streamed): blocks [first, boundary) cross the causal
        diagonal and need the mask, the rest do not (queries past N_Q read as zero rows and get P = 0 from their
        infinite logsumexp, so the ragged tail needs none).
        """
        if MODE >= 2:
            if IS_CAUSAL:
                first = start // BLOCK_S  # queries before ``start`` see none of these keys
                boundary = gl.cdiv(start + BLOCK_T - 1, BLOCK_S)
            else:
                first = start * 0
                boundary = first
            return first, gl.cdiv(N_Q, BLOCK_S), boundary
        if IS_CAUSAL:
            end = gl.cdiv(gl.minimum(start + BLOCK_T, N_K), BLOCK_S)
            boundary = gl.minimum(start + 1, N_K) // BLOCK_S
        else:
            end = gl.cdiv(N_K, BLOCK_S)
            boundary = N_K // BLOCK_S
        return start * 0, end, boundary

    @gluon.jit
    def _producer(stat_a, stat_b, strm_a, strm_b, stat_a_smem, stat_b_smem, strm_a_smem, strm_b_smem,
                  stat_ready, stat_empty, a_ready, a_empty, b_ready, b_empty, H, N_Q, N_K, NUM_TILES,
                  BLOCK_S: gl.constexpr, NUM_WG: gl.constexpr, NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  MODE: gl.constexpr, ITEMS: gl.constexpr, rows_a=None, rows_b=None, rows_a_smem=None,
                  rows_b_smem=None, SMEM_STATS: gl.constexpr = False):
        """One warp: for each tile of this program, its stationary tiles (once the consumers are done with the
        previous ones; ``stat_b`` unused in the forward), then every streamed block of ``strm_a`` and ``strm_b``
        through the ring. Runs ahead of the consumers, across tiles too. SMEM_STATS (dK/dV): with each ``strm_a`` block
        also the streamed rows' fp32 statistics (``rows_a``, ``rows_b``: descriptors of (Z * H, N_Q) tensors moving
        (1, BLOCK_S) boxes) into ``rows_a_smem``, ``rows_b_smem``, on the same barrier."""
        BLOCK_T: gl.constexpr = NUM_WG * 64
        c = 0  # streamed blocks issued so far: the ring position
        it = 0  # tiles issued so far: the stationary barriers' phase
        lo, hi, step = _items(NUM_TILES, N_K if MODE >= 2 else N_Q, BLOCK_T, ITEMS)
        for item in range(lo, hi, step):
            tile, valid = _item_tile(item, N_K if MODE >= 2 else N_Q, NUM_TILES, BLOCK_T, ITEMS)
            if valid:
                bh, z, h, start = _tile_of(tile, N_Q, N_K, H, BLOCK_T, IS_CAUSAL, MODE)
                for w in gl.static_range(NUM_WG):
                    # A fresh barrier counts as having completed the phase before phase 0: the first round does not
                    # wait.
                    mbarrier.wait(stat_empty.index(w), (it & 1) ^ 1)
                    if MODE == 0:
                        mbarrier.expect(stat_ready.index(w), stat_a.block_type.nbytes)
                    else:
                        mbarrier.expect(stat_ready.index(w), stat_a.block_type.nbytes + stat_b.block_type.nbytes)
                        _tma_load(stat_b, [z, h, start + w * 64, 0], stat_ready.index(w), stat_b_smem.index(w))
                    _tma_load(stat_a, [z, h, start + w * 64, 0], stat_ready.index(w), stat_a_smem.index(w))
                first, end, boundary = _streamed(start, N_Q, N_K, BLOCK_T, BLOCK_S, IS_CAUSAL, MODE)
                for j in range(first, end):
                    s = c % NUM_STAGES
                    phase = (c // NUM_STAGES) & 1
                    mbarrier.wait(a_empty.index(s), phase ^ 1)
                    if SMEM_STATS:
                        mbarrier.expect(a_ready.index(s), strm_a.block_type.nbytes + 2 * rows_a.block_type.nbytes)
                        _tma_load(rows_a, [bh, j * BLOCK_S], a_ready.index(s), rows_a_smem.index(s))
                        _tma_load(rows_b, [bh, j * BLOCK_S], a_ready.index(s), rows_b_smem.index(s))
                    else:
                        mbarrier.expect(a_ready.index(s), strm_a.block_type.nbytes)
                    _tma_load(strm_a, [z, h, j * BLOCK_S, 0], a_ready.index(s), strm_a_smem.index(s))
                    mbarrier.wait(b_empty.index(s), phase ^ 1)
                    mbarrier.expect(b_ready.index(s), strm_b.block_type.nbytes)
                    _tma_load(strm_b, [z, h, j * BLOCK_S, 0], b_ready.index(s), strm_b_smem.index(s))
                    c += 1
                it += 1

    @gluon.jit
    def _barriers(N: gl.constexpr, COUNT: gl.constexpr):
        """N mbarriers in shared memory, each completing a phase after COUNT arrivals."""
        bars = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(N):
            mbarrier.init(bars.index(i), count=COUNT)
        return bars

    @gluon.jit
    def _store_tile(desc, smem, z, h, row, x, PENDING: gl.constexpr):
        """``x`` (64 x d) to rows [row, row + 64) of (batch z, head h) through the tile buffer ``smem``, once this
        buffer's previous store has left it: that is, with at most PENDING later stores still in flight."""
        tma.store_wait(PENDING)
        smem.reshape([x.shape[0], x.shape[1]]).store(x)
        fence_async_shared()
        _tma_store(desc, [z, h, row, 0], smem)

    @gluon.jit
    def _first_operand(x, layout: gl.constexpr, REG_A: gl.constexpr):
        """The first operand of a consumer's product of its stationary tile ``x`` (shared memory): with REG_A ``x``
        loaded into registers of ``layout``, else ``x`` itself."""
        if REG_A:
            x = x.load(layout)
        return x

    @gluon.jit
    def _renewed(a, n, REG_A: gl.constexpr):
        """With REG_A: the register operand ``a`` (16-bit values) XOR a zero the compiler cannot prove to be zero
        (from ``n``, a count, never negative), the same bits in newly defined registers. Done once per streamed
        block: without it ptxas (12.8, 12.9) gives those registers to P (P^T, dS^T) inside the loop, where the
        next block still reads them. Without REG_A: ``a``, a shared-memory tile."""
        if REG_A:
            a = (a.to(gl.int16, bitcast=True) ^ (n >> 31).to(gl.int16)).to(a.dtype, bitcast=True)
        return a

    @gluon.jit
    def _causal_keep(offs_q, offs_k, N_K, IS_CAUSAL: gl.constexpr):
        """(queries x keys) mask of the scores that exist: key in range and, if causal, not after the query."""
        keep = offs_k[None, :] < N_K
        if IS_CAUSAL:
            keep = keep & (offs_q[:, None] >= offs_k[None, :])
        return keep

    @gluon.jit
    def _turn_barriers(NUM_WG: gl.constexpr, unused, PINGPONG: gl.constexpr):
        """The consumers' turn barriers (PINGPONG), one per consumer; without PINGPONG none is allocated and
        ``unused`` (any barriers) stands in for them."""
        if PINGPONG:
            turns = _barriers(NUM_WG, 1)
        else:
            turns = unused
        return turns

    @gluon.jit
    def _turn_wait(turns, k, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """With PINGPONG: wait until it is this consumer's ``k``-th turn to issue its products. The consumers take
        turns round-robin, consumer 0 first (a fresh barrier counts as having completed the phase before phase 0,
        so its first wait passes), each after the one before passed it the turn (``_turn_pass``)."""
        if PINGPONG:
            if WG == 0:
                mbarrier.wait(turns.index(0), (k & 1) ^ 1)
            else:
                mbarrier.wait(turns.index(WG), k & 1)

    @gluon.jit
    def _turn_pass(turns, WG: gl.constexpr, NUM_WG: gl.constexpr, PINGPONG: gl.constexpr):
        """With PINGPONG: hand the turn to the next consumer, once this one's products of the turn are issued."""
        if PINGPONG:
            mbarrier.arrive(turns.index((WG + 1) % NUM_WG), count=1)


# ---------------------------------------------------------------------------------------------
# Host side: descriptors and launch shapes
# ---------------------------------------------------------------------------------------------


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@functools.cache
def _layout(rows: int, d: int, dtype: torch.dtype):
    """The shared-memory layout of a (1, 1, rows, d) box of ``dtype`` (fp16/bf16 inputs and outputs, the fused
    backward's fp32 dQ sums): the widest swizzle the rows allow (what the warpgroup MMA reads fastest); kept, as
    working it out costs host time on every launch."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], getattr(gl, _GL_DTYPES[dtype]))


def descriptor(t: torch.Tensor, rows: int, cols: int | None = None) -> TensorDescriptor:
    """A host TMA descriptor of the (Z, H, N, d) tensor ``t`` moving (1, 1, rows, cols) boxes (default: all d
    columns) in ``_layout``. Built without the constructor's checks: ``usable`` made them for every tensor a launcher
    gets (the fused backwards' scratch of dQ sums is allocated dense and aligned)."""
    d = min(cols or t.shape[-1], t.shape[-1])
    return unchecked(TensorDescriptor, base=t, shape=list(t.shape), strides=tma_strides(t),
                     block_shape=[1, 1, rows, d], layout=_layout(rows, d, t.dtype))


def _persistent_programs(cfg: Config, pairs: int, device: torch.device) -> int | None:
    """The grid of a persistent launch (schedule 2) over ``pairs`` pairs of tiles: ``per_sm`` programs per
    multiprocessor; or None where one program per tile should run instead. Every round of the persistent programs
    takes one pair each, and where the rounds are less than ``_FULL_ROUNDS`` full on average, the idle programs of
    the last one cost more than persistence gains (16 heads of 16384 keys at 192-row tiles: 688 pairs, 5.2 rounds
    over 132 programs, 87% full); there one program per tile, the longest first, evens out the tail instead."""
    if device.type != "cuda":  # no launch on other devices
        return None
    programs = cfg.per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    rounds = pairs / programs
    return programs if rounds >= math.ceil(rounds) * _FULL_ROUNDS else None


def _few_heads(heads: int, device: torch.device) -> bool:
    """Whether a launch that fell back from persistent pairs to one program per tile takes its tiles position by
    position (every head's longest causal tile first, ``_item_tile``'s ITEMS 2) rather than head by head: where at
    least ``_HEADS_PER_ROUND`` programs of each head run at once, so that they still share its streamed blocks in L2.
    Head by head, a few heads' last head starts its longest tiles late and the launch waits for them: 16 heads of
    16384 keys, the leaderboard problem, ran its forward 1% and its dQ kernel 4% faster position by position, and
    the whole problem in 4.43-4.58 ms (mean 4.47 over four runs) instead of 4.53-4.55. The dK/dV kernel, which
    takes one program per tile by configuration, stays head by head: position by position it measured 14% slower
    there and 18-29% slower at 128 and 512 heads."""
    if device.type != "cuda":
        return False
    return heads * _HEADS_PER_ROUND <= torch.cuda.get_device_properties(device).multi_processor_count


def _launch_shape(n_stat: int, z: int, h: int, cfg: Config, programs: int | None,
                  device: torch.device) -> tuple[tuple[int], int, dict]:
    """(grid, tiles, launch options) of a launch over ``n_stat`` stationary rows on ``device``, at most
    ``programs`` programs (default: as ``cfg.schedule`` says)."""
    maxnreg, consumer_regs = cfg.registers()
    per_head = triton.cdiv(n_stat, cfg.tile_rows)
    tiles = per_head * z * h
    # Schedule 0: one program per tile, which the hardware hands to multiprocessors as they free up (a head's longest
    # causal tile first). Schedules 1 and 2: one work unit per pair of tiles (Config).
    pairs = (per_head + 1) // 2 * z * h
    schedule = cfg.schedule
    if schedule == 2 and programs is None:
        programs = _persistent_programs(cfg, pairs, device)
        schedule = 2 if programs else 0
    units = pairs if schedule else tiles
    grid = (max(1, min(units, programs or units)),)
    items = 1 if schedule else (2 if cfg.schedule == 2 and _few_heads(z * h, device) else 0)
    options = dict(NUM_WG=cfg.num_wg, NUM_STAGES=cfg.num_stages, CONSUMER_REGS=consumer_regs,
                   REG_A=bool(cfg.reg_a), ITEMS=items, PINGPONG=bool(cfg.pingpong),
                   num_warps=4, maxnreg=maxnreg)
    return grid, tiles, options


def fast_divisor(d: int) -> tuple[int, int]:
    """(multiplier, shift) of ``_fast_div`` by ``d`` (1 <= d < 2^31): with l = ceil(log2 d), the multiplier is
    ceil(2^(31 + l) / d) (below 2^32 for d >= 2), given as the signed int32 of the same bits, and the shift l - 1, so
    that x // d = ((x * multiplier) >> 32) >> shift for every 0 <= x < 2^31. d 1 is taken apart in the kernel."""
    if not 1 <= d < 2**31:
        raise ValueError(f"divisor {d} out of range [1, 2^31)")
    if d == 1:
        return 0, 0
    log = (d - 1).bit_length()
    multiplier = -(-(1 << (31 + log)) // d)
    return multiplier - 2**32 if multiplier >= 2**31 else multiplier, log - 1


def _rows_aligned(n_q: int, *stats: torch.Tensor) -> bool:
    """Whether TMA can copy blocks of the dense (Z * H, N_q) fp32 statistics ``stats`` (L, D): rows of a 16-byte
    multiple (N_q a multiple of 4) from 16-byte aligned bases. Otherwise the dK/dV kernel loads them itself."""
    return n_q % 4 == 0 and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in stats)


def _rows_descriptor(t: torch.Tensor, rows: int, n: int, block: int) -> TensorDescriptor:
    """A host TMA descriptor of the dense fp32 statistics ``t`` viewed as (rows, n), moving (1, block) boxes into an
    unswizzled layout (``_rows_aligned`` made the checks; the descriptor's base is ``t`` itself, so a launch plan
    finds it by role)."""
    return unchecked(TensorDescriptor, base=t, shape=[rows, n], strides=[n, 1], block_shape=[1, block],
                     layout=_ROWS_LAYOUT)


_ROWS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2) if _HAS_GLUON else None

