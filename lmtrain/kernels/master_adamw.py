"""The Triton kernel of ``lmtrain.optim.MasterWeightAdamW``: AdamW on fp32 masters, bf16 weights written back.

Two state layouts. Full (``STATE_BF16`` false): fp32 master and moments. Compact (``STATE_BF16``): the master is
stored split, its high 16 bits as the bf16 weight itself and its low 16 bits in an int16 tensor (the weight is the
master rounded to nearest, ties toward zero, so the low bits say which way it was rounded and the fp32 master is
rebuilt exactly), and the moments are bf16. Bytes per element and step: 28 full, 18 compact.

With ``PARAM_IS_MASTER`` the parameter is fp32 and is its own master (FSDP2's sharded parameters, all-gathered in
bf16 by its mixed-precision policy): no master tensor, no bf16 weight written; the moments are fp32 or, with
``STATE_BF16``, bf16 rounded stochastically. Bytes per element and step (fp32 gradient): 28, or 20 with bf16 moments.

In the compact layout the moments are rounded stochastically: each value stored is one of the two bf16
numbers next to the fp32 result, the larger in magnitude with probability equal to the fraction of the gap the
result covers, so its expected value is the fp32 result (rounding to nearest would stop a moment from changing once
its increment is below half a bf16 step). The random bits are an integer hash of the element's offset keyed by the
launch's seed, the slot and the step count read from device memory, so a replayed CUDA graph draws new bits every
step. A hash, not Philox: ``tl.randint`` runs ten Philox rounds per element, which made this memory-bound kernel
compute-bound (at 2.7B, 71-88% of copy bandwidth at 4 warps x 4096 elements, against 95-98% with fp32 moments).

One launch updates up to eight tensors (the pointers of each are kernel arguments, so a CUDA graph that captures
the launch replays it on the same tensors); ``lmtrain.optim`` imports this module on first use, so that importing
the optimizer needs no Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

#: Tensors one launch updates (the slots of ``master_adamw_kernel``).
SLOTS = 8
#: The kernels as a profiler names them.
KERNEL_NAMES = ("master_adamw_kernel",)


@triton.jit
def mix32(x):
    """A 32-bit integer hash with full avalanche (the "lowbias32" finaliser: two multiplies, three xor-shifts)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def round_bf16_stochastic(x, random16):
    """``x`` (fp32) to bf16, rounded away from zero with probability (dropped low 16 bits) / 2**16: adding
    ``random16`` (uniform in [0, 2**16)) to the magnitude bits and truncating. The result is exact in bf16."""
    bits = (x.to(tl.uint32, bitcast=True) + random16) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def join_master(weight_bits, low):
    """The fp32 master from its bf16 weight and low 16 bits (both uint32 holding 16 bits): the weight is the
    master's top half, plus one where the low half was above one half (rounded up)."""
    top = tl.where(low > 0x8000, weight_bits - 1, weight_bits)
    return ((top << 16) | low).to(tl.float32, bitcast=True)


@triton.jit
def split_master(w):
    """fp32 ``w`` -> (bf16 weight bits, low 16 bits), uint32 each: rounded to nearest, ties toward zero."""
    bits = w.to(tl.uint32, bitcast=True)
    low = bits & 0xFFFF
    return tl.where(low > 0x8000, (bits >> 16) + 1, bits >> 16), low


@triton.jit
def update_block(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_ptr, n_elements, block,
                 lr_ptr, lr, one_minus_beta1, beta2, one_minus_beta2, log_beta1, log_beta2, eps, weight_decay, seed,
                 LR_ON_DEVICE: tl.constexpr, STATE_BF16: tl.constexpr, PARAM_IS_MASTER: tl.constexpr,
                 BLOCK: tl.constexpr):
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    if LR_ON_DEVICE:
        lr = tl.load(lr_ptr).to(tl.float32)
    t = tl.load(step_ptr)  # already counted for this step
    step_size = tl.div_rn(lr, -libdevice.expm1(t * log_beta1))  # lr / (1 - beta1**t)
    bias2_sqrt = tl.sqrt_rn(-libdevice.expm1(t * log_beta2))  # sqrt(1 - beta2**t)

    g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    if PARAM_IS_MASTER:  # an fp32 parameter (an FSDP2 shard) is its own master; master_ptr is unused
        w = tl.load(param_ptr + offsets, mask=mask)
    elif STATE_BF16:  # master_ptr: the low halves (int16)
        w = join_master(tl.load(param_ptr + offsets, mask=mask).to(tl.uint16, bitcast=True).to(tl.uint32),
                        tl.load(master_ptr + offsets, mask=mask).to(tl.uint16, bitcast=True).to(tl.uint32))
    else:
        w = tl.load(master_ptr + offsets, mask=mask)
    m = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32)
    w = w * (1 - lr * weight_decay)
    m = m + one_minus_beta1 * (g - m)  # lerp, as torch computes it for a weight below 1/2
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
    w = w - step_size * tl.div_rn(m, denom)
    if PARAM_IS_MASTER:
        tl.store(param_ptr + offsets, w, mask=mask)
    elif STATE_BF16:
        weight, low = split_master(w)
        tl.store(param_ptr + offsets, weight.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(master_ptr + offsets, low.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(master_ptr + offsets, w, mask=mask)
        tl.store(param_ptr + offsets, w.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)
    if STATE_BF16:
        # One 32-bit draw per element: its low half rounds m, its high half v. The key mixes the slot's seed and
        # the step count; each element hashes its offset in its tensor with it.
        key = mix32(seed.to(tl.uint32) ^ mix32(t.to(tl.uint32)))
        bits = mix32((offsets.to(tl.uint32) * 0x9E3779B1) ^ key)
        tl.store(exp_avg_ptr + offsets, round_bf16_stochastic(m, bits & 0xFFFF), mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, round_bf16_stochastic(v, bits >> 16), mask=mask)
    else:
        tl.store(exp_avg_ptr + offsets, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)

@triton.jit(do_not_specialize=["seed"])  # a seed of 1 must not become a constant
def master_adamw_kernel(p0, g0, w0, m0, v0, s0, n0, p1, g1, w1, m1, v1, s1, n1,
                        p2, g2, w2, m2, v2, s2, n2, p3, g3, w3, m3, v3, s3, n3,
                        p4, g4, w4, m4, v4, s4, n4, p5, g5, w5, m5, v5, s5, n5,
                        p6, g6, w6, m6, v6, s6, n6, p7, g7, w7, m7, v7, s7, n7,
                        e0, e1, e2, e3, e4, e5, e6, e7, lr_ptr, lr, b1c, b2, b2c, lb1, lb2, eps, wd, seed,
                        LR_ON_DEVICE: tl.constexpr, STATE_BF16: tl.constexpr, PARAM_IS_MASTER: tl.constexpr,
                        BLOCK: tl.constexpr):
    # Slot k: param, grad, master, exp_avg, exp_avg_sq, step count, elements; its blocks are [e(k-1), e(k)).
    # Scalars: lr (device pointer, or the value), 1 - beta1, beta2, 1 - beta2, log beta1, log beta2, eps and
    # the weight decay; seed: the launch's seed for stochastic rounding (slot k uses seed + k). Program i
    # updates one BLOCK of the tensor whose block range holds i.
    pid = tl.program_id(0)
    if pid < e0:
        update_block(p0, g0, w0, m0, v0, s0, n0, pid, lr_ptr, lr, b1c, b2, b2c, lb1, lb2, eps, wd,
                     seed, LR_ON_DEVICE, STATE_BF16, PARAM_IS_MASTER, BLOCK)
    elif pid < e1:
        update_block(p1, g1, w1, m1, v1, s1, n1, pid - e0, lr_ptr, lr, b1c, b2, b2c, lb1, lb2, eps, wd,
                     seed + 1, LR_ON_DEVICE, STATE_BF16, PARAM_IS_MASTER, BLOCK)
    elif pid < e2:
        update_block(p2, g2, w2, m2, v2, s2, n2, pid - e1, lr_ptr, lr, b1c, b2, b2c, lb1, lb2, eps, wd,
                     seed + 2, LR_ON_DEVICE, STATE_BF16, PARAM_IS_MASTER, BLOCK)
    elif pid < e3:
        update_block(p3, g3, w3, m3, v3, s3, n3, pid - e2, lr_ptr, lr, b1c, b2, b2c, lb1, lb2, eps, wd,
                     seed + 3, LR_ON_DEVICE, STATE_BF16, PARAM_IS_MASTER, BLOCK)
    elif pid < e4:
        update_block(p4, g4, w4, m4, v4, s4, n4, pid - e3, lr_ptr, lr, b1c, b2, b2c, lb1, lb2, eps, wd,
                     seed + 4, LR_ON_DEVICE, STATE_BF16, PARAM_IS_MASTER, BLOCK)
    elif pid < e5:
        update_block(p5, g5, w5, m5, v5, s5, n5, pid - e4, lr_ptr, lr, b1c, b2, b2c, lb1, lb2, eps, wd,
                     seed + 5, LR_ON_DEVICE, STATE_BF16, PARAM_IS_MASTER, BLOCK)
    elif pid < e6:
        update_block(p6, g6, w6, m6, v6, s6, n6, pid - e5, lr_ptr, lr, b1c, b2, b2c, lb1, lb2, eps, wd,
                     seed + 6, LR_ON_DEVICE, STATE_BF16, PARAM_IS_MASTER, BLOCK)
    else:
        update_block(p7, g7, w7, m7, v7, s7, n7, pid - e6, lr_ptr, lr, b1c, b2, b2c, lb1, lb2, eps, wd,
                     seed + 7, LR_ON_DEVICE, STATE_BF16, PARAM_IS_MASTER, BLOCK)
