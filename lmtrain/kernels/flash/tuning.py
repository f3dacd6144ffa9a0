"""Tuning of the Gluon FlashAttention kernels: launch configurations and where each kernel serves by default.

The tables say, per kernel and head dim, which configuration runs from how many keys on, and whether the Gluon
kernel is the default there (where it is not, the TMA kernel of the same job measured faster). They come from sweeps
on an H100 (bf16, causal, batch x heads x N = 2^21); the dispatcher (``lmtrain.kernels.flash.dispatch``) reads them.
This module imports neither Triton nor torch, so the dispatcher can explain a device's kernels without either.
"""

from __future__ import annotations

import dataclasses
import functools
import re


@functools.cache
def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton; (0, 0) without Triton."""
    import sys
    from importlib import metadata

    module = sys.modules.get("triton")
    text = getattr(module, "__version__", None)
    for dist in ("triton", "pytorch-triton"):
        if text is None:
            try:
                text = metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
    numbers = [int(x) for x in re.findall(r"\d+", text or "0.0")[:2]] + [0, 0]
    return numbers[0], numbers[1]


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
# the key count applying; where a step says False the TMA kernel runs by default (it measured faster there) and the
# configuration serves ``gluon="all"``. Persistent pairs (schedule 2) gained in every forward cell and most dQ cells;
# the dK/dV kernel gained from them at 1024 keys only. The d 64 dQ kernel from 4096 keys is the three-consumer one,
# which is also the faster where the launcher falls back to one program per tile. The d 128 dK/dV kernel streams
# 64-query blocks, persistent, since its L and D come through shared memory (registers freed; 1.11-1.17x the
# 32-query blocks with the same copies).
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
# reg_a in the table applies with the Triton it was measured and checked with (3.6: no spills); Triton 3.9 spills
# with it (dK/dV at head dim 64: 177 local-memory accesses), so newer versions take the same configuration without it.
_REG_A_DEFAULTS = triton_version() <= (3, 6)


def step(kernel: int, head_dim: int, n_keys: int) -> tuple[int, Config, bool]:
    """The step of ``_TABLE`` that applies to ``kernel`` at ``head_dim`` and ``n_keys`` keys: (from this many keys
    on, configuration, whether the Gluon kernel serves by default)."""
    return [step for step in _TABLE[(kernel, head_dim)] if n_keys >= step[0]][-1]


def config(kernel: int, head_dim: int, n_keys: int = 0, loads: bool = False,
           override: Config | None = None) -> Config:
    """The configuration of ``kernel`` (FWD, DQ or DKDV) for ``head_dim`` and ``n_keys`` keys; ``loads`` (dK/dV):
    the consumers load L and D themselves (``_rows_aligned`` false), which takes ``_DKDV_LOADS``'s configuration
    where it has one for the head dim. ``override`` (a configuration the settings name,
    ``FlashSettings.gluon_config``) replaces it."""
    if override is not None:
        return override
    cfg = _DKDV_LOADS.get(head_dim) if loads and kernel == DKDV else None
    cfg = cfg or step(kernel, head_dim, n_keys)[1]
    return cfg if _REG_A_DEFAULTS or not cfg.reg_a else dataclasses.replace(cfg, reg_a=0)


# Head dim -> from this many keys on, the fused backward with TMA reductions is the default: it measured faster than
# the dQ and dK/dV kernels there, and slower below (1024 keys: 1.07x their time at head dim 64, 1.19x at 128).
FUSED_FROM = {64: 4096, 128: 4096}
