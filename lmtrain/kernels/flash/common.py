"""Pieces shared by the pointer kernels (``pointer``) and the TMA kernels (``tma``): autotuning (candidate pruning,
the tuning clock, the launch cache) and the ``@triton.jit`` helpers that map programs to blocks and mask scores.

Kept apart so that each kernel module imports this one and neither imports the other's internals.
"""


import torch
import triton
import triton.language as tl

from lmtrain.kernels import triton_interpreted
from lmtrain.kernels.flash import launch_plans as _plans
from lmtrain.kernels.flash.settings import current

_INTERPRET = triton_interpreted()
_LOG2E = 1.4426950408889634


def _autotune_enabled() -> bool:
    return not _INTERPRET and current().autotune


def _tuning_bench(fn, quantiles=None, warmup_ms: float = 25.0, rep_ms: float = 100.0, **_ignored) -> list[float]:
    """Time one candidate configuration for the autotuner: ``triton.testing.do_bench``'s method and contract
    (milliseconds at ``quantiles``), with one difference: the buffer written between runs to evict the inputs from
    the L2 cache has the L2's size (50 MB on an H100) instead of a fixed 256 MB. Tuning happens inside the first
    training step, when activations are live, so that buffer adds to the step's memory peak.
    """
    dev = torch.cuda.current_device()
    l2_bytes = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 64 * 2**20
    fn()
    torch.cuda.synchronize()
    flush = torch.empty(l2_bytes // 4, dtype=torch.int32, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    n_rep = max(1, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for s, e in zip(starts, ends, strict=True):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    del flush
    times = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)], dtype=torch.float64)
    qs = (0.5,) if quantiles is None else tuple(quantiles)
    return torch.quantile(times, torch.tensor(qs, dtype=torch.float64)).tolist()


def _prune(held: str, configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop configurations that cannot fit: fp32 accumulators of the held block in registers, tiles in shared memory.

    Args:
        held: which block size is held for the whole program ("BLOCK_M" for forward and dQ, "BLOCK_N" for dK/dV).
    """
    block_d = kwargs["BLOCK_D"] + kwargs.get("BLOCK_D1", 0)  # a split head dim's two tiles (the TMA kernels)
    q = named_args["Q"]
    elt = getattr(q, "base", q).element_size()  # a tensor, or a tensor descriptor (the TMA kernels)
    kept = []
    for cfg in configs:
        bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
        held_rows = cfg.kwargs[held]
        if held == "BLOCK_M" and bm % bn != 0 or held == "BLOCK_N" and bn % bm != 0:
            continue  # the diagonal must fall on whole iterated blocks
        n_acc = 2 if held == "BLOCK_N" else 1  # dK and dV accumulators vs one O or dQ accumulator
        if n_acc * held_rows * block_d > 4096 * cfg.num_warps:  # > 128 fp32 accumulator registers per thread
            continue
        streamed = bn if held == "BLOCK_M" else bm
        smem = (held_rows * block_d + 2 * streamed * block_d * max(cfg.num_stages, 1)) * elt
        if smem > 200 * 1024:
            continue
        kept.append(cfg)
    if elt == 4 and kwargs["DOT_PRECISION"] == "ieee":
        # IEEE fp32 products run on CUDA cores, not tensor cores: small tiles compile in seconds, not minutes.
        kept = [cfg for cfg in kept if cfg.kwargs["BLOCK_M"] * cfg.kwargs["BLOCK_N"] <= 64 * 32]
    if not kept:
        kept = [configs[-1]]  # the smallest: always fits
    if not _autotune_enabled():
        kept = kept[:1]
    return kept


def _prune_held_m(configs, named_args, **kwargs):
    return _prune("BLOCK_M", configs, named_args, **kwargs)


def _prune_held_n(configs, named_args, **kwargs):
    return _prune("BLOCK_N", configs, named_args, **kwargs)


_TUNE_KEY = ["N_KEY", "HEAD_DIM", "IS_CAUSAL", "DOT_PRECISION"]
_NO_SPECIALIZE = ["H", "N_Q", "N_K", "N_KEY"]


# (kernel, N_KEY, HEAD_DIM, IS_CAUSAL, DOT_PRECISION, dtype of Q) -> the configuration the autotuner chose: the
# autotuner's own key (its key fields plus the tensors' dtypes; L and Delta are always fp32).
_CHOSEN: dict[tuple, triton.Config] = {}


def _launch(kernel, grid, args: tuple, consts: dict, key: tuple) -> None:
    """``kernel[grid](*args, **consts)`` for an autotuned kernel. The autotuner runs until it has chosen a
    configuration for ``key``; later calls launch the JIT function with that configuration directly (through
    ``launch_compiled``, which records the launch for a launch plan), skipping the autotuner's per-call Python.

    Args:
        grid: a tuple, or a function of the configuration's meta-parameters, as for ``kernel[grid]``.
        key: the tuning key (see ``_CHOSEN``).
    """
    cfg = _CHOSEN.get((kernel, *key))
    if cfg is None:
        _plans.unrecordable()
        kernel[grid](*args, **consts)
        chosen = getattr(kernel, "best_config", None)  # set by every autotuned launch
        if chosen is not None:
            _CHOSEN[(kernel, *key)] = chosen
        return
    kwargs = {**consts, **cfg.all_kwargs()}
    if cfg.pre_hook is not None:  # what the autotuner does before each launch (the TMA kernels set their boxes)
        cfg.pre_hook({**dict(zip(kernel.arg_names, args, strict=False)), **kwargs})
    _plans.launch_compiled(kernel.fn, grid(cfg.kwargs) if callable(grid) else grid, args, kwargs)


@triton.jit
def _keep(offs_m, n_idx, N_K, IS_CAUSAL: tl.constexpr):
    """(BLOCK_M, BLOCK_N) mask of the scores that exist: key in range and, if causal, not after the query."""
    keep = n_idx[None, :] < N_K
    if IS_CAUSAL:
        keep = keep & (offs_m[:, None] >= n_idx[None, :])
    return keep


@triton.jit
def _block_of(pid, N, H, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """(batch x head index, batch, head, first row) of program ``pid`` in a grid of cdiv(N, BLOCK) programs per
    (batch, head), all int32; REVERSE takes the blocks of a head last to first."""
    num = tl.cdiv(N, BLOCK)
    bh = pid // num
    blk = pid % num
    if REVERSE:
        blk = num - 1 - blk
    return bh, bh // H, bh % H, blk * BLOCK


@triton.jit
def _query_block(N_Q, H, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """This program's (batch x head index, batch, head, first query row) for kernels with one program per query
    block, batch and head as int64 (pointer offsets). Causal programs take the longest rows first (reverse block
    order) so the short ones fill the tail."""
    bh, z, h, start_m = _block_of(tl.program_id(0), N_Q, H, BLOCK_M, IS_CAUSAL)
    return bh, z.to(tl.int64), h.to(tl.int64), start_m


@triton.jit
def _softmax_step(qk, l_i, m_i, qk_scale):
    """One online-softmax step on the scores ``qk`` (log2 domain after ``qk_scale``): (P, the factor alpha that
    rescales the old sums, the new row sums l, the new row maxima m)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _key_range(start_m, N_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """For the query block starting at ``start_m``: (end of the whole key blocks that need no mask, end of the keys
    it sees). Causal blocks skip the key blocks above the diagonal."""
    if IS_CAUSAL:
        return tl.minimum(start_m, (N_K // BLOCK_N) * BLOCK_N), tl.minimum(start_m + BLOCK_M, N_K)
    return (N_K // BLOCK_N) * BLOCK_N, N_K
