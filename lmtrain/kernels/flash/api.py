"""FlashAttention-2 for PyTorch: the autograd function, the custom ops and the launches of one call.

``flash_attention(q, k, v, causal=True)`` / ``FlashAttentionTriton.apply(q, k, v, is_causal)`` run the forward and
backward kernels that ``dispatch.select`` chooses for the call (Gluon, TMA or pointer kernels; see
``lmtrain.kernels.flash.dispatch.explain``), through a launch plan where an earlier call had the same shapes
(``launch_plans``).

Dtypes fp16, bf16, fp32; q (..., N_q, d), k and v (..., N_k, d) with the same leading dims; any sequence lengths;
head dims 1..256. Strided inputs (heads of a fused qkv projection) are read without copies when their last dim is
contiguous. Causal masks are top-left aligned (query i sees keys 0..i). The backward is deterministic (no atomics)
except the fused backward, which serves by default on sm_90 at head dims 64 and 128 from 4096 keys and sums dQ in
any order; ``torch.use_deterministic_algorithms(True)`` keeps every call to kernels without atomics.

Limits: no dropout, no attention bias or arbitrary masks, no grouped-query attention (k and v must have q's leading
dims), d of v equal to d of q, at least one key. The logsumexp output of the custom op is not differentiable.
"""

import dataclasses

import torch
import triton

from lmtrain.kernels.flash import dispatch as _dispatch
from lmtrain.kernels.flash import fused_bwd, gluon_bwd, gluon_fwd, pointer, tma
from lmtrain.kernels.flash import launch_plans as _plans
from lmtrain.kernels.flash.common import _INTERPRET
from lmtrain.kernels.flash.gluon_common import bind_context
from lmtrain.kernels.flash.pointer import _n_key

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_POINTER = (_dispatch.POINTER, _dispatch.POINTER)


# ---------------------------------------------------------------------------------------------
# Inputs, buffers and the launches of one call
# ---------------------------------------------------------------------------------------------


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, check_device: bool = True) -> None:
    """Raise a ValueError naming the argument at fault for shapes, dtypes and devices the kernels do not serve."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"flash_attention: {name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.ndim < 2:
            raise ValueError(f"flash_attention: {name} must have shape (..., N, d), got {tuple(t.shape)}.")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"flash_attention: {name} has dtype {t.dtype}; use float16, bfloat16 or float32.")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            f"flash_attention: q, k, v must have the same leading (batch, head) dims, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}; repeat k/v heads for grouped-query attention."
        )
    if k.shape != v.shape or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"flash_attention: k and v must have shape (..., N_k, d) with q's head dim d, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    d = q.shape[-1]
    if not 1 <= d <= _MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head dim {d} is not supported; use 1..{_MAX_HEAD_DIM}.")
    if k.shape[-2] == 0:
        raise ValueError("flash_attention: k and v have no keys (N_k = 0); attention needs at least one key.")
    if not check_device:
        return
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k, v are on different devices: {q.device}, {k.device}, {v.device}.")
    if q.device.type != "cuda" and not _INTERPRET:
        raise ValueError(
            f"flash_attention: tensors are on {q.device}; the Triton kernels need CUDA tensors "
            "(on CPU use flash_attention_pytorch, or set TRITON_INTERPRET=1 before importing this module, for tests)."
        )


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    """View (..., N, d) as (Z, H, N, d) with unit stride on d, copying only when no such view exists."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.ndim == 2:
        return x[None, None]
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4:
        return x
    return x.reshape(-1, *x.shape[-3:])


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of t's shape, dtype and device (O and the gradients are written densely)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _per_row(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A new fp32 tensor of one value per query row: the logsumexp L, or D."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _device_guard(x: torch.Tensor):
    """Make x's GPU the current one for the launch (a no-op context when it already is, or off CUDA)."""
    if x.device.type == "cuda" and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return _NULL_CONTEXT


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


_NULL_CONTEXT = _NullContext()


def _dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    """Triton dot input precision; only fp32 inputs are affected."""
    return "tf32" if (allow_tf32 and dtype == torch.float32) else "ieee"


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    allow_tf32: bool = False,
    o: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel the dispatcher selects. Returns (O, L): O like q (contiguous), L fp32 of shape
    q.shape[:-1].

    ``o`` and ``lse`` may be given (contiguous, right shape) so that tests can pre-fill them with NaN.
    """
    plan_key = _plans.key("fwd", (q, k, v), bool(is_causal), bool(allow_tf32)) if o is None and lse is None else None
    plan = _plans.get(plan_key)
    if plan is not None:  # a call like an earlier one: its launches again, over these tensors (see launch_plans)
        o, lse = _dense(q), _per_row(q.shape[:-1], q.device)
        with _device_guard(q):
            bind_context(q.device)
            plan.run((_as_4d(q), _as_4d(k), _as_4d(v), _as_4d(o), lse))
        return o, lse
    _check_inputs(q, k, v)
    if o is None:
        o = _dense(q)
    if lse is None:
        lse = _per_row(q.shape[:-1], q.device)
    if o.shape != q.shape or not o.is_contiguous() or lse.shape != q.shape[:-1] or not lse.is_contiguous():
        raise ValueError("flash_attention: o and lse buffers must be contiguous with shapes q.shape and q.shape[:-1].")
    q4, k4, v4, o4 = _as_4d(q), _as_4d(k), _as_4d(v), _as_4d(o)
    z, h, n_q, d = q4.shape
    if z * h == 0 or n_q == 0:
        return o, lse
    precision = _dot_precision(q.dtype, allow_tf32)
    consts = dict(HEAD_DIM=d, BLOCK_D=_block_d(d), IS_CAUSAL=bool(is_causal), DOT_PRECISION=precision)
    key = (_n_key(n_q, k4.shape[2]), d, bool(is_causal), precision, q.dtype)
    chosen = _dispatch.select(_dispatch.call_of(q4, k4, v4, o4)).fwd
    with _device_guard(q), _plans.recording(plan_key) as launches:
        if chosen == _dispatch.GLUON:
            gluon_fwd.forward(q4, k4, v4, o4, lse, bool(is_causal))
        elif chosen == _dispatch.TMA:
            tma.forward(q4, k4, v4, o4, lse, consts, key)
        else:
            pointer.forward(q4, k4, v4, o4, lse, consts, key)
    _plans.store(plan_key, launches, (q4, k4, v4, o4, lse))
    return o, lse


def _backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    allow_tf32: bool = False,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels the dispatcher selects: a dQ kernel that also writes D, then a dK/dV kernel; or
    the fused backward. Returns (dQ, dK, dV), contiguous, in the input dtype."""
    buffers_given = dq is not None or dk is not None or dv is not None
    # Deterministic algorithms requested or not is part of the key: it decides whether the fused backward may run.
    plan_key = None if buffers_given else _plans.key("bwd", (do, q, k, v, o, lse), bool(is_causal), bool(allow_tf32),
                                                     torch.are_deterministic_algorithms_enabled())
    plan = _plans.get(plan_key)
    if plan is not None:  # a call like an earlier one: its launches again, over these tensors (see launch_plans)
        return _replay_backward(plan, do, q, k, v, o, lse)
    _check_inputs(q, k, v)
    if do.shape != q.shape:
        raise ValueError(f"flash_attention: grad of O has shape {tuple(do.shape)}, expected {tuple(q.shape)}.")
    do = do.to(q.dtype)
    dq = _dense(q) if dq is None else dq
    dk = _dense(k) if dk is None else dk
    dv = _dense(v) if dv is None else dv
    for name, buf, ref in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if buf.shape != ref.shape or not buf.is_contiguous():
            raise ValueError(f"flash_attention: {name} buffer must be contiguous with shape {tuple(ref.shape)}.")
    q4, k4, v4, o4, do4 = _as_4d(q), _as_4d(k), _as_4d(v), _as_4d(o), _as_4d(do)
    dq4, dk4, dv4 = _as_4d(dq), _as_4d(dk), _as_4d(dv)
    call = _dispatch.call_of(q4, k4, v4, o4, dq4, dk4, dv4)
    do_copied = False
    first = _dispatch.select(call) if call.aligned and not _dispatch.aligned(do4) else None
    if first is not None and _POINTER != (first.dq, first.dkdv):
        # The TMA and Gluon kernels cannot read this gradient (the expanded ones of ``O.sum()``, say): one copy lets
        # them.
        do4, do_copied = do4.contiguous(), True
    choice = _dispatch.select(dataclasses.replace(call, aligned=call.aligned and _dispatch.aligned(do4)))
    lse = lse.contiguous()
    z, h, n_q, d = q4.shape
    if z * h == 0 or n_q == 0:
        dk.zero_()
        dv.zero_()
        return dq, dk, dv
    precision = _dot_precision(q.dtype, allow_tf32)
    common = dict(HEAD_DIM=d, BLOCK_D=_block_d(d), IS_CAUSAL=bool(is_causal), DOT_PRECISION=precision)
    key = (_n_key(n_q, k4.shape[2]), d, bool(is_causal), precision, q.dtype)
    delta = _per_row((z * h, n_q), q.device)  # D, written by the dQ kernel
    # Each job from its own implementation; all dQ kernels write D in one layout, which every dK/dV kernel reads.
    descriptors: dict = {}  # the TMA kernels' host descriptors, shared by both
    with _device_guard(q), _plans.recording(plan_key) as launches:
        if choice.fused:
            acc = _dq_sums(q4)
            fused_bwd.backward_atomic(q4, k4, v4, o4, do4, dq4, dk4, dv4, lse, delta, acc, bool(is_causal))
        else:
            if choice.dq == _dispatch.GLUON:
                gluon_bwd.dq(q4, k4, v4, o4, do4, dq4, lse, delta, bool(is_causal))
            elif choice.dq == _dispatch.TMA:
                tma.dq(q4, k4, v4, o4, do4, lse, delta, dq4, common, key, descriptors)
            else:
                pointer.dq(q4, k4, v4, o4, do4, lse, delta, dq4, common, key)
            if choice.dkdv == _dispatch.GLUON:
                gluon_bwd.dkdv(q4, k4, v4, do4, dk4, dv4, lse, delta, bool(is_causal))
            elif choice.dkdv == _dispatch.TMA:
                tma.dkdv(q4, k4, v4, do4, lse, delta, dk4, dv4, common, key, descriptors)
            else:
                pointer.dkdv(q4, k4, v4, do4, lse, delta, dk4, dv4, common, key)
    roles = (q4, k4, v4, o4, do4, dq4, dk4, dv4, lse, delta) + ((acc,) if choice.fused else ())
    _plans.store(plan_key, launches, roles, do_copied=do_copied, sums=choice.fused)
    return dq, dk, dv


def _dq_sums(q4: torch.Tensor) -> torch.Tensor:
    """The fused backward's fp32 dQ sums, one per element of dQ (zeroed by its first kernel)."""
    return torch.empty(q4.shape, dtype=torch.float32, device=q4.device)


def _replay_backward(plan, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_backward`` for a call whose plan key matched: the same buffers and views as it makes, then the plan."""
    do = do.to(q.dtype)
    dq, dk, dv = _dense(q), _dense(k), _dense(v)
    q4, k4, v4, o4, do4 = _as_4d(q), _as_4d(k), _as_4d(v), _as_4d(o), _as_4d(do)
    if plan.extra["do_copied"]:
        do4 = do4.contiguous()
    z, h, n_q, _ = q4.shape
    delta = _per_row((z * h, n_q), q.device)
    with _device_guard(q):
        bind_context(q.device)
        roles = (q4, k4, v4, o4, do4, _as_4d(dq), _as_4d(dk), _as_4d(dv), lse.contiguous(), delta)
        plan.run(roles + ((_dq_sums(q4),) if plan.extra["sums"] else ()))
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile: no graph break) and autograd
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("lmtrain::flash_attn_fwd", mutates_args=())
def _flash_attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, allow_tf32: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, is_causal, allow_tf32)


@_flash_attn_fwd_op.register_fake
def _flash_attn_fwd_fake(q, k, v, is_causal, allow_tf32):
    _check_inputs(q, k, v, check_device=False)
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("lmtrain::flash_attn_bwd", mutates_args=())
def _flash_attn_bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    allow_tf32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, o, lse, is_causal, allow_tf32)


@_flash_attn_bwd_op.register_fake
def _flash_attn_bwd_fake(do, q, k, v, o, lse, is_causal, allow_tf32):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _op_setup_context(ctx, inputs, output) -> None:
    q, k, v, is_causal, allow_tf32 = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(lse, q, k, v, o)
    ctx.is_causal = is_causal
    ctx.allow_tf32 = allow_tf32


def _op_backward(ctx, grad_o, grad_lse):
    lse, q, k, v, o = ctx.saved_tensors
    dq, dk, dv = torch.ops.lmtrain.flash_attn_bwd(grad_o, q, k, v, o, lse, ctx.is_causal, ctx.allow_tf32)
    return dq, dk, dv, None, None


_flash_attn_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 with Triton kernels: ``FlashAttentionTriton.apply(q, k, v, is_causal)``.

    q (..., N_q, d), k and v (..., N_k, d) (3-D (batch, N, d) in the course's assignment tests). The forward saves the
    logsumexp L (natural log, fp32, shape q.shape[:-1]) with q, k, v and O; no N x N tensor is saved.

    In eager mode the kernels are launched directly; while ``torch.compile`` traces, through the custom ops
    ``lmtrain::flash_attn_fwd`` / ``lmtrain::flash_attn_bwd`` (opaque to the compiler). The custom-op
    dispatch costs host time on every call (about 80 us per op on an H100 machine), which a launch-bound
    eager model pays in full.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                allow_tf32: bool = False) -> torch.Tensor:
        fwd = torch.ops.lmtrain.flash_attn_fwd if torch.compiler.is_compiling() else _forward
        o, lse = fwd(q, k, v, bool(is_causal), bool(allow_tf32))
        ctx.save_for_backward(lse, q, k, v, o)
        ctx.is_causal = bool(is_causal)
        ctx.allow_tf32 = bool(allow_tf32)
        return o

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor):
        lse, q, k, v, o = ctx.saved_tensors
        bwd = torch.ops.lmtrain.flash_attn_bwd if torch.compiler.is_compiling() else _backward
        dq, dk, dv = bwd(grad_o, q, k, v, o, lse, ctx.is_causal, ctx.allow_tf32)
        return dq, dk, dv, None, None


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, *, allow_tf32: bool = False
) -> torch.Tensor:
    """Scaled dot-product attention softmax(q k^T / sqrt(d)) v with FlashAttention-2 Triton kernels.

    Args:
        q: queries (..., N_q, d), fp16/bf16/fp32, on a CUDA device; last dim contiguous for a copy-free read.
        k: keys (..., N_k, d), same leading dims and dtype as q.
        v: values (..., N_k, d).
        causal: mask keys after each query (lower triangle with the diagonal, top-left aligned).
        allow_tf32: for fp32 inputs, use TF32 tensor cores (faster, ~3e-4 relative error) instead of IEEE fp32.

    Returns:
        (..., N_q, d) in q's dtype, contiguous. Differentiable in q, k, v; works under torch.compile.
    """
    if torch.compiler.is_compiling():
        o, _ = torch.ops.lmtrain.flash_attn_fwd(q, k, v, bool(causal), bool(allow_tf32))
        return o
    return FlashAttentionTriton.apply(q, k, v, bool(causal), bool(allow_tf32))
