"""The Gluon FlashAttention kernels (``lmtrain.kernels.flash.gluon_*``, ``fused_bwd``).

Gluon kernels do not run under Triton's interpreter. On the CPU these tests check the configuration arithmetic and
the selection rules, and compile every default configuration for sm_90a (Triton compiles without a GPU): the
machine code must use warpgroup MMA (``HGMMA``), move registers to the consumers (``setmaxnreg``), fit shared
memory, and (two-consumer configurations) keep everything in registers. On a Hopper GPU (``-m gpu``) the kernels
are compared with the float64 reference of ``test_flash_attention`` on odd shapes, every output NaN-poisoned first.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
from test_flash_attention import (
    HAS_HOPPER,
    HAS_TRITON,
    _inputs,
    _reference_results,
    assert_matches_reference,
    flash_settings_fixture,  # noqa: F401 - the fixture flash_settings
    launch_into_poisoned,
)


def gluon_plan(*tensors):
    """The dispatcher's plan for (..., N, d) tensors q, k and the call's others, on their device."""
    from lmtrain.kernels.flash import dispatch
    from lmtrain.kernels.flash.api import _as_4d

    return dispatch.select(dispatch.call_of(*(_as_4d(t) for t in tensors)))


def gluon_picks(*tensors) -> list[bool]:
    """Whether the Gluon forward, dQ and dK/dV kernels serve these tensors (see ``gluon_plan``)."""
    plan = gluon_plan(*tensors)
    return [plan.fwd == "gluon", plan.dq == "gluon", plan.dkdv == "gluon"]


def gluon_modules():
    """The Gluon modules' names in one namespace (tuning, gluon_common, gluon_fwd, gluon_bwd, fused_bwd), the kernels
    also under their role: ``fwd_kernel``, ``dq_kernel``, ``dkdv_kernel``, ``bwd_atomic_kernel``."""
    from types import SimpleNamespace

    from lmtrain.kernels.flash import fused_bwd, gluon_bwd, gluon_common, gluon_fwd, tuning

    names = {}
    for module in (tuning, gluon_common, gluon_fwd, gluon_bwd, fused_bwd):
        names.update(vars(module))
    return SimpleNamespace(**names, fwd_kernel=gluon_fwd._flash_gluon_fwd, dq_kernel=gluon_bwd._flash_gluon_bwd_dq,
                           dkdv_kernel=gluon_bwd._flash_gluon_bwd_dkdv,
                           bwd_atomic_kernel=fused_bwd._flash_fused_bwd_atomic,
                           delta_kernel=fused_bwd._flash_bwd_delta, dq_convert_kernel=fused_bwd._flash_bwd_dq_convert)

requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
requires_hopper = pytest.mark.skipif(not (HAS_HOPPER and HAS_TRITON), reason="needs a Hopper GPU and Triton")


@requires_triton
def test_config_checks_and_parsing():
    from lmtrain.kernels.flash.tuning import Config

    assert Config.parse("3,128,2") == Config(3, 128, 2)
    assert Config(3, 128, 2).tile_rows == 192
    assert Config.parse("2,64,2,1,1") == Config(2, 64, 2, 1, 1)
    assert Config.parse("2,64,2,1,0,2") == Config(2, 64, 2, schedule=2)
    assert Config.parse("3,128,2,1,0,2,1") == Config(3, 128, 2, schedule=2, pingpong=1)
    for bad in ((4, 128, 2), (2, 96, 2), (2, 128, 0), (2, 128, 2, 1, 2), (2, 128, 2, 1, 0, 3), (2, 128, 2, 1, 0, 0, 2)):
        with pytest.raises(ValueError, match="num_wg 2 or 3"):
            Config(*bad)
    for bad in ("2,128", "2,128,2,1,1,1,1,1", "2,x,2"):
        with pytest.raises(ValueError, match=r"num_wg,block,num_stages\[,per_sm\[,reg_a\[,schedule\[,pingpong"):
            Config.parse(bad)


@requires_triton
@pytest.mark.parametrize("num_wg", [2, 3])
def test_registers_fill_the_register_file(num_wg):
    """One program per multiprocessor: all its warps' registers within 64K, the producer at 24, consumers as many as
    fit (multiples of 8)."""
    from lmtrain.kernels.flash.tuning import Config

    maxnreg, consumer = Config(num_wg, 128, 2).registers()
    warpgroups = num_wg + 1
    assert maxnreg % 8 == 0 and consumer % 8 == 0
    assert maxnreg * warpgroups * 128 <= 65536
    assert consumer * num_wg * 128 + 24 * 128 <= maxnreg * warpgroups * 128
    assert (consumer + 8) * num_wg * 128 + 24 * 128 > maxnreg * warpgroups * 128, "8 more would not fit"
    assert (maxnreg, consumer) == {2: (168, 240), 3: (128, 160)}[num_wg]


@requires_triton
def test_two_programs_per_multiprocessor_halve_the_registers():
    """per_sm=2: both programs' warpgroups within 64K registers, each program's producer at 24."""
    from lmtrain.kernels.flash.tuning import Config

    cfg = Config.parse("2,64,3,2")
    assert cfg == Config(2, 64, 3, per_sm=2)
    maxnreg, consumer = cfg.registers()
    assert 2 * maxnreg * 3 * 128 <= 65536 and consumer * 2 * 128 + 24 * 128 <= maxnreg * 3 * 128
    assert (maxnreg, consumer) == (80, 104)
    with pytest.raises(ValueError, match="per_sm 1 or 2"):
        Config(2, 64, 3, per_sm=3)


@requires_triton
def test_default_configurations_fit_shared_memory():
    fg = gluon_modules()

    for mode in (fg.FWD, fg.DQ, fg.DKDV):
        for d in fg.HEAD_DIMS:
            for n in (1024, 16384):
                cfg = fg.config(mode, d, n)
                assert cfg.smem_bytes(mode, d) <= fg._SMEM_LIMIT, (mode, d, n, cfg)
                if mode != fg.FWD:
                    assert cfg.num_stages >= 2, "the backward kernels release a block one block late"


@requires_triton
def test_paired_schedules_launch_shape(monkeypatch):
    """Schedule 0: one program per tile; 1: one per pair of tiles (a middle tile of an odd count alone); 2: one per
    multiprocessor (times per_sm), unless the last round would leave most programs idle, then one per tile, taken
    position by position where each head has at least four programs running at once."""
    from types import SimpleNamespace

    fg = gluon_modules()

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    cfg = fg.Config(2, 128, 3)
    assert fg._launch_shape(1025, 2, 3, cfg, None, cuda)[:2] == ((54,), 54)  # 9 tiles of 128 rows a head
    grid, tiles, options = fg._launch_shape(1025, 2, 3, fg.Config(2, 128, 3, schedule=1), None, cuda)
    assert (grid, tiles, options["ITEMS"]) == ((30,), 54, 1)  # 5 pairs a head
    for pairs, programs in ((8192, 132), (5504, 132), (688, None), (100, None)):
        assert fg._persistent_programs(fg.Config(2, 128, 3, schedule=2), pairs, cuda) == programs, pairs
    assert fg._persistent_programs(fg.Config(2, 64, 3, per_sm=2, schedule=2), 8192, cuda) == 264
    assert fg._persistent_programs(cfg, 8192, torch.device("cpu")) is None
    grid, tiles, options = fg._launch_shape(16384, 128, 1, fg.Config(2, 128, 3, schedule=2), None, cuda)
    assert (grid, tiles, options["ITEMS"]) == ((132,), 16384, 1)
    grid, _, options = fg._launch_shape(16384, 1, 16, fg.Config(3, 128, 2, schedule=2), None, cuda)
    assert (grid, options["ITEMS"]) == ((1376,), 2), "688 pairs: 5.2 rounds, one program per tile instead"
    # ... taken position by position with 16 heads (8 programs of each at once), head by head with 100
    grid, _, options = fg._launch_shape(4096, 1, 100, fg.Config(3, 128, 2, schedule=2), None, cuda)
    assert (grid, options["ITEMS"]) == ((2200,), 0), "1100 pairs: 8.3 rounds, one program per tile, head by head"
    assert fg._launch_shape(16384, 1, 16, fg.Config(2, 64, 3), None, cuda)[2]["ITEMS"] == 0, "schedule 0 asked for"


def _schedule_functions(pid: int, grid: int) -> dict:
    """The kernels' own tile-scheduling helpers (``_items``, ``_item_tile``, ``_tile_of``, ``_tile_coords``,
    ``_streamed``) as plain Python functions over integers, as program ``pid`` of ``grid`` runs them: their code
    objects, with ``gl``'s integer operations and the program's id and count standing in for Gluon's."""
    import types

    import triton

    fg = gluon_modules()

    gl = types.SimpleNamespace(cdiv=triton.cdiv, minimum=min, program_id=lambda axis: pid,
                               num_programs=lambda axis: grid, constexpr=object)
    names = ("_items", "_item_tile", "_tile_of", "_tile_coords", "_streamed")
    scope = dict(vars(fg), gl=gl)
    for name in names:
        fn = getattr(fg, name).fn
        scope[name] = types.FunctionType(fn.__code__, scope, name, fn.__defaults__)
    return {name: scope[name] for name in names}


def _program_tiles(pid: int, grid: int, num_tiles: int, n: int, block_t: int, items: int) -> list[int]:
    """The tiles program ``pid`` of ``grid`` works on, in order, as its producer and consumers loop over them
    (``items``: the kernels' ITEMS, 0 single tiles head by head, 1 pairs, 2 single tiles position by position)."""
    f = _schedule_functions(pid, grid)
    lo, hi, step = f["_items"](num_tiles, n, block_t, items)
    tiles = []
    for item in range(lo, hi, step):
        tile, valid = f["_item_tile"](item, n, num_tiles, block_t, items)
        if valid:
            tiles.append(tile)
    return tiles


@requires_triton
@pytest.mark.parametrize("n,block_t", [(1025, 128), (16384, 192), (333, 128), (97, 192), (4096, 128), (640, 128)])
def test_every_tile_done_once_by_any_grid(n, block_t):
    """Run as Python, the kernels' loops over work items give every tile of every head to exactly one program, for
    one program per tile, one per pair (the launch's grid) and persistent grids of any size, also where programs
    take unequal numbers of pairs; with pairs, a program's tiles come two by two from one head (the middle tile of
    an odd count alone); single tiles position by position go out every head's tile at position 0 first, then
    position 1, and so on."""
    import triton

    fg = gluon_modules()

    if not fg._HAS_GLUON:
        pytest.skip("needs Triton's Gluon")
    heads = 6
    per_head = triton.cdiv(n, block_t)
    num_tiles = per_head * heads
    pairs = (per_head + 1) // 2 * heads
    for items, grids in ((0, (num_tiles, 7, 1)), (2, (num_tiles, 7, 1)), (1, (pairs, pairs - 1, 7, 5, 3, 1))):
        for grid in grids:
            by_program = [_program_tiles(pid, grid, num_tiles, n, block_t, items) for pid in range(grid)]
            assert sorted(tile for tiles in by_program for tile in tiles) == list(range(num_tiles)), (items, grid)
            if items == 2 and grid == num_tiles:  # program p (launched p-th) takes head p % heads, position p // heads
                assert by_program == [[p % heads * per_head + p // heads] for p in range(grid)]
            if items != 1:
                continue
            for pid, tiles in enumerate(by_program):
                units = []
                while tiles:  # each pair: a head's position j then num - 1 - j (one tile where they coincide)
                    j = tiles[0] % per_head
                    size = 1 if 2 * j + 1 == per_head else 2
                    units.append(tiles[:size])
                    tiles = tiles[size:]
                for unit in units:
                    first = unit[0] % per_head
                    assert len({t // per_head for t in unit}) == 1, (grid, pid, unit)
                    assert [t % per_head for t in unit] == [first, per_head - 1 - first][:len(unit)], (grid, pid, unit)
                assert len(units) == len(range(pid, pairs, grid)), "pairs p, p + grid, ..."


class _Int32:
    """A 32-bit integer as ``_fast_div`` uses one: ``to`` (int32 / uint32, bitcast or not: the same bits), ``>>``
    (logical on uint32); ``_fast_div_run`` runs the kernel function's own code over these."""

    def __init__(self, value: int, unsigned: bool = False):
        self.unsigned = unsigned
        self.value = value % 2**32 if unsigned else (value + 2**31) % 2**32 - 2**31

    def to(self, dtype, bitcast: bool = False):
        return _Int32(self.value, dtype == "uint32")

    def __rshift__(self, other):
        assert self.unsigned and other.unsigned
        return _Int32(self.value >> other.value, True)


@functools.cache
def _fast_div_python():
    """``flash_gluon_hopper._fast_div``'s own code as a Python function over ``_Int32``, built once."""
    import types

    fg = gluon_modules()

    gl = types.SimpleNamespace(uint32="uint32", int32="int32", to_tensor=_Int32,
                               umulhi=lambda a, b: _Int32((a.value * b.value) >> 32, True),
                               where=lambda c, a, b: a if c else b)
    return types.FunctionType(fg._fast_div.fn.__code__, dict(vars(fg), gl=gl), "_fast_div")


def _fast_div_run(x: int, d: int, mul: int, shift: int) -> int:
    """``flash_gluon_hopper._fast_div``'s own code run over Python integers."""
    q = _fast_div_python()(_Int32(x), d, mul, shift)
    return q.value if isinstance(q, _Int32) else q


@requires_triton
def test_fast_divisor_divides_exactly():
    """``_fast_div``'s own code (run as Python over 32-bit integers) with ``fast_divisor``'s multiplier and shift
    gives x // d for every divisor tried (all up to 1500, powers of two and their neighbours, random ones up to
    2^31) and dividends at the ends of [0, 2^31) and around multiples of d; the multiplier fits a signed int32; bad
    divisors are refused."""
    import random

    fg = gluon_modules()

    if not fg._HAS_GLUON:
        pytest.skip("needs Triton's Gluon")
    rng = random.Random(0)
    divisors = [*range(1, 1500), *(2**k + e for k in range(1, 31) for e in (-1, 0, 1)),
                *(rng.randrange(1, 2**31) for _ in range(300))]
    for d in divisors:
        mul, shift = fg.fast_divisor(d)
        assert -(2**31) <= mul < 2**31 and 0 <= shift < 31, d
        xs = [0, 1, d - 1, d, d + 1, 7 * d - 1, 7 * d, 2**31 - 1, *(rng.randrange(0, 2**31) for _ in range(20))]
        for x in (x for x in xs if 0 <= x < 2**31):
            assert _fast_div_run(x, d, mul, shift) == x // d, (x, d)
    for bad in (0, -3, 2**31):
        with pytest.raises(ValueError):
            fg.fast_divisor(bad)


@requires_triton
@pytest.mark.parametrize("n,block_t,heads", [(1025, 128, 6), (16384, 192, 5), (97, 192, 1), (4096, 128, 16),
                                             (640, 128, 3), (333, 128, 7)])
def test_pair_tile_matches_item_tile_and_coords(n, block_t, heads):
    """Run as Python, the forward consumers' ``_pair_tile`` and ``_batch_head`` (with ``_fast_div``'s own code) give
    every work item of every program of a persistent grid the same (whether to do it, batch x head, batch, head,
    first row) as ``_item_tile`` (pairs) followed by ``_tile_coords``, causal (a head's tiles last to first) or
    not."""
    import types

    import triton

    fg = gluon_modules()

    if not fg._HAS_GLUON:
        pytest.skip("needs Triton's Gluon")
    per_head = triton.cdiv(n, block_t)
    num_tiles = per_head * heads
    pairs = (per_head + 1) // 2 * heads
    z = 2 if heads % 2 == 0 else 1
    h = heads // z
    for grid in (pairs, 7, 3):
        for pid in range(grid):
            f = _schedule_functions(pid, grid)
            scope = dict(f["_items"].__globals__)
            scope["_fast_div"] = _fast_div_run
            pair_tile = types.FunctionType(fg._pair_tile.fn.__code__, scope, "_pair_tile")
            batch_head = types.FunctionType(fg._batch_head.fn.__code__, scope, "_batch_head")
            lo, hi, step = f["_items"](num_tiles, n, block_t, 1)
            for item in range(lo, hi, step):
                tile, valid = f["_item_tile"](item, n, num_tiles, block_t, 1)
                for causal in (False, True):
                    ok, bh, start = pair_tile(item, n, block_t, causal, *fg.fast_divisor((per_head + 1) // 2))
                    assert bool(ok) == bool(valid), (grid, pid, item)
                    if valid:
                        got = (bh, *batch_head(bh, h, *fg.fast_divisor(h)), start)
                        assert got == tuple(f["_tile_coords"](tile, n, h, block_t, causal)), (grid, item)


@requires_triton
@pytest.mark.parametrize("block_t,block_s", [(128, 128), (192, 64), (128, 32), (192, 128)])
def test_causal_pairs_have_equal_work_and_streamed_ranges_are_exact(block_t, block_s):
    """Run as Python, the kernels' streamed ranges: the forward/dQ tile of queries [s, e) streams exactly the key
    blocks that hold a visible key, unmasked only where every query sees every key of the block; the dK/dV tile of
    keys streams every query block that sees one of them, masked wherever some query does not see some key. And the
    two tiles of every causal pair stream the same number of blocks, when N is a multiple of the tile rows."""
    from triton import cdiv

    fg = gluon_modules()

    if not fg._HAS_GLUON:
        pytest.skip("needs Triton's Gluon")
    f = _schedule_functions(0, 1)
    for n_q, n_k in ((1025, 1025), (257, 333), (333, 257), (97, 97), (2304, 2304)):
        for causal in (True, False):
            for tile in range(cdiv(n_q, block_t)):
                _, _, _, start = f["_tile_of"](tile, n_q, n_k, 1, block_t, causal, 0)
                first, end, boundary = f["_streamed"](start, n_q, n_k, block_t, block_s, causal, 0)
                last_q = min(start + block_t, n_q) - 1
                needed = cdiv(min(last_q + 1, n_k) if causal else n_k, block_s)
                # Causal with N_q < N_k, the last tile also streams the key blocks up to its rows' end, past N_q,
                # which no query sees (wholly masked: no effect on the result, and at most that one tile).
                assert first == 0 and end >= needed, (n_q, n_k, causal, start, end)
                assert end == needed or (causal and start + block_t > n_q), (n_q, n_k, causal, start, end)
                assert end == cdiv(min(start + block_t, n_k) if causal else n_k, block_s)
                for j in range(first, end):
                    whole = (j + 1) * block_s <= n_k and (not causal or (j + 1) * block_s - 1 <= start)
                    assert (j < boundary) == whole, f"block {j} of tile {start}: masked exactly when not all visible"
            for tile in range(cdiv(n_k, block_t)):
                _, _, _, start = f["_tile_of"](tile, n_q, n_k, 1, block_t, causal, 2)
                first, end, boundary = f["_streamed"](start, n_q, n_k, block_t, block_s, causal, 2)
                assert end == cdiv(n_q, block_s)
                assert first * block_s <= (start if causal else 0), "a query block that sees a key is streamed"
                if causal:
                    assert (first + 1) * block_s > start, "no query block that sees none of the keys"
                    assert boundary * block_s >= start + block_t - 1, "blocks past the boundary see every key"
    per_head = 12
    n = per_head * block_t
    work = []
    for pair in range(per_head // 2):
        blocks = 0
        for pos in (pair, per_head - 1 - pair):
            _, _, _, start = f["_tile_of"](pos, n, n, 1, block_t, True, 0)
            first, end, _ = f["_streamed"](start, n, n, block_t, block_s, True, 0)
            blocks += end - first
        work.append(blocks)
    assert len(set(work)) == 1, work


# ---------------------------------------------------------------------------------------------
# Compiled for sm_90a on the CPU
# ---------------------------------------------------------------------------------------------


def _compile_sm90(kernel, args: tuple, kwargs: dict):
    """Compile a Gluon kernel for compute capability 9.0 without a GPU (Triton's own binder and compiler)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton_compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def _compile_sm90_sass(kernel, args: tuple, kwargs: dict):
    """(compiled kernel, its SASS): ``_compile_sm90`` then Triton's bundled ``cuobjdump``; skips the test first where
    this Triton ships none."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("this Triton ships no cuobjdump")
    compiled = _compile_sm90(kernel, args, kwargs)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return compiled, sass


def _launches(d: int, n: int):
    """(name, kernel, config, grid/args/kwargs) of every kernel's default launch for CPU stand-in tensors."""
    fg = gluon_modules()

    q, k, v, o, do, dq, dk, dv = (torch.randn(2, 3, n, d, dtype=torch.bfloat16) for _ in range(8))
    lse, delta = torch.empty(6, n), torch.empty(6, n)
    return [
        ("forward", fg.fwd_kernel, fg.config(fg.FWD, d, n), fg.forward_args(q, k, v, o, lse, True, programs=132)),
        ("dq", fg.dq_kernel, fg.config(fg.DQ, d, n), fg.dq_args(q, k, v, o, do, dq, lse, delta, True, programs=132)),
        ("dkdv", fg.dkdv_kernel, fg.config(fg.DKDV, d, n),
         fg.dkdv_args(q, k, v, do, dk, dv, lse, delta, True, programs=132)),
    ]


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def _stationary_operands_overwritten(sass: str) -> list[str]:
    """The instructions that write a register which a warpgroup MMA with an untransposed second operand (the
    products of the stationary tiles: Q K^T, dO V^T, K Q^T, V dO^T) reads as its first operand, other than the
    shared-memory loads that fill those registers and the in-place XOR that renews them: ptxas has been seen to hand
    such registers to P^T and dS^T inside the loop while the next block still needs them."""
    instructions = _INSTRUCTION.findall(sass)
    first = set()
    for text in instructions:
        m = re.match(r"HGMMA\.\S+\s+R\d+,\s+R(\d+),\s+gdesc\[\w+\](\.tnspB)?", text)
        if m and not m.group(2):
            first.update(range(int(m.group(1)), int(m.group(1)) + 4))
    bad = []
    for text in instructions:
        m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s+R(\d+)\b", text)
        if m and int(m.group(2)) in first and not m.group(1).startswith(("LDSM", "HGMMA", "ST")):
            r = m.group(2)  # the renewing XOR takes the register in place, as either source operand
            if not re.match(rf"LOP3\.LUT R{r}, (R{r}, |R\d+(\.reuse)?, R{r}, )", text):
                bad.append(text)
    return bad


def test_overwritten_stationary_operands_are_found():
    """The check above on a hand-written excerpt: K loaded into R180..R183, read by Q K^T, then overwritten by P^T."""
    sass = """
        /*07e0*/                   LDSM.16.M88.4 R180, [R216+UR24+0x2000] ;
        /*1720*/                   HGMMA.64x64x16.F32.BF16 R24, R180, gdesc[UR12], RZ, !UPT ;
        /*2b60*/                   LOP3.LUT R183, R183, UR6, RZ, 0x3c, !PT ;
        /*2b70*/                   LOP3.LUT R182, R19.reuse, R182, RZ, 0x3c, !PT ;
        /*27a0*/                   HGMMA.64x64x16.F32.BF16 R120, R180, gdesc[UR20].tnspB, R120 ;
    """
    assert _stationary_operands_overwritten(sass) == []
    clobbered = sass + "        /*25f0*/                   F2FP.BF16.F32.PACK_AB R181, R7, R6 ;\n"
    assert _stationary_operands_overwritten(clobbered) == ["F2FP.BF16.F32.PACK_AB R181, R7, R6"]


_ADDRESSED = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
# Local-memory accesses a spill-free kernel may still have: scalars kept across a tile, stored and loaded once per
# tile, never in the block loop (with Triton 3.6: the head-dim-128 dK/dV kernel with 64-query blocks 8, the
# head-dim-64 one loading L and D itself at N_q 1025 10; with Triton 3.9 none).
_SPILLS_PER_TILE = 16


def _block_loop_spills(sass: str) -> list[str]:
    """The local-memory accesses (LDL, STL) inside a block loop: the innermost backward branch ranges of the SASS
    that hold a warpgroup MMA."""
    instructions = [(int(addr, 16), text) for addr, text in _ADDRESSED.findall(sass)]
    loops = []
    for addr, text in instructions:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)$", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    mmas = [addr for addr, text in instructions if "HGMMA" in text]
    with_mma = [(s, e) for s, e in loops if any(s <= a <= e for a in mmas)]
    inner = [(s, e) for s, e in with_mma
             if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in with_mma)]
    return [text for addr, text in instructions
            if re.search(r"\b(LDL|STL)\b", text) and any(s <= addr <= e for s, e in inner)]


def test_block_loop_spills_are_found():
    """The check above on a hand-written excerpt: a spill before the loop is allowed, one in it is found."""
    sass = """
        /*0370*/                   STL [R1+0x4], R0 ;
        /*1f80*/                   HGMMA.64x64x16.F32.BF16 R184, gdesc[UR56], RZ, !UPT ;
        /*2000*/                   IMAD.U32 R2, RZ, RZ, UR24 ;
        /*2010*/               @P1 BRA 0x1f80 ;
        /*3540*/                   LDL.LU R4, [R1] ;
    """
    assert _block_loop_spills(sass) == []
    spilled = sass.replace("IMAD.U32 R2, RZ, RZ, UR24", "LDL R2, [R1+0x8]")
    assert _block_loop_spills(spilled) == ["LDL R2, [R1+0x8]"]


def _check_machine_code(label: str, kernel, cfg, args: tuple, kwargs: dict, spill_free: bool = True):
    """Compile for sm_90a and check the SASS: warpgroup MMA, the setmaxnreg counts of ``cfg``, shared memory within
    what ``cfg.per_sm`` programs may share, (``spill_free``; the three-consumer forward excepted, which spills a few
    registers) no register spills in the block loops and at most ``_SPILLS_PER_TILE`` local-memory accesses in all,
    warpgroup MMAs not serialised (ptxas waits for each one when it cannot keep the registers of the products in
    flight), and the registers of stationary first operands never overwritten."""
    fg = gluon_modules()

    compiled, sass = _compile_sm90_sass(kernel, args, kwargs)
    assert "HGMMA" in sass, f"{label}: no warpgroup MMA in the machine code"
    _, consumer_regs = cfg.registers()
    counts = set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", compiled.asm["ptx"]))
    assert {str(consumer_regs), "24"} <= counts, f"{label}: register counts {counts}"
    assert compiled.metadata.shared <= fg._SMEM_LIMIT, f"{label}: {compiled.metadata.shared} bytes of shared memory"
    assert cfg.per_sm * (compiled.metadata.shared + 1024) <= fg._SMEM_PER_SM, f"{label}: {cfg.per_sm} do not fit"
    if spill_free and (cfg.num_wg == 2 or kernel is not fg.fwd_kernel):
        in_loop = _block_loop_spills(sass)
        assert not in_loop, f"{label}: register spills in the block loop: {in_loop[:3]}"
        spills = re.findall(r"\b(LDL|STL)\b", sass)
        assert len(spills) <= _SPILLS_PER_TILE, f"{label}: {len(spills)} local-memory accesses (register spills)"
        mmas, waits = sass.count("HGMMA"), sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0")
        assert 4 * waits < mmas, f"{label}: {waits} full waits for {mmas} warpgroup MMAs (serialised)"
    overwritten = _stationary_operands_overwritten(sass)
    assert not overwritten, f"{label}: stationary MMA operands overwritten by {overwritten[:3]}"
    return compiled


@requires_triton
@pytest.mark.slow
@pytest.mark.parametrize("d,n", [(64, 1024), (64, 16384), (128, 1024), (128, 16384)])
def test_default_kernels_compile_for_sm90a(d, n):
    pytest.importorskip("triton.experimental.gluon")
    fg = gluon_modules()

    for (name, kernel, cfg, (_, args, kwargs)), mode in zip(_launches(d, n), (fg.FWD, fg.DQ, fg.DKDV), strict=True):
        if n > 1024 and cfg == fg.config(mode, d, 1024):
            continue  # compiled by the N 1024 case
        _check_machine_code(f"{name} d={d} {cfg}", kernel, cfg, args, kwargs)


@requires_triton
def test_dkdv_statistics_copied_where_aligned(monkeypatch):
    """The dK/dV launch copies L and D into shared memory (descriptors over the statistics tensors themselves, so a
    launch plan finds them by role) where N_q is a multiple of 4 and both are 16-byte aligned; otherwise it passes
    the tensors for the consumers to load, and at head dim 128 takes the 32-query configuration that fits beside
    the loads, unless a configuration is named."""
    pytest.importorskip("triton.experimental.gluon")
    fg = gluon_modules()

    for d in (64, 128):
        for n, copied in ((1024, True), (100, True), (97, False), (1025, False)):
            q, k, v, do, dk, dv = (torch.randn(1, 2, n, d, dtype=torch.bfloat16) for _ in range(6))
            lse, delta = torch.randn(1, 2, n), torch.randn(2, n)
            _, args, kwargs = fg.dkdv_args(q, k, v, do, dk, dv, lse, delta, True)
            assert kwargs["SMEM_STATS"] is copied, (d, n)
            assert kwargs["BLOCK_M"] == (64 if copied or d == 64 else 32), (d, n)
            if copied:
                for desc, t in zip(args[6:8], (lse, delta), strict=True):
                    assert desc.base is t and desc.shape == [2, n] and desc.strides == [n, 1]
                    assert desc.block_shape == [1, kwargs["BLOCK_M"]]
            else:
                assert args[6] is lse and args[7] is delta
    n = 1024
    q, k, v, do, dk, dv = (torch.randn(1, 2, n, 128, dtype=torch.bfloat16) for _ in range(6))
    misaligned = torch.randn(2 * n + 1)[1:].view(2, n)
    _, args, kwargs = fg.dkdv_args(q, k, v, do, dk, dv, misaligned, torch.randn(2, n), True)
    assert not kwargs["SMEM_STATS"] and args[6] is misaligned and kwargs["BLOCK_M"] == 32
    from lmtrain.kernels.flash.settings import use_settings

    with use_settings(gluon_dkdv_config="2,64,2"):
        _, _, kwargs = fg.dkdv_args(q, k, v, do, dk, dv, misaligned, torch.randn(2, n), True)
    assert not kwargs["SMEM_STATS"] and kwargs["BLOCK_M"] == 64


@requires_triton
@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128])
def test_dkdv_with_loaded_statistics_compiles_for_sm90a(d):
    """The dK/dV kernel where the consumers load L and D (N_q 1025): the machine code checks above, global loads in
    the consumers; where the statistics are copied (N_q 1024) none at all."""
    pytest.importorskip("triton.experimental.gluon")
    fg = gluon_modules()

    loads = {}
    for n in (1025, 1024):
        q, k, v, do, dk, dv = (torch.randn(2, 3, n, d, dtype=torch.bfloat16) for _ in range(6))
        _, args, kwargs = fg.dkdv_args(q, k, v, do, dk, dv, torch.empty(6, n), torch.empty(6, n), True,
                                       programs=132)
        cfg = fg.Config(kwargs["NUM_WG"], kwargs["BLOCK_M"], kwargs["NUM_STAGES"])
        compiled = _check_machine_code(f"dkdv d={d} n={n}", fg.dkdv_kernel, cfg, args, kwargs)
        loads[n] = compiled.asm["ptx"].count("ld.global")
    assert loads[1025] > 0 and loads[1024] == 0, loads


@requires_triton
@pytest.mark.slow
def test_two_programs_per_multiprocessor_compile_for_sm90a():
    """The head-dim-64 forward and dQ kernels with two programs per multiprocessor (104 registers a consumer; the
    forward spills a few registers there, 16 bytes with Triton 3.6, which is one reason it is not a default)."""
    pytest.importorskip("triton.experimental.gluon")
    fg = gluon_modules()

    q, k, v, o, do, dq = (torch.randn(2, 3, 1024, 64, dtype=torch.bfloat16) for _ in range(6))
    lse, delta = torch.empty(6, 1024), torch.empty(6, 1024)
    fwd, dq_cfg = fg.Config.parse("2,64,3,2"), fg.Config.parse("2,32,3,2")
    _, args, kwargs = fg.forward_args(q, k, v, o, lse, True, fwd)
    _check_machine_code(f"forward {fwd}", fg.fwd_kernel, fwd, args, kwargs, spill_free=False)
    _, args, kwargs = fg.dq_args(q, k, v, o, do, dq, lse, delta, True, dq_cfg)
    _check_machine_code(f"dq {dq_cfg}", fg.dq_kernel, dq_cfg, args, kwargs)


@requires_triton
@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128])
def test_pingpong_compiles_for_sm90a(d):
    """Each kernel's N-16384 default with the consumers taking turns (``Config.pingpong``): the machine code checks
    above hold, and the PTX waits on one more barrier per turn than without (the turn), in every consumer's loop."""
    pytest.importorskip("triton.experimental.gluon")
    import dataclasses

    for name, kernel, cfg, (_, args, kwargs) in _launches(d, 16384):
        waits = {}
        for pingpong in (0, 1):
            turn_cfg = dataclasses.replace(cfg, pingpong=pingpong)
            turn_kwargs = dict(kwargs, PINGPONG=bool(pingpong))  # the launch's other arguments do not change
            if pingpong:
                compiled = _check_machine_code(f"{name} d={d} {turn_cfg}", kernel, turn_cfg, args, turn_kwargs)
            else:
                compiled = _compile_sm90(kernel, args, turn_kwargs)
            ptx = compiled.asm["ptx"]
            waits[pingpong] = ptx.count("mbarrier.try_wait")
        assert waits[1] > waits[0], f"{name} d={d}: {waits[1]} barrier waits with turns, {waits[0]} without"


@contextlib.contextmanager
def _deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` inside, the previous setting restored after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@requires_triton
@pytest.mark.slow
@pytest.mark.parametrize("d,n", [(64, 1025), (64, 4096), (128, 4096)])
def test_fused_backward_with_reductions_compiles_for_sm90a(d, n):
    """``_bwd_atomic_kernel``'s machine code: dQ's shares leave by TMA reductions (``cp.reduce.async.bulk.tensor``
    ... ``.add``), read dS^T transposed from shared memory; shared memory within one program's share; MMAs not
    serialised; at head dim 64 with L and D copied (N a multiple of 4, where it is the default) nothing spilled in the
    block loop (with them loaded, Triton 3.6 spills four accesses there)."""
    pytest.importorskip("triton.experimental.gluon")

    fg = gluon_modules()

    q, k, v, do, dk, dv = (torch.randn(2, 3, n, d, dtype=torch.bfloat16) for _ in range(6))
    lse, delta, acc = torch.empty(6, n), torch.empty(6, n), torch.empty(2, 3, n, d)
    _, args, kwargs = fg.bwd_atomic_args(q, k, v, do, dk, dv, acc, lse, delta, True)
    assert kwargs["SMEM_STATS"] == (n % 4 == 0) and kwargs["OUT_IN_SLOTS"] == (d == 128)
    compiled, sass = _compile_sm90_sass(fg.bwd_atomic_kernel, args, kwargs)
    ptx = compiled.asm["ptx"]
    assert re.search(r"cp\.reduce\.async\.bulk\.tensor\.4d\.global\.shared::cta\.add", ptx)
    assert compiled.metadata.shared <= fg._SMEM_LIMIT, compiled.metadata.shared
    mmas, waits = sass.count("HGMMA"), sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert mmas and 4 * waits < mmas, f"{waits} full waits for {mmas} warpgroup MMAs"
    assert "tnspA" in sass, "the dQ product reads dS^T transposed from shared memory"
    if d == 64 and n % 4 == 0:
        assert not _block_loop_spills(sass)


@requires_triton
def test_small_kernels_launch_for_many_heads():
    """The grid of the small tl kernels around the fused backward puts batch x heads on its first axis: CUDA allows
    at most 65535 programs on the second, and with the heads there a call of 70000 heads failed to launch."""
    fg = gluon_modules()

    o = torch.empty(1, 1, 97, 64).expand(70000, 1, 97, 64)
    grid, _, _ = fg.delta_args(o, o, torch.empty(70000, 97))
    assert grid == (70000, 2)
    assert fg._row_grid(3, 4_000_000)[1] <= 65535


@requires_triton
def test_delta_zeroes_sums_and_sums_convert_to_dq(tmp_path):
    """The fused backward's two small kernels, under Triton's interpreter (in a child process: it must be set before
    Triton is imported): ``_delta_kernel`` with ``ZERO_ACC`` writes D and zeros over NaN-poisoned sums, and
    ``_dq_convert_kernel`` scales the sums into a strided fp16 dQ, rows past N untouched."""
    script = tmp_path / "child.py"
    script.write_text(
        "import torch\n"
        "from lmtrain.kernels.flash import fused_bwd as fg\n"
        "g = torch.Generator().manual_seed(3)\n"
        "z, h, n, d = 2, 3, 97, 64\n"
        "o, do = (torch.randn(z, h, n, d, generator=g) for _ in range(2))\n"
        "delta = torch.full((z * h, n), float('nan'))\n"
        "acc = torch.full((z, h, n, d), float('nan'))\n"
        "grid, args, kwargs = fg.delta_args(o, do, delta, acc)\n"
        "fg._flash_bwd_delta[grid](*args, **kwargs)\n"
        "assert torch.allclose(delta, (o * do).sum(-1).reshape(z * h, n), atol=1e-5), 'D'\n"
        "assert torch.equal(acc, torch.zeros_like(acc)), 'sums not zeroed'\n"
        "acc = torch.randn(z, h, n, d, generator=g)\n"
        "dq = torch.full((z, n + 5, h, d), float('nan'), dtype=torch.float16)\n"
        "dq4 = dq[:, :n].transpose(1, 2)\n"
        "fg._flash_bwd_dq_convert[fg._row_grid(z * h, n)](acc, dq4, *dq4.stride()[:3], h, n, 0.125, HEAD_DIM=d, "
        "BLOCK=64)\n"
        "assert torch.allclose(dq4.float(), (acc * 0.125).half().float()), 'dQ'\n"
        "assert dq[:, n:].isnan().all(), 'rows past N written'\n"
        "print('checked')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and "checked" in result.stdout, result.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# On a Hopper GPU
# ---------------------------------------------------------------------------------------------

# (q shape, k shape, v from a fused qkv tensor): odd lengths, N_q != N_k both ways, fewer rows than one tile.
GLUON_SHAPES = [
    ((1, 2, 97, 64), (1, 2, 97, 64), False),
    ((2, 3, 1025, 128), (2, 3, 1025, 128), False),
    ((1, 2, 257, 64), (1, 2, 333, 64), False),
    ((1, 2, 333, 128), (1, 2, 257, 128), True),
    ((1, 1, 30, 128), (1, 1, 30, 128), False),
    ((2, 2, 1025, 64), (2, 2, 1025, 64), True),
    ((1, 1, 200, 64), (1, 1, 4100, 64), False),
]


def _gluon_shape_id(shapes) -> str:
    """Test id of a (q shape, k shape, v from a fused qkv tensor) case: q's shape, the key count, ``_fused``."""
    return "x".join(map(str, shapes[0])) + "_k" + str(shapes[1][-2]) + ("_fused" if shapes[2] else "")


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shapes", GLUON_SHAPES, ids=_gluon_shape_id)
def test_gpu_gluon_matches_reference(shapes, dtype, causal, flash_settings):
    """Forward and backward through the launchers with ``gluon="all"`` (the fused backward off), against float64."""
    from lmtrain.kernels.flash.api import _backward

    flash_settings(gluon="all", fused_backward="off")
    sq, sk, fused_v = shapes
    q, k, v, do = _inputs(sq, sk, dtype=dtype, device="cuda", seed=21, fused_v=fused_v)
    assert gluon_picks(q, k, v) == [True] * 3, "these inputs should take the Gluon kernels"
    out = launch_into_poisoned(q, k, v, do, causal)
    again = _backward(do, q, k, v, out["o"], out["lse"], causal)
    ref = _reference_results(q, k, v, do, causal, upcast=True)
    base = _reference_results(q, k, v, do, causal, upcast=False)
    assert_matches_reference(out, ref, base, dtype, f"Gluon {shapes} {dtype} causal={causal}")
    grads = (out["dq"], out["dk"], out["dv"])
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True)), "the backward is not deterministic"


@pytest.mark.gpu
@requires_hopper
def test_gpu_gluon_chosen_by_default_where_faster(flash_settings):
    """By default each Gluon kernel serves where its table says (the dispatcher's CPU tests check the table's
    reading); on this GPU the tensors' facts reach it: the Gluon kernels at head dims 64 and 128, not at 80. A list
    takes the kernels it names wherever they apply."""
    from lmtrain.kernels.flash import tuning

    def picks(n, d):
        x = torch.randn(1, 2, n, d, device="cuda", dtype=torch.bfloat16)
        return gluon_picks(x, x)

    for n, d in ((1024, 64), (4096, 64), (1024, 128)):
        x = torch.randn(1, 2, n, d, device="cuda", dtype=torch.bfloat16)
        assert gluon_plan(x, x).fwd == ("gluon" if tuning.step(tuning.FWD, d, n)[2] else "tma")
    assert picks(4096, 80) == [False] * 3
    flash_settings(gluon="dq")
    assert picks(1024, 64) == [False, True, False]
    flash_settings(gluon="off")
    assert picks(4096, 128) == [False] * 3


PAIRED = {  # per head dim, configurations with the paired schedules (1: one program per pair, 2: persistent)
    "d64": (64, {"gluon_fwd_config": "2,128,3,1,0,2", "gluon_dq_config": "3,64,3,1,0,2",
                 "gluon_dkdv_config": "2,64,3,1,1,2"}),
    "d64_three_wg": (64, {"gluon_fwd_config": "3,128,2,1,0,1", "gluon_dq_config": "2,128,3,1,0,1",
                          "gluon_dkdv_config": "3,32,3,1,1,2"}),
    "d128": (128, {"gluon_fwd_config": "3,64,3,1,0,2", "gluon_dq_config": "2,128,2,1,0,2",
                   "gluon_dkdv_config": "2,32,2,1,0,2"}),
    # Consumers taking turns (the seventh field), two and three of them, all three schedules.
    "d64_pingpong": (64, {"gluon_fwd_config": "3,128,2,1,0,2,1", "gluon_dq_config": "3,64,3,1,0,1,1",
                          "gluon_dkdv_config": "2,64,3,1,1,0,1"}),
    "d128_pingpong": (128, {"gluon_fwd_config": "2,128,2,1,0,2,1", "gluon_dq_config": "2,128,2,1,0,0,1",
                            "gluon_dkdv_config": "2,32,2,1,0,2,1"}),
    # 64-key blocks in the forward: the first consumer's rows pass the tile's last key block on unread.
    "d64_fwd_64_keys": (64, {"gluon_fwd_config": "2,64,3,1,0,2"}),
}


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n_q,n_k", [(1025, 1025), (257, 333), (333, 257), (97, 97)])
@pytest.mark.parametrize("case", list(PAIRED))
def test_gpu_gluon_paired_schedules_match_reference(case, n_q, n_k, causal, flash_settings, monkeypatch):
    """Tiles in pairs (a head's j-th longest with its j-th shortest), persistent programs forced to 7, so that at N
    1025 and 257/333 each takes several pairs and some one more than others; odd tile counts (9 tiles of 128 rows
    in 1025) included: against float64 (bf16), NaN-poisoned outputs, the backward deterministic. With more queries
    than keys (333/257) the causal forward's consumers see different numbers of key blocks (``n_mine``), and the
    last query rows every key."""
    from lmtrain.kernels.flash import gluon_common
    from lmtrain.kernels.flash.api import _backward

    d, configs = PAIRED[case]
    flash_settings(gluon="all", fused_backward="off", launch_plans="off", **configs)
    monkeypatch.setattr(gluon_common, "_persistent_programs", lambda cfg, pairs, device: 7)
    q, k, v, do = _inputs((2, 3, n_q, d), (2, 3, n_k, d), dtype=torch.bfloat16, device="cuda", seed=24)
    out = launch_into_poisoned(q, k, v, do, causal)
    again = _backward(do, q, k, v, out["o"], out["lse"], causal)
    ref = _reference_results(q, k, v, do, causal, upcast=True)
    base = _reference_results(q, k, v, do, causal, upcast=False)
    assert_matches_reference(out, ref, base, torch.bfloat16, f"Gluon {case} {n_q}x{n_k} causal={causal}")
    grads = (out["dq"], out["dk"], out["dv"])
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True)), "the backward is not deterministic"


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("setting,configs", [("dq", {}), ("fwd,dkdv", {}),
                                         ("all", {"gluon_fwd_config": "2,64,3,2",
                                                  "gluon_dq_config": "2,32,3,2"})],
                         ids=["gluon_dq_tl_dkdv", "tl_dq_gluon_dkdv", "two_per_sm"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_gluon_mixed_with_tl_kernels(setting, configs, causal, flash_settings):
    """A backward whose dQ kernel (which writes D) and dK/dV kernel (which reads it) come from different paths, and
    the two-programs-per-multiprocessor configurations, against float64 (head dim 64, N 1025, bf16)."""
    flash_settings(gluon=setting, fused_backward="off", **configs)
    q, k, v, do = _inputs((2, 3, 1025, 64), (2, 3, 1025, 64), dtype=torch.bfloat16, device="cuda", seed=23)
    picked = gluon_picks(q, k)
    assert picked == {"dq": [False, True, False], "fwd,dkdv": [True, False, True], "all": [True] * 3}[setting]
    out = launch_into_poisoned(q, k, v, do, causal)
    ref = _reference_results(q, k, v, do, causal, upcast=True)
    base = _reference_results(q, k, v, do, causal, upcast=False)
    assert_matches_reference(out, ref, base, torch.bfloat16, f"Gluon {setting} {configs} causal={causal}")


@pytest.mark.gpu
@requires_hopper
def test_gpu_gluon_backward_in_autograd_threads(flash_settings):
    """Autograd runs the backward in its own threads, where the descriptors need a current CUDA context."""
    from lmtrain.kernels.flash.api import flash_attention

    flash_settings(gluon="all", fused_backward="off")
    q, k, v, do = _inputs((2, 4, 1000, 128), (2, 4, 1000, 128), torch.bfloat16, device="cuda", seed=22)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attention(*leaves, causal=True).backward(do)
    ref = _reference_results(q, k, v, do, True, upcast=True)
    base = _reference_results(q, k, v, do, True, upcast=False)
    out = {"dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    assert_matches_reference(out, ref, base, torch.bfloat16, "Gluon through autograd")


FUSED_SHAPES = [((1, 2, 97, 64), (1, 2, 97, 64), False), ((2, 3, 1025, 64), (2, 3, 1025, 64), False),
                ((1, 2, 257, 64), (1, 2, 333, 64), False), ((1, 2, 333, 64), (1, 2, 257, 64), True),
                ((1, 1, 30, 64), (1, 1, 30, 64), False), ((1, 1, 200, 64), (1, 1, 4100, 64), False),
                ((1, 1, 4100, 64), (1, 1, 200, 64), False)]
# The fused backward with reductions also at head dim 128 (N_q a multiple of 4) and without the causal mask.
REDUCTION_SHAPES = FUSED_SHAPES + [((1, 2, 1028, 128), (1, 2, 1028, 128), False),
                                   ((1, 2, 260, 128), (1, 2, 332, 128), True),
                                   ((1, 1, 4100, 128), (1, 1, 200, 128), False)]


def _fused_run(shapes, dtype, causal: bool, flash_settings):
    """Inputs of ``shapes``, checked to take the fused backward (``fused_backward="on"``), run into NaN-poisoned
    buffers and compared with float64: (q, k, v, dO, outputs, reference, same-dtype reference)."""
    flash_settings(fused_backward="on")
    sq, sk, fused_v = shapes
    q, k, v, do = _inputs(sq, sk, dtype=dtype, device="cuda", seed=32, fused_v=fused_v)
    assert gluon_plan(q, k, v).fused, "these inputs should take the fused backward"
    out = launch_into_poisoned(q, k, v, do, causal)
    ref = _reference_results(q, k, v, do, causal, upcast=True)
    base = _reference_results(q, k, v, do, causal, upcast=False)
    assert_matches_reference(out, ref, base, dtype, f"fused backward {shapes} {dtype} causal={causal}")
    return q, k, v, do, out, ref, base


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shapes", REDUCTION_SHAPES, ids=_gluon_shape_id)
def test_gpu_fused_backward_with_reductions_matches_reference(shapes, dtype, causal, flash_settings):
    """The fused backward with TMA reductions (``fused_backward="on"``) against float64 into NaN-poisoned buffers,
    and a second run (its sums added in another order) as close."""
    from lmtrain.kernels.flash.api import _backward

    q, k, v, do, out, ref, base = _fused_run(shapes, dtype, causal, flash_settings)
    dq, dk, dv = _backward(do, q, k, v, out["o"], out["lse"], causal)
    assert_matches_reference({**out, "dq": dq, "dk": dk, "dv": dv}, ref, base, dtype, "second run")


@pytest.mark.gpu
@requires_hopper
def test_gpu_reductions_by_default_unless_deterministic(flash_settings):
    """Head dim 64 at 4096 keys: by default the fused backward with reductions, through autograd and then from a
    launch plan (its sums a role of the plan), both against float64; with deterministic algorithms requested, the
    dQ and dK/dV kernels, the same bits twice."""
    from lmtrain.kernels.flash import FlashSettings
    from lmtrain.kernels.flash import launch_plans as _launch_plans
    from lmtrain.kernels.flash.api import flash_attention

    flash_settings(**FlashSettings().as_dict())  # the defaults
    q, k, v, do = _inputs((1, 2, 4096, 64), (1, 2, 4096, 64), torch.bfloat16, device="cuda", seed=33)
    assert gluon_plan(q, k).fused
    ref = _reference_results(q, k, v, do, True, upcast=True)
    base = _reference_results(q, k, v, do, True, upcast=False)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*leaves, causal=True)
        out.backward(do)
        return {"o": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}

    replayed = _launch_plans.STATS["replayed"]
    for run in range(3):
        assert_matches_reference(grads(), ref, base, torch.bfloat16, f"default, run {run}")
    assert _launch_plans.STATS["replayed"] > replayed, "no call was replayed from a plan"
    with _deterministic_algorithms():
        assert not gluon_plan(q, k).fused
        first, second = grads(), grads()
    assert all(torch.equal(first[name], second[name]) for name in ("dq", "dk", "dv")), "not deterministic"
