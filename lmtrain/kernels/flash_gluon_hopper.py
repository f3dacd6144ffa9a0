"""FlashAttention forward and backward for Hopper GPUs (sm_90) written in Gluon: warp-specialised, with the softmax
work of one block overlapping the matrix products of the next.

Same algorithm, outputs and properties as the kernels of ``flash_triton`` (online softmax in the log2 domain with the
scale folded into one multiply-add before ``exp2``; O in the input dtype and the natural-log logsumexp L in fp32; a
dQ kernel that also writes ``D = rowsum(O * dO)``, then a dK/dV kernel, no atomics, so the backward is
deterministic, except where the fused backward with reductions below takes the call; causal masks top-left
aligned; any N_q and N_k; strided inputs), for fp16/bf16 inputs with head dims 64 and 128. What differs is the
schedule, which plain ``tl`` code does not let one write:

* **Warp specialisation.** A program runs ``NUM_WG`` consumer warpgroups of 4 warps, each owning 64 rows of the
  program's *stationary* tile (queries in the forward and dQ kernels, keys in the dK/dV kernel), and one producer
  warp that only issues tensor-memory-accelerator (TMA) copies: the stationary tiles, then the *streamed* blocks (keys
  and values; queries and output gradients for dK/dV) into a ring of ``NUM_STAGES`` shared-memory buffers, each
  guarded by a "ready" barrier (the copy's bytes arrived) and an "empty" barrier (every consumer is done with it).
  Registers move from the producer to the consumers (``setmaxnreg``), so a consumer keeps its fp32 accumulators and
  score tiles in registers without spilling.
* **Overlap inside a warpgroup.** Matrix products are issued asynchronously and waited for only when their result is
  needed: the forward issues the scores of key block j+1 and ``O += P V`` of block j and waits for the scores only
  (ptxas moves the wait for ``P V`` up to the start of the softmax's basic block, so ``P V`` runs beside the other
  consumers' work rather than this one's exponentials; forcing that overlap measured slower,
  docs/benchmarks/2026-11-26-H100-flash-gluon-tile-boundary.md); the backward kernels issue both score-like
  products (``Q K^T`` and ``dO V^T``), compute P while the second runs, issue ``dV += P^T dO`` before computing dS,
  and wait for the gradient products at the end of the block. (Letting them run on into the next block's products
  put three or four products in flight, and ptxas then serialised every warpgroup MMA of the kernel: each one waited
  for before the next, its C7512 "insufficient register resources". The CPU tests check the machine code for
  that.) P and dS stay
  in registers as the first operand of the products that need them; with ``reg_a`` the stationary rows do too
  (``Config``). With two or three consumers on a multiprocessor, one's exponentials also overlap the others'
  products.
* **Tiles and programs** (``Config.schedule``). Schedule 0: one program per tile, so the hardware hands tiles to
  multiprocessors as they free up and the programs running at one time hold neighbouring tiles of one head (causal
  query tiles longest first), sharing its streamed blocks in L2. Schedule 1: one program per *pair* of a head's
  tiles, its j-th longest and j-th shortest causal tile, so every program has the same work and the producer loads the
  second tile's rows while the consumers finish the first. Schedule 2: persistent pairs, ``per_sm`` programs per
  multiprocessor each taking pairs p, p + grid, ...: each tile's first loads and last store then overlap the
  neighbouring tile's products, and each output tile leaves through its own buffer and a TMA store that overlaps the
  next tile. (A static order of single causal tiles measured slower, most likely because programs that drew long
  tiles ran on while the others idled; pairs have equal work.) Where the persistent programs' rounds would be less
  than 95% full on average (few pairs), the launcher takes one program per tile instead (``_persistent_programs``),
  and with few heads hands the tiles out position by position, every head's longest first (``_few_heads``).
* **Turns** (``Config.pingpong``, off in every default: it measured within noise, see
  docs/benchmarks/2026-11-26-H100-flash-gluon-turns.md). The consumers may issue each block's products in turns,
  passed round-robin through one mbarrier each, so that one's exponentials overlap another's products.
* **Masks only where needed.** Blocks wholly visible to every row of the tile run without mask arithmetic; the
  causal diagonal and the ragged key tail are masked. Rows past N read as zeros (TMA) and are not written.
* **Each forward consumer on its own rows' key blocks.** In a causal tile a consumer works only on the key blocks its
  64 rows see and passes the tile's later blocks on unread; with two consumers and 128-key blocks, a last block its
  rows see only the first half of (the first consumer's, on the diagonal) runs at half width. At head dim 64 and
  1024 keys the forward ran 4-6% faster (docs/benchmarks/2026-11-26-H100-flash-gluon-diagonal.md).
* **Short work between tiles.** Block 0 is masked only where it needs it (two consumers), persistent pairs find the
  next tile by multiply-high and shift (``fast_divisor``), and L leaves after O's copy with ``lg2.approx``: at head
  dim 64 and 1024 keys the forward went from 0.864 to 0.785 ms
  (docs/benchmarks/2026-11-26-H100-flash-gluon-tile-boundary.md).

The dK/dV kernel works on transposed scores (keys x queries), so P^T and dS^T come out of its products already as
the first operands of ``dV += P^T dO`` and ``dK += dS^T Q``: no score tile goes through shared memory. Each streamed
query block also needs its queries' L and D, one value per column of the score tile, so every consumer thread holds
a slice of them. The producer copies them (TMA, boxes of one row of the (Z * H, N_q) statistics) into the ring with
the block's queries, and each consumer reads its slice from shared memory just before use: L before the
exponential, D before dS. Loaded from global memory at the block's start instead, they waited on memory latency
inside the block and held their registers across it; with the copies the kernel ran 3-17% faster at the same
configuration, and at head dim 128 the freed registers let it stream 64-query blocks instead of 32 (1.11-1.17x
again; docs/benchmarks/2026-11-26-H100-flash-gluon-stats.md). Where TMA cannot copy them (N_q not a multiple of
4), the consumers load them as before (``_DKDV_LOADS``).

**Fused backward with TMA reductions** (``backward_atomic``; the default at head dims 64 and 128 from 4096 keys on,
``LMTRAIN_FLASH_GLUON_FUSED=2`` wherever it applies; see ``fused``). The dK/dV kernel's consumers also compute each
query block's dQ over the tile's keys (``dS K``), five products per block pair instead of seven: the two consumers
split dQ's columns, each multiplying both consumers' dS^T tiles (through double-buffered shared memory, a barrier
per block) by its half of both K tiles' columns. Each consumer adds its (block x d/2) product into an fp32
(Z, H, N_q, d) tensor of sums by a TMA reduction (``cp.reduce.async.bulk.tensor ... .add``, which Gluon's Hopper
module does not wrap: ``_tma_reduce_add`` builds Triton's own op) from one of two shared-memory slots, so the
reduction runs in L2 while the consumer goes on. A small kernel first writes D and zeroes the sums, another scales
them into dQ. The order in which key tiles add into a block varies, so dQ may differ in its last bits from run to
run: with ``torch.use_deterministic_algorithms(True)`` the default is the dQ and dK/dV kernels. (Adding the sums in
a fixed order instead, each key tile after the next one's reduction has completed, by a flag per block, was
deterministic but took 1.65-1.87x the two kernels' time: docs/benchmarks/2026-11-27-H100-flash-gluon-ordered.md.)
Against a share of all d columns per consumer over its own 64 keys, the split halves the reductions and keeps the
share's accumulator small enough beside dK's and dV's at head dim 128. At head dims 64 and 128, bf16 and causal on
an H100 the backward took 0.90-0.99x the two kernels' time at 4096 to 16384 keys, and 1.07-1.19x at 1024
(docs/benchmarks/2026-11-27-H100-flash-gluon-split-dq.md). At head dim 128 dK and dV leave through the sum slots.

**Ordered fused backward** (``backward``, opt-in: ``LMTRAIN_FLASH_GLUON_FUSED=1``, causal, head dim 64). The dK/dV
kernel's programs also compute each query block's share of dQ over their keys (``dS K``, dS^T through shared
memory), five products per block pair instead of the seven of the dQ and dK/dV kernels. Without atomics, the shares
are added in a fixed order: a reducer partition (two warps) of the program of key tile t waits until the tiles after
t that see the block have added theirs (a per-block flag, read with acquire semantics, released after each TMA store
of the fp32 sum), adds its consumers' two partial tiles to the sum and stores it back; key tile 0, the last, writes
dQ. So dQ is the same bits on every run. Programs are launched a head's last key tile first, so a program only waits
for programs launched before it (which assumes that programs start in launch order: CUDA does not promise it, and the
ordered TMA-reduction variant with the same launch hung on some calls at 16384 programs,
docs/benchmarks/2026-11-27-H100-flash-gluon-ordered.md). It measured slower than the two kernels on an H100
(docs/benchmarks/2026-11-25-H100-flash-gluon-fused-backward.md): the dS store and the dQ product lengthen each block
by more than the quarter more products they add, and each hand-over of a block's sum from one key tile to the next
(a TMA store, the flag, a TMA load) takes about as long as the two blocks the next tile works on meanwhile.

Tiles move through host-side TMA descriptors over the whole (Z, H, N, d) tensors, with (1, 1, rows, d) boxes, as in
``flash_triton_hopper``, so strided views (heads of a fused qkv projection) are read in place.

``usable`` says which calls these kernels serve: a GPU of compute capability 9.0 (warpgroup MMA is an sm_90a
instruction), a Triton with Gluon's Hopper module, fp16/bf16, head dim 64 or 128, the TMA alignment rules, and
``LMTRAIN_FLASH_GLUON`` not ``0``. Other calls run the ``tl`` kernels (``flash_triton_hopper``, ``flash_triton``),
which also serve Triton's interpreter: Gluon kernels do not run there, so the CPU tests compile these kernels for
sm_90a (no GPU needed) and check their machine code, and the GPU tests compare them with a float64 reference.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import os
import threading

import torch
import triton
import triton.language as tl

try:  # Gluon with Hopper's warpgroup MMA and TMA: Triton 3.5 and later
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
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

from lmtrain.kernels._flash_shared import _INTERPRET, _LOG2E
from lmtrain.kernels._launch_plans import launch_compiled, unchecked
from lmtrain.kernels.flash_triton_hopper import _aligned, _capability, _tma_strides  # the TMA rules, once

HEAD_DIMS = (64, 128)
WG_ROWS = 64  # stationary rows per consumer warpgroup: the M of one warpgroup MMA (4 warps x 16 rows)
_REGISTERS = 64 * 1024  # 32-bit registers per multiprocessor (every Hopper GPU)
_PRODUCER_REGS = 24  # the least setmaxnreg allows; the producer warp only issues copies
_SMEM_LIMIT = 227 * 1024  # shared memory one program may use on an H100/H200
_SMEM_PER_SM = 228 * 1024  # shared memory of a multiprocessor; each resident program also reserves 1 KiB
_HEADS_PER_ROUND = 4  # position-by-position tiles only where at least this many programs per head run at once
_FULL_ROUNDS = 0.95  # persistent pairs (schedule 2) only where the programs' rounds are at least this full on average

# The kernels (also the ``MODE`` constexpr of the shared producer: what a kernel's programs hold and stream).
FWD, DQ, DKDV = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch configuration: consumer warpgroups, streamed block rows, ring depth.

    Args:
        num_wg: consumer warpgroups per program (2 or 3); a tile has ``64 * num_wg`` stationary rows.
        block: rows of each streamed block (keys in the forward and dQ kernels, queries in dK/dV); a power of two
            from 16 to 256 (Gluon tiles have power-of-two shapes).
        num_stages: streamed blocks in flight (the ring's buffers).
        per_sm: programs sharing a multiprocessor (1 or 2). Two halve each program's registers and shared memory,
            but one program's first loads and last store then overlap the other's products: what short causal
            tiles (a few key blocks each) need.
        reg_a: 1 keeps each consumer's stationary rows in registers as the first operand of the products that read
            them (forward ``Q K^T``; dQ ``Q K^T`` and ``dO V^T``; dK/dV ``K Q^T`` and ``V dO^T``), so those
            products read only their second operand from shared memory; 0 reads both from shared memory.
        schedule: how tiles go to programs. 0: one program per tile. 1: one program per *pair* of a head's tiles,
            its j-th longest and j-th shortest causal tile one after the other, so every program has the same work
            and the producer loads the second tile's rows while the consumers finish the first. 2: pairs, with
            ``per_sm`` programs per multiprocessor (persistent), each taking pairs p, p + grid, ... (balanced
            because pairs are: a static order of single causal tiles was not).
        pingpong: 1 makes the consumers issue each streamed block's products in turns, round-robin (two mbarriers
            per consumer pass the turn on): consumer 0 issues its products, then consumer 1 its own while consumer
            0 computes its exponentials, and so on. Without it the consumers wait for the same blocks and tend to
            run in step, their products queueing at the tensor cores together and their exponentials then leaving
            the tensor cores idle together. The forward takes turns for ``Q K^T`` with the previous block's
            ``P V``; dQ and dK/dV for their two score products.
    """

    num_wg: int
    block: int
    num_stages: int
    per_sm: int = 1
    reg_a: int = 0
    schedule: int = 0
    pingpong: int = 0

    def __post_init__(self) -> None:
        if self.num_wg not in (2, 3) or self.block not in (16, 32, 64, 128, 256) or self.num_stages < 1 \
                or self.per_sm not in (1, 2) or self.reg_a not in (0, 1) or self.schedule not in (0, 1, 2) \
                or self.pingpong not in (0, 1):
            raise ValueError(f"{self}: num_wg 2 or 3, block a power of two from 16 to 256, num_stages >= 1, "
                             "per_sm 1 or 2, reg_a 0 or 1, schedule 0, 1 or 2, pingpong 0 or 1.")

    @classmethod
    def parse(cls, text: str) -> Config:
        """``"num_wg,block,num_stages[,per_sm[,reg_a[,schedule[,pingpong]]]]"`` -> Config."""
        try:
            parts = [int(x) for x in text.split(",")]
            if not 3 <= len(parts) <= 7:
                raise ValueError(f"{len(parts)} numbers")
            return cls(*parts)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad Gluon flash configuration {text!r}: expected num_wg,block,num_stages"
                             f"[,per_sm[,reg_a[,schedule[,pingpong]]]] ({exc})") from None

    @property
    def tile_rows(self) -> int:
        return WG_ROWS * self.num_wg

    def registers(self, worker_regs: int = _PRODUCER_REGS) -> tuple[int, int]:
        """(maxnreg for the launch, registers per consumer thread): all warps of the ``per_sm`` programs on a
        multiprocessor share its register file (the launch reserves them per warpgroup), the producer's warpgroup
        keeps ``worker_regs`` (by default the minimum; the fused backward's reducer shares that warpgroup and needs
        more) and the consumers split the rest, rounded down to multiples of 8 as setmaxnreg requires."""
        warpgroups = self.num_wg + 1
        maxnreg = _REGISTERS // self.per_sm // (warpgroups * 128) // 8 * 8
        consumer = (maxnreg * warpgroups - worker_regs) // self.num_wg // 8 * 8
        return maxnreg, min(consumer, 256)

    def smem_bytes(self, mode: int, head_dim: int, elt: int = 2) -> int:
        """Shared memory of the tiles of one program of kernel ``mode``: stationary tiles and output tiles (one
        64-row tile each per consumer and tensor), two streamed tensors in the ring."""
        stationary, outputs = {FWD: (1, 1), DQ: (2, 1), DKDV: (2, 2)}[mode]
        rows = (stationary + outputs) * self.tile_rows + 2 * self.num_stages * self.block
        return rows * head_dim * elt


# Per (kernel, head dim): steps (from this many keys on, configuration, Gluon by default), the last step at or below
# the key count applying; where a step says False the tl kernel of flash_triton_hopper runs by default (it measured
# faster there) and the configuration serves LMTRAIN_FLASH_GLUON=all. From the sweeps in
# docs/benchmarks/2026-11-25-H100-flash-gluon.md, 2026-11-25-H100-flash-gluon-schedule.md and
# 2026-11-25-H100-flash-gluon-pairs.md (bf16, causal, B*H*N = 2^21). Persistent pairs (schedule 2) gained in every
# forward cell and most dQ cells; the dK/dV kernel gained from them at 1024 keys only. The d 64 dQ kernel from 4096
# keys is the three-consumer one, which is also the faster where the launcher falls back to one program per tile.
# The d 128 dK/dV kernel streams 64-query blocks, persistent, since its L and D come through shared memory (registers
# freed; 1.11-1.17x the 32-query blocks with the same copies, docs/benchmarks/2026-11-26-H100-flash-gluon-stats.md).
_TABLE = {
    (FWD, 64): ((0, Config(2, 128, 3, 1, 0, 2), True), (8192, Config(3, 128, 2, 1, 0, 2), True)),
    (FWD, 128): ((0, Config(2, 128, 2, 1, 0, 2), True), (16384, Config(3, 64, 3, 1, 0, 2), True)),
    (DQ, 64): ((0, Config(2, 128, 3, 1, 0, 2), False), (4096, Config(3, 64, 3, 1, 0, 2), True)),
    (DQ, 128): ((0, Config(2, 128, 2, 1, 0, 2), True),),
    (DKDV, 64): ((0, Config(2, 64, 3, 1, 1, 2), True), (4096, Config(2, 64, 3, 1, 1), True)),
    (DKDV, 128): ((0, Config(2, 64, 2, 1, 0, 2), True),),
}
# The dK/dV configurations where the consumers load L and D themselves (N_q not a multiple of 4): the loads' registers
# leave the d 128 kernel room for 32-query blocks only (64-query blocks spill there: 184 local-memory accesses).
_DKDV_LOADS = {128: Config(2, 32, 2, 1, 0, 2)}
_ENV = {FWD: "LMTRAIN_FLASH_GLUON_FWD", DQ: "LMTRAIN_FLASH_GLUON_DQ", DKDV: "LMTRAIN_FLASH_GLUON_DKDV"}
# reg_a in the table applies with the Triton it was measured and checked with (3.6: no spills); Triton 3.9 spills
# with it (dK/dV at head dim 64: 177 local-memory accesses), so newer versions take the same configuration without it.
_REG_A_DEFAULTS = tuple(int(x) for x in triton.__version__.split(".")[:2]) <= (3, 6)


def _step(kernel: int, head_dim: int, n_keys: int) -> tuple[int, Config, bool]:
    return [step for step in _TABLE[(kernel, head_dim)] if n_keys >= step[0]][-1]


def config(kernel: int, head_dim: int, n_keys: int = 0, loads: bool = False) -> Config:
    """The configuration of ``kernel`` (FWD, DQ or DKDV) for ``head_dim`` and ``n_keys`` keys; ``loads`` (dK/dV):
    the consumers load L and D themselves (``_rows_aligned`` false), which takes ``_DKDV_LOADS``'s configuration
    where it has one for the head dim;
    ``LMTRAIN_FLASH_GLUON_{FWD,DQ,DKDV}=num_wg,block,num_stages[,per_sm[,reg_a[,schedule[,pingpong]]]]``
    overrides it (for sweeps)."""
    override = os.environ.get(_ENV[kernel])
    if override:
        return Config.parse(override)
    cfg = _DKDV_LOADS.get(head_dim) if loads and kernel == DKDV else None
    cfg = cfg or _step(kernel, head_dim, n_keys)[1]
    return cfg if _REG_A_DEFAULTS or not cfg.reg_a else dataclasses.replace(cfg, reg_a=0)


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


_NAMES = {"fwd": FWD, "dq": DQ, "dkdv": DKDV}


def setting() -> str | frozenset[int]:
    """``LMTRAIN_FLASH_GLUON``: ``1`` (default) each Gluon kernel where it is the faster one, ``all`` every Gluon
    kernel wherever it applies, ``0`` none, or a comma-separated list of the kernels to take wherever they apply
    (``fwd``, ``dq``, ``dkdv``; for example ``fwd,dq``), returned as a set of FWD/DQ/DKDV."""
    value = os.environ.get("LMTRAIN_FLASH_GLUON", "1")
    if value in ("0", "1", "all"):
        return value
    names = [name.strip() for name in value.split(",")]
    if not names or any(name not in _NAMES for name in names):
        raise ValueError(f"LMTRAIN_FLASH_GLUON={value!r}: use 1 (each Gluon kernel where it is faster, the "
                         "default), all (every Gluon kernel), 0 (none) or a list of kernels from fwd, dq, dkdv "
                         "(e.g. fwd,dq).")
    return frozenset(_NAMES[name] for name in names)


def kernels(*tensors: torch.Tensor) -> frozenset[int]:
    """The Gluon kernels (FWD, DQ, DKDV) that serve these (Z, H, N, d) tensors (inputs and output buffers alike; q
    first, k second), as ``setting()`` says: with ``1`` those that ``_TABLE`` makes the default (they measured faster
    than the tl kernels there), with ``all`` or a list those named, wherever they apply. One call checks the tensors
    once for all kernels (the backward asks for two)."""
    mode = setting()
    fused_setting()  # its value checked here too, so that a bad one fails in the forward already
    if not _HAS_GLUON or _INTERPRET or mode == "0":
        return frozenset()
    q4 = tensors[0]
    d = q4.shape[-1]
    if q4.device.type != "cuda" or q4.dtype not in (torch.float16, torch.bfloat16) or d not in HEAD_DIMS:
        return frozenset()
    if mode == "1":
        n_keys = tensors[1].shape[-2] if len(tensors) > 1 else q4.shape[-2]
        chosen = frozenset(kernel for kernel in (FWD, DQ, DKDV) if _step(kernel, d, n_keys)[2])
    else:
        chosen = frozenset((FWD, DQ, DKDV)) if mode == "all" else mode
    if not chosen or _capability(q4.device) != (9, 0) or not all(_aligned(t) for t in tensors):
        return frozenset()
    return chosen


# Head dim -> from this many keys on, the fused backward with TMA reductions (``backward_atomic``) is the default: it
# measured faster than the dQ and dK/dV kernels there, and slower below (1024 keys: 1.07x their time at head dim 64,
# 1.19x at 128; docs/benchmarks/2026-11-27-H100-flash-gluon-split-dq.md).
_FUSED_FROM = {64: 4096, 128: 4096}
AUTO = -1  # LMTRAIN_FLASH_GLUON_FUSED unset: the fused backward where _FUSED_FROM says


def fused(chosen: frozenset[int], q4: torch.Tensor, k4: torch.Tensor, is_causal: bool) -> int:
    """Which backward serves a call whose Gluon kernels are ``chosen`` (``kernels``): 0 the dQ and dK/dV kernels,
    1 the ordered fused backward (``backward``: causal, head dim 64), 2 the fused backward whose dQ sums are TMA
    reductions (``backward_atomic``: its streamed blocks must be 64 queries, which rules out head dim 128 where N_q
    is not a multiple of 4). Both need the Gluon dK/dV kernel to apply. ``LMTRAIN_FLASH_GLUON_FUSED`` (see
    ``fused_setting``) unset: 2 where ``_FUSED_FROM`` says, with the default ``LMTRAIN_FLASH_GLUON``, unless
    ``torch.use_deterministic_algorithms`` is on (2's sums are added in a different order on every run)."""
    mode = fused_setting()
    if not mode or DKDV not in chosen:
        return 0
    d, n_q, n_k = q4.shape[-1], q4.shape[-2], k4.shape[-2]
    if mode == AUTO:
        if d not in _FUSED_FROM or n_k < _FUSED_FROM[d] or setting() != "1" \
                or torch.are_deterministic_algorithms_enabled():
            return 0
        mode = 2
    if mode == 2:  # the dQ product's M is the streamed block: 64 queries
        return mode if config(DKDV, d, n_k, loads=n_q % 4 != 0).block == 64 else 0
    return mode if is_causal and d == 64 else 0


def fused_setting() -> int:
    """``LMTRAIN_FLASH_GLUON_FUSED``: unset ``AUTO`` (see ``fused``); ``0`` the dQ and dK/dV kernels; ``1`` the
    ordered fused backward; ``2`` the fused backward with TMA reductions, wherever they apply. Any other value is an
    error (checked by every call through ``kernels``, forward included, so a typo fails before the backward)."""
    value = os.environ.get("LMTRAIN_FLASH_GLUON_FUSED")
    if value is None:
        return AUTO
    if value not in ("0", "1", "2"):
        raise ValueError(f"LMTRAIN_FLASH_GLUON_FUSED={value!r}: use 2 (the fused backward with TMA reductions), 1 "
                         "(the ordered fused backward, causal, head dim 64) or 0 (the dQ and dK/dV kernels); unset, "
                         "the first where it measured faster.")
    return int(value)


def usable(*tensors: torch.Tensor, kernel: int = FWD) -> bool:
    """Whether the Gluon ``kernel`` (FWD, DQ or DKDV) serves these tensors (see ``kernels``)."""
    return kernel in kernels(*tensors)


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
        if MODE == 3:
            return _tile_coords(tile, N_K, H, BLOCK_T, True)  # fused backward: a head's last key tile first
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

    # -----------------------------------------------------------------------------------------
    # Forward
    # -----------------------------------------------------------------------------------------

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
    def _fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, H, N_Q, N_K, NUM_TILES, qk_scale, PAIR_MUL, PAIR_SHIFT,
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

    # -----------------------------------------------------------------------------------------
    # Backward: dQ (and D), then dK/dV
    # -----------------------------------------------------------------------------------------

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
    def _dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, OUT, stride_oz, stride_oh, stride_on, LSE, DELTA,
                   H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale,
                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WG: gl.constexpr, NUM_STAGES: gl.constexpr,
                   IS_CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, REG_A: gl.constexpr,
                   ITEMS: gl.constexpr, PINGPONG: gl.constexpr):
        """Over query tiles (as ``_fwd_kernel``): dQ and D of each; queries and dO stationary, keys and
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
                       q_ready, q_empty, do_ready, do_empty, ds_smem, part_smem, part_ready, part_empty, turns,
                       LSE, DELTA, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale,
                       BLOCK_T: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                       NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, WG: gl.constexpr, REG_A: gl.constexpr,
                       FUSED: gl.constexpr, ITEMS: gl.constexpr, PINGPONG: gl.constexpr = False,
                       ABLATE: gl.constexpr = 0, lse_smem=None, delta_smem=None, SMEM_STATS: gl.constexpr = False,
                       acc_desc=None, NUM_SLOTS: gl.constexpr = 2, OUT_IN_SLOTS: gl.constexpr = False):
        """One warpgroup: dK, dV of key rows [start + 64 WG, start + 64 (WG + 1)) of each tile, on transposed
        (keys x queries) score tiles. FUSED 1 (``_bwd_kernel``): also this warpgroup's part of each query block's
        dQ, ``dS K`` over its 64 keys, handed to the reducer through ``part_smem``; FUSED 2 (``_bwd_atomic_kernel``):
        this warpgroup's half of each query block's dQ columns over both consumers' keys (the two dS^T tiles through
        ``ds_smem``, double buffered, ``part_ready`` the two blocks' barriers), added into the sums of ``acc_desc``
        by TMA reductions from ``part_smem``'s NUM_SLOTS slots of this warpgroup, and with OUT_IN_SLOTS dK and dV
        leaving through those slots (``ds_smem``, ``part_*``: unused without FUSED). With PINGPONG the consumers
        issue each block's score products in turns (``_turn_wait``).

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
            DQ_COLS: gl.constexpr = acc_desc.block_type.shape[3] if FUSED == 2 else HEAD_DIM
            dq_layout: gl.constexpr = _wgmma_layout(DQ_COLS)
            zero_dq = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
            ds_t = ds_smem.index(WG)
            part = 0  # partial dQ tiles handed over so far: the part ring's position

        c = 0
        it = 0
        turn = 0
        lo, hi, step = _items(NUM_TILES, N_K, BLOCK_T, ITEMS)
        for item in range(lo, hi, step):
            tile, valid = _item_tile(item, N_K, NUM_TILES, BLOCK_T, ITEMS)
            if valid:
                bh, z, h, start = _tile_coords(tile, N_K, H, BLOCK_T, FUSED == 1)
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
                    if FUSED == 2:
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
                    elif FUSED:
                        # dQ of the query block over this warpgroup's keys: dS (queries x keys) is dS^T through shared
                        # memory, read transposed; K is the stationary tile.
                        ds_t.store(dst)
                        fence_async_shared()
                        dq_tok = warpgroup_mma(ds_t.permute((1, 0)), k, zero_dq, use_acc=False, is_async=True)
                        dk, dv, dq = warpgroup_mma_wait(0, deps=(dk, dv, dq_tok))
                        mbarrier.arrive(q_empty.index(stage), count=1)
                        mbarrier.arrive(do_empty.index(stage), count=1)
                        if ABLATE == 1:
                            dk = dk + dq * 0.0  # keeps the product
                        else:
                            slot = part % 2
                            mbarrier.wait(part_empty.index(slot), ((part // 2) & 1) ^ 1)
                            part_smem.index(2 * slot + WG).store(dq)
                            mbarrier.arrive(part_ready.index(slot), count=1)
                            part += 1
                    else:
                        # Both gradient products finish within the block (see _dq_consumer: overlapped with the next
                        # block's products, ptxas serialises them all).
                        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
                        mbarrier.arrive(q_empty.index(stage), count=1)
                        mbarrier.arrive(do_empty.index(stage), count=1)
                    k_a, v_a = _renewed(k_a, N_K, REG_A), _renewed(v_a, N_K, REG_A)
                n_blocks = end - first
                if FUSED == 2:
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
    def _dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc,
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
                                  kv_empty, q_ready, q_empty, do_ready, do_empty, k_smem, k_smem, kv_ready, kv_ready,
                                  turns, lse_desc, delta_desc, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                                  BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 0, REG_A, False, ITEMS, PINGPONG, 0,
                                  lse_smem, delta_smem, SMEM_STATS)),
                (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready,
                                  kv_empty, q_ready, q_empty, do_ready, do_empty, k_smem, k_smem, kv_ready, kv_ready,
                                  turns, lse_desc, delta_desc, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                                  BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 1, REG_A, False, ITEMS, PINGPONG, 0,
                                  lse_smem, delta_smem, SMEM_STATS)),
                (_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty,
                             q_ready, q_empty, do_ready, do_empty, H, N_Q, N_K, NUM_TILES, BLOCK_M, NUM_WG, NUM_STAGES,
                             IS_CAUSAL, 2, ITEMS, lse_desc, delta_desc, lse_smem, delta_smem, SMEM_STATS)),
            ], [4, 1], [CONSUMER_REGS, 24])  # 24: _PRODUCER_REGS
        else:
            gl.warp_specialize([
                (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready,
                                  kv_empty, q_ready, q_empty, do_ready, do_empty, k_smem, k_smem, kv_ready, kv_ready,
                                  turns, lse_desc, delta_desc, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                                  BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 0, REG_A, False, ITEMS, PINGPONG, 0,
                                  lse_smem, delta_smem, SMEM_STATS)),
                (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready,
                                  kv_empty, q_ready, q_empty, do_ready, do_empty, k_smem, k_smem, kv_ready, kv_ready,
                                  turns, lse_desc, delta_desc, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                                  BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 1, REG_A, False, ITEMS, PINGPONG, 0,
                                  lse_smem, delta_smem, SMEM_STATS)),
                (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready,
                                  kv_empty, q_ready, q_empty, do_ready, do_empty, k_smem, k_smem, kv_ready, kv_ready,
                                  turns, lse_desc, delta_desc, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                                  BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 2, REG_A, False, ITEMS, PINGPONG, 0,
                                  lse_smem, delta_smem, SMEM_STATS)),
                (_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty,
                             q_ready, q_empty, do_ready, do_empty, H, N_Q, N_K, NUM_TILES, BLOCK_M, NUM_WG, NUM_STAGES,
                             IS_CAUSAL, 2, ITEMS, lse_desc, delta_desc, lse_smem, delta_smem, SMEM_STATS)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])  # 24: _PRODUCER_REGS

    # -----------------------------------------------------------------------------------------
    # Fused backward: dK, dV and dQ in one kernel, dQ summed over key tiles in a fixed order
    # -----------------------------------------------------------------------------------------

    @gluon.jit
    def _ld_acquire(ptr):
        """``*ptr`` (int32, global memory), read with acquire semantics at GPU scope, then a proxy fence: what the
        releasing program wrote before its release is visible to this program's later reads, TMA copies too."""
        return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];\n\tfence.proxy.async.global;", "=r,l",
                                         [ptr], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _st_release(ptr, value):
        """``*ptr = value`` (int32, global memory) with release semantics at GPU scope, after a proxy fence: the
        TMA stores this program completed before are visible to whoever acquires the value."""
        return gl.inline_asm_elementwise(
            "fence.proxy.async.global;\n\tst.release.gpu.global.b32 [$1], $2;\n\tmov.b32 $0, 0;", "=r,l,r",
            [ptr, value], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _predecessors(i, t, T, BLOCK_T: gl.constexpr, BLOCK_M: gl.constexpr):
        """How many key tiles add into query block ``i``'s dQ before key tile ``t``: the tiles after ``t`` that see
        the block (the last tile that does comes first, key tile 0 last)."""
        return gl.minimum((i * BLOCK_M + BLOCK_M - 1) // BLOCK_T, T - 1) - t

    @gluon.jit
    def _fetch_acc(acc_desc, acc_smem, acc_ready, flags, z, h, i, t, T, n,
                   BLOCK_T: gl.constexpr, BLOCK_M: gl.constexpr, WAIT: gl.constexpr):
        """Into ring slot ``n % 2``: the dQ sum of block ``i`` so far, once its last predecessor released it (none
        for the first contributor: the barrier is just arrived at)."""
        slot = n % 2
        before = _predecessors(i, t, T, BLOCK_T, BLOCK_M)
        if before > 0:
            if WAIT:
                seen = _ld_acquire(flags + i)
                while seen != before:
                    seen = _ld_acquire(flags + i)
            mbarrier.expect(acc_ready.index(slot), acc_desc.block_type.nbytes)
            _tma_load(acc_desc, [z, h, i * BLOCK_M, 0], acc_ready.index(slot), acc_smem.index(slot))
        else:
            mbarrier.arrive(acc_ready.index(slot), count=1)

    @gluon.jit
    def _dq_reducer(acc_desc, dq_desc, part_smem, acc_smem, dq_smem, part_ready, part_empty, acc_ready, FLAGS,
                    H, N_Q, N_K, NUM_TILES, sm_scale, BLOCK_T: gl.constexpr, BLOCK_M: gl.constexpr,
                    HEAD_DIM: gl.constexpr, IS_CAUSAL: gl.constexpr, ABLATE: gl.constexpr):
        """Two warps: for each query block of each tile, the two consumers' partial dQ plus the sum of the key tiles
        before (fp32, ``acc_desc``), stored back for the next key tile, or, by key tile 0 (the last), scaled into
        dQ. Key tiles add in a fixed order, each after the one before released the block's flag, so dQ is the same
        bits on every run, without atomics. A block's flag is released as soon as its sum is stored, and the next
        block's sum is fetched while the consumers work on it."""
        COLS_T: gl.constexpr = HEAD_DIM // 4
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // COLS_T, COLS_T], [2, 1], [1, 0])
        ROWS: gl.constexpr = 16
        dtype: gl.constexpr = dq_desc.dtype
        T = gl.cdiv(N_K, BLOCK_T)
        n_qb = gl.cdiv(N_Q, BLOCK_M)
        n = 0  # query blocks summed so far: the ring position
        for tile in range(gl.program_id(0), NUM_TILES, gl.num_programs(0)):
            bh, z, h, start = _tile_coords(tile, N_K, H, BLOCK_T, True)
            t = start // BLOCK_T
            first, end, boundary = _streamed(start, N_Q, N_K, BLOCK_T, BLOCK_M, IS_CAUSAL, 2)
            flags = FLAGS + bh * n_qb
            if ABLATE == 1:
                end = first
            if ABLATE == 2 or ABLATE == 3:
                for _i in range(first, end):
                    slot = n % 2
                    mbarrier.wait(part_ready.index(slot), (n // 2) & 1)
                    if ABLATE == 3:
                        acc = acc_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
                        for r in gl.static_range(0, BLOCK_M, ROWS):
                            x = part_smem.index(2 * slot).slice(r, ROWS).load(layout) \
                                + part_smem.index(2 * slot + 1).slice(r, ROWS).load(layout)
                            x += acc.slice(r, ROWS).load(layout)
                            acc.slice(r, ROWS).store(x)
                    mbarrier.arrive(part_empty.index(slot), count=1)
                    n += 1
                end = first
            if first < end:
                _fetch_acc(acc_desc, acc_smem, acc_ready, flags, z, h, first, t, T, n, BLOCK_T, BLOCK_M, ABLATE != 4)
            for i in range(first, end):
                slot = n % 2
                phase = (n // 2) & 1
                before = _predecessors(i, t, T, BLOCK_T, BLOCK_M)
                mbarrier.wait(part_ready.index(slot), phase)
                mbarrier.wait(acc_ready.index(slot), phase)
                acc = acc_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
                out = dq_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
                for r in gl.static_range(0, BLOCK_M, ROWS):
                    x = part_smem.index(2 * slot).slice(r, ROWS).load(layout) \
                        + part_smem.index(2 * slot + 1).slice(r, ROWS).load(layout)
                    if before > 0:
                        x += acc.slice(r, ROWS).load(layout)
                    if t == 0:
                        out.slice(r, ROWS).store((x * sm_scale).to(dtype))
                    else:
                        acc.slice(r, ROWS).store(x)
                mbarrier.arrive(part_empty.index(slot), count=1)
                fence_async_shared()
                if t == 0:
                    _tma_store(dq_desc, [z, h, i * BLOCK_M, 0], dq_smem.index(slot))
                else:
                    _tma_store(acc_desc, [z, h, i * BLOCK_M, 0], acc_smem.index(slot))
                    # The next key tile waits for this block: release it as soon as the sum is stored.
                    tma.store_wait(0)
                    _partition_barrier()
                    _st_release(flags + i, before + 1)
                if i + 1 < end:
                    # Slot n + 1 was last read by block n - 1's store, which has completed (waited for above, or
                    # by key tile 0 here).
                    tma.store_wait(1)
                    _partition_barrier()
                    _fetch_acc(acc_desc, acc_smem, acc_ready, flags, z, h, i + 1, t, T, n + 1, BLOCK_T, BLOCK_M,
                               ABLATE != 4)
                n += 1
            tma.store_wait(0)

    @gluon.jit
    def _bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, acc_desc, dq_desc, LSE, DELTA, FLAGS,
                    H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale,
                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, NUM_WG: gl.constexpr, NUM_STAGES: gl.constexpr,
                    IS_CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, WORKER_REGS: gl.constexpr,
                    REG_A: gl.constexpr, ABLATE: gl.constexpr = 0):
        """Over key tiles, a head's last first: dK and dV of each as ``_dkdv_kernel``, and every tile's share of
        dQ (``dS K`` over its keys), which the reducer adds into an fp32 sum (``acc_desc``) in key-tile order,
        the last (key tile 0) writing dQ. Five products per block instead of the seven of the dQ and dK/dV kernels.
        Reads D, which ``_delta_kernel`` writes first; FLAGS (one int32 per query block and head) start at zero.

        ABLATE (diagnostics, wrong results except at 0) leaves out parts to time the rest: 1 the partial dQ tiles
        are not handed over (the reducer idles), 2 the reducer only frees them, 3 it also sums them in shared
        memory but moves nothing to or from global memory, 4 everything but the waits for the flags."""
        dtype: gl.constexpr = q_desc.dtype
        BLOCK_T: gl.constexpr = NUM_WG * 64
        gl.static_assert(NUM_WG == 2, "the fused backward runs two consumer warpgroups")
        gl.static_assert(BLOCK_M == 64, "the fused backward streams 64-query blocks (the M of the dQ product)")
        (k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready, kv_empty, q_ready, q_empty, do_ready,
         do_empty) = _dkdv_buffers(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, NUM_WG, NUM_STAGES)
        ds_smem = gl.allocate_shared_memory(dtype, [NUM_WG, 64, BLOCK_M],
                                            gl.NVMMASharedLayout.get_default_for([64, BLOCK_M], dtype))
        part_smem = gl.allocate_shared_memory(gl.float32, [2 * NUM_WG, BLOCK_M, HEAD_DIM],
                                              gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float32))
        acc_smem = gl.allocate_shared_memory(gl.float32, [2] + acc_desc.block_type.shape, acc_desc.layout)
        dq_smem = gl.allocate_shared_memory(dtype, [2] + dq_desc.block_type.shape, dq_desc.layout)
        part_ready, part_empty, acc_ready = _barriers(2, NUM_WG), _barriers(2, 1), _barriers(2, 1)
        gl.warp_specialize([
            (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready,
                              kv_empty, q_ready, q_empty, do_ready, do_empty, ds_smem, part_smem, part_ready,
                              part_empty, part_empty, LSE, DELTA, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                              BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 0, REG_A, True, False, False, ABLATE)),
            (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready,
                              kv_empty, q_ready, q_empty, do_ready, do_empty, ds_smem, part_smem, part_ready,
                              part_empty, part_empty, LSE, DELTA, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                              BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 1, REG_A, True, False, False, ABLATE)),
            (_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty,
                         q_ready, q_empty, do_ready, do_empty, H, N_Q, N_K, NUM_TILES, BLOCK_M, NUM_WG, NUM_STAGES,
                         IS_CAUSAL, 3, False)),
            (_dq_reducer, (acc_desc, dq_desc, part_smem, acc_smem, dq_smem, part_ready, part_empty, acc_ready,
                           FLAGS, H, N_Q, N_K, NUM_TILES, sm_scale, BLOCK_T, BLOCK_M, HEAD_DIM, IS_CAUSAL,
                           ABLATE)),
        ], [4, 1, 2], [CONSUMER_REGS, WORKER_REGS, WORKER_REGS])

    @gluon.jit
    def _bwd_atomic_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, acc_desc, lse_desc, delta_desc,
                           H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale,
                           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, NUM_WG: gl.constexpr,
                           NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           REG_A: gl.constexpr, ITEMS: gl.constexpr, PINGPONG: gl.constexpr,
                           SMEM_STATS: gl.constexpr, NUM_SLOTS: gl.constexpr, OUT_IN_SLOTS: gl.constexpr):
        """Over key tiles as ``_dkdv_kernel``: dK and dV of each, and every tile's share of dQ (``dS K`` over its
        128 keys, each consumer computing half of dQ's columns, ``acc_desc``'s box) added into fp32 sums (zeroed
        before) by TMA reductions from NUM_SLOTS shared-memory tiles per consumer. Five products per block pair; the
        sums' order of addition varies from run to run. Reads D, which ``_delta_kernel`` writes. OUT_IN_SLOTS: dK
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
                              kv_empty, q_ready, q_empty, do_ready, do_empty, ds_smem, slots, ds_ready, kv_ready,
                              turns, lse_desc, delta_desc, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                              BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 0, REG_A, 2, ITEMS, PINGPONG, 0,
                              lse_smem, delta_smem, SMEM_STATS, acc_desc, NUM_SLOTS, OUT_IN_SLOTS)),
            (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, dk_smem, dv_smem, q_smem, do_smem, kv_ready,
                              kv_empty, q_ready, q_empty, do_ready, do_empty, ds_smem, slots, ds_ready, kv_ready,
                              turns, lse_desc, delta_desc, H, N_Q, N_K, NUM_TILES, qk_scale, sm_scale, BLOCK_T,
                              BLOCK_M, HEAD_DIM, NUM_STAGES, IS_CAUSAL, 1, REG_A, 2, ITEMS, PINGPONG, 0,
                              lse_smem, delta_smem, SMEM_STATS, acc_desc, NUM_SLOTS, OUT_IN_SLOTS)),
            (_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty,
                         q_ready, q_empty, do_ready, do_empty, H, N_Q, N_K, NUM_TILES, BLOCK_M, NUM_WG, NUM_STAGES,
                         IS_CAUSAL, 2, ITEMS, lse_desc, delta_desc, lse_smem, delta_smem, SMEM_STATS)),
        ], [4, 1], [CONSUMER_REGS, 24])  # 24: _PRODUCER_REGS


# ---------------------------------------------------------------------------------------------
# Launchers: (Z, H, N, d) views prepared and checked by flash_triton's _forward / _backward
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
    return unchecked(TensorDescriptor, base=t, shape=list(t.shape), strides=_tma_strides(t),
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
    there and 18-29% slower at 128 and 512 heads (docs/benchmarks/2026-11-26-H100-flash-gluon-turns.md)."""
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


def forward_args(q4, k4, v4, o4, lse, is_causal: bool, cfg: Config | None = None,
                 programs: int | None = None) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, keyword arguments) of one launch of the forward kernel; ``programs`` (default:
    as ``cfg.schedule`` says) caps the grid, each program then taking the work items p, p + grid, ... (tiles, or
    with schedules 1 and 2 pairs of tiles)."""
    z, h, n_q, d = q4.shape
    cfg = cfg or config(FWD, d, k4.shape[2])
    grid, tiles, options = _launch_shape(n_q, z, h, cfg, programs, q4.device)
    pairs_per_head = (triton.cdiv(n_q, cfg.tile_rows) + 1) // 2
    args = (descriptor(q4, WG_ROWS), descriptor(k4, cfg.block), descriptor(v4, cfg.block), descriptor(o4, WG_ROWS),
            lse, h, n_q, k4.shape[2], tiles, d**-0.5 * _LOG2E, *fast_divisor(pairs_per_head), *fast_divisor(h))
    return grid, args, dict(HEAD_DIM=d, BLOCK_N=cfg.block, IS_CAUSAL=bool(is_causal), **options)


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


def dq_args(q4, k4, v4, o4, do4, dq4, lse, delta, is_causal: bool, cfg: Config | None = None,
            programs: int | None = None) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, keyword arguments) of one launch of the dQ kernel (which also writes D)."""
    z, h, n_q, d = q4.shape
    cfg = cfg or config(DQ, d, k4.shape[2])
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
    cfg = cfg or config(DKDV, d, n_k, loads=not rows)
    grid, tiles, options = _launch_shape(n_k, z, h, cfg, programs, k4.device)
    if rows:
        lse, delta = _rows_descriptor(lse, z * h, n_q, cfg.block), _rows_descriptor(delta, z * h, n_q, cfg.block)
    args = (descriptor(q4, cfg.block), descriptor(k4, WG_ROWS), descriptor(v4, WG_ROWS), descriptor(do4, cfg.block),
            descriptor(dk4, WG_ROWS), descriptor(dv4, WG_ROWS), lse, delta,
            h, n_q, n_k, tiles, d**-0.5 * _LOG2E, d**-0.5)
    return grid, args, dict(HEAD_DIM=d, BLOCK_M=cfg.block, IS_CAUSAL=bool(is_causal), SMEM_STATS=rows, **options)


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


FUSED_REGS = 48  # the producer's and the reducer's warpgroup in the fused backward
# The fused backward's configuration: 64-query blocks (the M of its dQ product), two in the ring (shared memory holds
# no more beside the partial dQ and sum buffers), K and V in registers where the Triton allows (as ``config``).
FUSED_CONFIG = Config(2, 64, 2, 1, int(_REG_A_DEFAULTS))


def bwd_args(q4, k4, v4, do4, dq4, dk4, dv4, acc, flags, lse, delta, is_causal: bool,
             cfg: Config | None = None) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, keyword arguments) of one launch of the fused backward kernel; ``acc`` is the
    fp32 (Z, H, cdiv(N_Q, block) * block, d) scratch of dQ sums, ``flags`` int32 zeros, one per query block and
    head (``block``: the configuration's, 64)."""
    z, h, n_k, d = k4.shape
    cfg = cfg or FUSED_CONFIG
    maxnreg, consumer_regs = cfg.registers(FUSED_REGS)
    tiles = triton.cdiv(n_k, cfg.tile_rows) * z * h
    args = (descriptor(q4, cfg.block), descriptor(k4, WG_ROWS), descriptor(v4, WG_ROWS), descriptor(do4, cfg.block),
            descriptor(dk4, WG_ROWS), descriptor(dv4, WG_ROWS), descriptor(acc, cfg.block), descriptor(dq4, cfg.block),
            lse, delta, flags, h, q4.shape[2], n_k, tiles, d**-0.5 * _LOG2E, d**-0.5)
    kwargs = dict(HEAD_DIM=d, BLOCK_M=cfg.block, NUM_WG=cfg.num_wg, NUM_STAGES=cfg.num_stages,
                  IS_CAUSAL=bool(is_causal), CONSUMER_REGS=consumer_regs, WORKER_REGS=FUSED_REGS,
                  REG_A=bool(cfg.reg_a), num_warps=4, maxnreg=maxnreg)
    return (tiles,), args, kwargs


def bwd_atomic_args(q4, k4, v4, do4, dk4, dv4, acc, lse, delta, is_causal: bool, cfg: Config | None = None,
                    programs: int | None = None) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, keyword arguments) of one launch of ``_bwd_atomic_kernel``: those of the dK/dV
    kernel (``dkdv_args``, the same configuration) with ``acc``, the dense fp32 (Z, H, N_Q, d) tensor of dQ sums
    (zeroed), moved in boxes of d / 2 columns (one consumer's half); at head dim 128 dK and dV leave through the sum
    slots (shared memory holds no tiles of their own beside them)."""
    grid, args, kwargs = dkdv_args(q4, k4, v4, do4, dk4, dv4, lse, delta, is_causal, cfg, programs)
    args = (*args[:6], descriptor(acc, kwargs["BLOCK_M"], q4.shape[-1] // kwargs["NUM_WG"]), *args[6:])
    return grid, args, dict(kwargs, NUM_SLOTS=2, OUT_IN_SLOTS=q4.shape[-1] > 64)


@triton.jit
def _dq_convert_kernel(ACC, DQ, stride_z, stride_h, stride_n, H, N_Q, scale, HEAD_DIM: tl.constexpr,
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
    """dQ, dK and dV into ``dq4``, ``dk4``, ``dv4`` with ``_bwd_atomic_kernel``, for views that ``fused`` gave 2:
    D into ``delta`` and zeros into ``acc`` (dense fp32 (Z, H, N_Q, d), ``_delta_kernel``), the fused kernel, then
    dQ from the sums (``_dq_convert_kernel``)."""
    bind_context(q4.device)
    z, h, n_q, d = q4.shape
    launch_compiled(_delta_kernel, *delta_args(o4, do4, delta, acc))
    launch_compiled(_bwd_atomic_kernel, *bwd_atomic_args(q4, k4, v4, do4, dk4, dv4, acc, lse, delta, is_causal, cfg))
    launch_compiled(_dq_convert_kernel, _row_grid(z * h, n_q),
                    (acc, dq4, *dq4.stride()[:3], h, n_q, d**-0.5), dict(HEAD_DIM=d, BLOCK=_ROW_BLOCK, num_warps=4))


_ROW_BLOCK = 64  # rows per program of the small tl kernels around the backward (D and zeroing, dQ from the sums)


def _row_grid(heads: int, n: int) -> tuple[int, int]:
    """The grid of the small tl kernels over ``heads`` x ``n`` rows: heads on the first axis, which takes up to
    2^31 - 1 programs, row blocks on the second (at most 65535, so up to some 4 million rows). With the heads on the
    second axis, a call of more than 65535 batch x heads failed to launch."""
    return heads, triton.cdiv(n, _ROW_BLOCK)


@triton.jit
def _delta_kernel(OUT, DO, DELTA, stride_oz, stride_oh, stride_on, stride_dz, stride_dh, stride_dn, H, N_Q, ACC,
                  HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ZERO_ACC: tl.constexpr = False):
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
    """(grid, positional arguments, keyword arguments) of ``_delta_kernel`` over (Z, H, N, d) O and dO, zeroing
    ``acc`` if given."""
    z, h, n_q, d = o4.shape
    return (_row_grid(z * h, n_q),
            (o4, do4, delta, *o4.stride()[:3], *do4.stride()[:3], h, n_q, delta if acc is None else acc),
            dict(HEAD_DIM=d, BLOCK=_ROW_BLOCK, ZERO_ACC=acc is not None, num_warps=4))


def backward(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, do4: torch.Tensor,
             dq4: torch.Tensor, dk4: torch.Tensor, dv4: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
             is_causal: bool, cfg: Config | None = None) -> None:
    """dQ, dK and dV into ``dq4``, ``dk4``, ``dv4`` with the fused backward, for views that ``fused`` accepted: D
    into ``delta`` (``_delta_kernel``), then ``_bwd_kernel`` over an fp32 scratch of dQ sums and zeroed flags."""
    bind_context(q4.device)
    z, h, n_q, d = q4.shape
    launch_compiled(_delta_kernel, *delta_args(o4, do4, delta))
    block = (cfg or FUSED_CONFIG).block
    n_qb = triton.cdiv(n_q, block)
    acc = torch.empty((z, h, n_qb * block, d), device=q4.device, dtype=torch.float32)
    flags = torch.zeros((z * h * n_qb,), device=q4.device, dtype=torch.int32)
    grid, args, kwargs = bwd_args(q4, k4, v4, do4, dq4, dk4, dv4, acc, flags, lse, delta, is_causal, cfg)
    launch_compiled(_bwd_kernel, grid, args, kwargs)


def forward(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, lse: torch.Tensor,
            is_causal: bool, cfg: Config | None = None) -> None:
    """O into ``o4`` and L into ``lse`` for (Z, H, N, d) views that ``usable`` accepted."""
    bind_context(q4.device)
    grid, args, kwargs = forward_args(q4, k4, v4, o4, lse, is_causal, cfg)
    launch_compiled(_fwd_kernel, grid, args, kwargs)


def dq(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, do4: torch.Tensor, dq4: torch.Tensor,
       lse: torch.Tensor, delta: torch.Tensor, is_causal: bool, cfg: Config | None = None) -> None:
    """dQ into ``dq4`` and D into ``delta`` for views that ``usable(..., kernel=DQ)`` accepted."""
    bind_context(q4.device)
    grid, args, kwargs = dq_args(q4, k4, v4, o4, do4, dq4, lse, delta, is_causal, cfg)
    launch_compiled(_dq_kernel, grid, args, kwargs)


def dkdv(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, do4: torch.Tensor, dk4: torch.Tensor,
         dv4: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, is_causal: bool, cfg: Config | None = None) -> None:
    """dK and dV into ``dk4``, ``dv4`` for views that ``usable(..., kernel=DKDV)`` accepted; reads the D that a dQ
    kernel (this module's or the tl one) wrote into ``delta``."""
    bind_context(q4.device)
    grid, args, kwargs = dkdv_args(q4, k4, v4, do4, dk4, dv4, lse, delta, is_causal, cfg)
    launch_compiled(_dkdv_kernel, grid, args, kwargs)


__all__ = ["DKDV", "DQ", "FWD", "HEAD_DIMS", "Config", "backward", "config", "dkdv", "dq", "forward", "fused",
           "kernels", "setting", "usable"]
