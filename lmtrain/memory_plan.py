"""Memory planner: analytic bytes of one training step of ``TransformerLM``, and the largest context that fits.

Everything is computed from the configuration alone (no model is built), so a 2.7B plan costs
microseconds. Notation: B batch size, T tokens per sequence, n = B*T, D d_model, F d_ff, H heads,
V vocabulary, L layers, P parameters (``lmtrain.flops.parameter_count``), P_mm the parameters used in
matrix products (all but the embedding table and the RMSNorm gains), K the number of parameter tensors.
Byte widths: ``c`` the compute dtype (4 fp32, 2 bf16/fp16), ``w`` the parameter dtype (4, or 2 under
``*-true`` precisions).

**Static state** (alive for the whole step)::

    parameters           P * w  (+ the RoPE cos/sin buffers, T * head_dim * 4)
    gradients            P * w
    optimizer states     AdamW: exp_avg + exp_avg_sq, 2 * P * w, + one fp32 ``step`` per tensor, K * 4

    with ``master_weights`` (bf16-mixed only; ``lmtrain.optim.MasterWeightAdamW``) the P_mm linear-layer
    weights and their gradients are bf16 and the optimizer holds their fp32 masters:
    parameters           P_mm * 2 + (P - P_mm) * 4
    gradients            P_mm * 2 + (P - P_mm) * 4
    optimizer states     P_mm * 12 (master, exp_avg, exp_avg_sq) + (P - P_mm) * 8 + K * 4; with
                         ``optimizer_state_dtype: bfloat16`` P_mm * 6 (the masters' low halves and the
                         moments, 2 bytes each) instead of P_mm * 12

**Saved activations** (what autograd keeps for the backward pass; the sum of the distinct storages that
``torch.autograd.graph.saved_tensors_hooks`` sees, parameters and buffers excluded). Per layer, from
``lmtrain/model.py`` operation by operation:

    norm inputs          2 * n*D * 4   RMSNorm's fp32 input (x.pow(2) and the product save it; in fp32
                                       and *-mixed it is the fp32 residual itself, under *-true an fp32 copy)
    norm rsqrt           2 * n * 4     rsqrt(mean(x^2) + eps), saved by the product
    norm scaled          2 * n*D * 4   x * rsqrt, saved by the product with the gain
    linear inputs        k_in * n*D * c  inputs of qkv, out, w1 and w3: k_in = 4 under autocast (w1 and w3
                                       each cast the fp32 norm output to bf16 themselves), 3 otherwise
                                       (w1 and w3 share one input); minus one n*D where the attention
                                       output already has the (B, T, H, hd) layout (see below)
    rope q, k            2 * n*D * c   rotated q and k (RoPE's fp32 temporaries are not saved: cos/sin are
                                       buffers and the rest of it needs no saved input)
    swiglu               4 * n*F * c   w1 x (silu input), silu(w1 x), w3 x (product inputs), product (w2 input)
    weight casts         (4 D^2 + 3 D F) * c  autocast's bf16/fp16 copies of the layer's weights (mixed only;
                                       none with ``master_weights``, whose weights are bf16 already)
    attention            per backend:
      naive              n*D*c (v, copied by the batched matmul's reshape) + T^2 (bool causal mask)
                         + B*H*T^2*4 (fp32 softmax output) + B*H*T^2*c (probabilities in v's dtype; shared
                         with the softmax output in fp32)
      sdpa, flash_*      3*n*D*c (the qkv projection's output: v is a view into it and keeps it alive)
                         + n*D*c (output O) + B*H*T*4 (logsumexp L)

and once for the model: the final norm (n*D*4 input, n*D*4 scaled, n*4 rsqrt), the output head's
input (n*D*c) and weight cast (V*D*c, mixed only), the fp32 log-softmax of the cross-entropy (n*V*4),
the token batch (B*(T+1)*8, the embedding's indices), the flattened targets (n*8). With activation
checkpointing a layer keeps only its input (n*D*r, r the residual width: 2 under *-true, else 4) and
the backward pass recomputes one layer at a time (its activations are added once to the peak).

**Peak** (``torch.cuda.max_memory_allocated``) is the static state plus the largest of these moments:

    end of forward       saved activations + the loss transients: logits (n*V*c) and their fp32 copy
                         (n*V*4, none in fp32). No gradients: ``LMModule`` frees them right after each
                         optimizer step (Lightning alone would keep them until after the next forward).
    naive softmax        in the last layer: all but that layer's post-attention activations, plus the score
                         transients (scores, masked scores, fp32 copy: B*H*T^2*(2c + 4 or 2*4))
    loss backward        saved activations + the gradient of the log-softmax and of the logits (2*n*V*4 +
                         n*V*c); no gradients yet
    last layer backward  saved activations less the head's (its backward has run and freed them) + the last
                         layer's recomputed activations (with checkpointing; with offload also its input, back
                         on the device) + its backward's transients: the incoming and outgoing gradients of
                         the residual stream (2*n*D*4) and the gradients of the SwiGLU products (2*n*F*c)
    end of backward      all gradients (``forward_backward`` and ``train``)
    forward only         parameters + the larger of the loss transients (n*V*(c + 4 + 4)) and a SwiGLU
                         block's (n*D*(4 + 4 [+ c]) + 3*n*F*c). No autocast weight cache: Lightning enters
                         autocast with ``cache_enabled=False``, so each weight's bf16 copy is made when it is
                         used and freed after (measured on an H100: 2.7B bf16-mixed forward peaks at the fp32
                         parameters plus 0.2-0.9 GiB at contexts 128-2048, not plus the 6.3 GiB a cache of
                         bf16 weights would hold)

plus a fixed CUDA workspace term (cuBLAS / cuBLASLt workspaces come from PyTorch's caching allocator and
are counted by ``max_memory_allocated``; see ``CUDA_WORKSPACE_BYTES``). During the backward pass of the first
layer (``first layer backward``) all gradients but the embedding's exist next to that layer's activations
(recomputed ones with checkpointing).

**Long-context options** (``docs/long_context.md``):

    activation_checkpointing
      full               a layer keeps its input (n*D*r); the backward pass recomputes one layer at a time
      offload            as full, but the inputs live in pinned host memory (``details["host_bytes"]``): the
                         device keeps none of them; the recomputed layer is added as for full
      selective          a layer keeps its input (n*D*r) and the outputs of its matrix products and attention:
                         qkv 3*n*D*c, attention output n*D*c + logsumexp B*H*T*4 (sdpa and flash_triton; naive and
                         flash_pytorch attention are recomputed), output projection n*D*c, w1 and w3 2*n*F*c, w2
                         n*D*c; the backward pass recomputes the elementwise rest of one layer at a time
    loss_chunk_tokens k  the head keeps the final norm's output (n*D*4, the chunks' inputs) instead of its bf16
                         cast and the log-softmax; the loss transients become one chunk's: k*V*(c + 4 + 4) at the
                         end of the forward pass, k*V*(2c + 3*4) in the backward pass, plus the gradient of the
                         final norm's output, assembled chunk by chunk (2*n*D*4)
    optimizer_in_backward  no moment holds all gradients: at most the gradient being produced and the one being
                         applied, bounded by twice the largest parameter's (``gradients`` = 2 * max tensor * w)

**Float8** (``model.float8``, ``lmtrain.float8``; F8 the weight elements of a block's float8 layers under the size
rule). torchao's float8 layer saves its high-precision input and weight for the backward pass and casts to float8
inside each GEMM, so:

    weight casts         autocast makes no bf16 copy of a float8 layer's weight: (4 D^2 + 3 D F - F8) * c per layer,
                         and none of the head's when it is float8
    float8 weights       none kept for the backward pass, with or without ``compile``: the 2.7B fast config with
                         float8 peaked 1.4 GiB *below* its bf16 run on an H100 (32.2 against 33.6 GiB,
                         benchmarks/2026-11-28-H100-float8-2.7B.md), where keeping them would have added 3.1 GiB
    float8 transients    the largest float8 layer's backward casts, 1 byte each: grad_output twice (n*N each), the
                         weight (K*N) and the input (n*K); rowwise adds fp32 scales per row and column. Added to the
                         last layer's backward. Amax and tensorwise scales are single fp32 numbers (nothing to plan).
    FSDP2 all-gather     with ``tensorwise`` the float8 layers' weights are all-gathered in float8 (1 byte instead
                         of the bf16 param_dtype's 2): the blocks in flight are smaller by F8 bytes each

**Fits?** ``fits(estimate, capacity)`` compares what the step needs with ``device_capacity_bytes()``: the
device's total memory (``torch.cuda.mem_get_info``) or a given size, minus ``CUDA_CONTEXT_BYTES`` (the CUDA
context and kernel images, outside PyTorch's allocator) and ``FRAGMENTATION_FRACTION`` of the total (memory the
caching allocator holds in partly used blocks at the peak, which ``max_memory_allocated`` does not count but the
device does). What the step needs (``MemoryEstimate.needed``) is the peak plus, when the peak comes after the
loss (a layer's backward pass) and the loss is not chunked, the loss's (n x V)-sized transient buffers
(``MemoryEstimate.cached``): freed by then, they stay in the allocator's cache in blocks the layers' smaller
allocations reuse only in part (a chunk's buffers are small enough to be reused). Measured on an H100
(2.7B, bf16-mixed, batch 4, full checkpointing, context 16384): 6.6-8.1 GiB reserved beyond the allocated peak
with the whole loss (2.5 GiB fp32 logits), 3.5-3.9 GiB with 4096-token loss chunks; one such step ran out of
memory with 69.5 GiB allocated and 8.1 GiB reserved but free.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from lmtrain.config import ModelConfig, step_fields
from lmtrain.errors import LmtrainError
from lmtrain.float8 import block_linear_shapes, converts_shape
from lmtrain.flops import STEP_MODES, matmul_parameter_count, parameter_count
from lmtrain.optim import check_master_weights_precision

GIB = 1024**3

#: Lightning precision strings the planner understands.
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


#: cuBLAS / cuBLASLt workspace that PyTorch allocates through its caching allocator at the first matrix
#: product on a CUDA device: 28 MiB measured on an H100 with torch 2.11 + CUDA 13.0 (``memory_allocated``
#: before and after a first fp32 ``mm``, output excluded; a later bf16 ``mm`` added nothing).
CUDA_WORKSPACE_BYTES = 28 * 1024**2

#: Device memory that PyTorch's allocator never gets: the CUDA context, cuBLAS handles and the loaded kernel images
#: (PyTorch's, Triton's). About 0.5-0.6 GiB on an H100 with torch 2.11 and lazy module loading; 1 GiB leaves room
#: for the Triton kernels autotuning loads and for a context that loads more eagerly.
CUDA_CONTEXT_BYTES = 1 * GIB

#: Share of the device lost to the caching allocator at the peak: ``max_memory_reserved`` exceeds
#: ``max_memory_allocated`` by the free parts of cached segments (block rounding, split large blocks). A
#: long-context step allocates and frees multi-GiB tensors of several sizes, so this is a few percent (the
#: 2.7B step at context 16384 planned 79.09 GiB, within an 80 GB H100's 79.1 GiB, and ran out of memory). 5% of an
#: 80 GB device is 4 GiB; ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` lowers the real loss.
FRAGMENTATION_FRACTION = 0.05


def _widths(precision: str) -> tuple[int, int, bool]:
    """(compute bytes c, parameter bytes w, autocast?) for a Lightning precision string."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "32-true":
        return 4, 4, False
    if precision.endswith("-mixed"):
        return 2, 4, True
    return 2, 2, False


def _weights_cast(cfg: ModelConfig, precision: str) -> bool:
    """Whether autocast makes bf16/fp16 copies of the linear weights: under ``*-mixed``, unless ``master_weights``
    already stores them in bf16."""
    return _widths(precision)[2] and not cfg.master_weights


def linear_parameter_count(cfg: ModelConfig) -> int:
    """P_mm: parameters used in matrix products, all but the embedding table and the RMSNorm gains (those
    ``master_weights`` stores in bf16): ``lmtrain.flops.matmul_parameter_count``."""
    return matmul_parameter_count(cfg)


def float8_block_elements(cfg: ModelConfig) -> int:
    """Weight elements of one block's float8 layers (``lmtrain.float8``'s size rule; 0 with ``float8: none``)."""
    return sum(i * o for i, o in block_linear_shapes(cfg).values() if converts_shape(i, o, False, cfg))


def float8_head(cfg: ModelConfig) -> bool:
    """Whether the output head is a float8 layer."""
    return converts_shape(cfg.d_model, cfg.vocab_size, True, cfg)


def float8_cast_transient_bytes(cfg: ModelConfig, tokens: int) -> int:
    """The float8 copies one float8 layer's backward pass makes at once, for its largest layer (0 without float8):
    grad_output cast twice (for grad_input and, transposed or per column, for grad_weight), the weight and the
    input cast again, 1 byte each, plus fp32 scales (one per row and column under rowwise, negligible)."""
    shapes = [s for s in block_linear_shapes(cfg).values() if converts_shape(*s, False, cfg)]
    if float8_head(cfg):
        shapes.append((cfg.d_model, cfg.vocab_size))
    per_layer = [2 * tokens * o + i * o + tokens * i + (4 * (2 * tokens + i + o) if cfg.float8 == "rowwise" else 0)
                 for i, o in shapes]
    return max(per_layer, default=0)


def static_bytes(cfg: ModelConfig, precision: str, mode: str = "train") -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) in bytes, RoPE buffers left out (see the module docstring).

    Raises:
        LmtrainError: ``cfg.master_weights`` with a precision other than ``bf16-mixed``.
    """
    _, w, _ = _widths(precision)
    p, k = parameter_count(cfg), parameter_tensor_count(cfg)
    if not cfg.master_weights:
        return p * w, p * w, (2 * p * w + k * 4 if mode == "train" else 0)
    check_master_weights_precision(precision)
    mm = linear_parameter_count(cfg)
    weights = mm * 2 + (p - mm) * 4
    per_master = 12 if cfg.optimizer_state_dtype == "float32" else 6
    return weights, weights, (mm * per_master + (p - mm) * 8 + k * 4 if mode == "train" else 0)


def parameter_tensor_count(cfg: ModelConfig) -> int:
    """Number of parameter tensors of ``TransformerLM(cfg)`` (one AdamW ``step`` tensor each)."""
    per_layer = 2 + 2 + 3  # two RMSNorm gains, qkv + out, w1 + w2 + w3
    return 3 + cfg.num_layers * per_layer  # embedding, final norm gain, output head


def materializes_scores(backend: str) -> bool:
    """Whether a backend stores the (B, H, T, T) scores and probabilities (the registry's fact); the planner
    counts them as ``naive`` stores them. Fused backends are planned alike: output O and logsumexp L."""
    from lmtrain.attention import backend_info

    return backend_info(backend).materializes_scores


def _attention_output_shared(backend: str, device_type: str) -> bool:
    """Whether the attention output already has the (B, T, H, hd) layout, so the output projection's
    input is a view of it rather than a copy. PyTorch's CUDA SDPA kernels write O as (B, T, H, hd)."""
    return backend == "sdpa" and device_type == "cuda"


def layer_activation_bytes(
    cfg: ModelConfig, batch_size: int, seq_len: int, precision: str = "32-true", device_type: str = "cuda"
) -> dict[str, int]:
    """Bytes one transformer layer saves for the backward pass, term by term (see the module docstring).

    Args:
        cfg: model shape; ``cfg.attention`` picks the attention terms.
        batch_size: sequences per batch (B).
        seq_len: tokens per sequence (T).
        precision: Lightning precision string.
        device_type: ``cuda`` or ``cpu`` (PyTorch's SDPA output layout differs).
    """
    c, _, mixed = _widths(precision)
    b, t, d, f, h = batch_size, seq_len, cfg.d_model, cfg.d_ff, cfg.num_heads
    n = b * t
    shared_out = _attention_output_shared(cfg.attention, device_type)
    terms = {
        "norm_inputs": 2 * n * d * 4,
        "norm_rsqrt": 2 * n * 4,
        "norm_scaled": 2 * n * d * 4,
        "linear_inputs": ((4 if mixed else 3) - (1 if shared_out else 0)) * n * d * c,
        "rope_qk": 2 * n * d * c,
        "swiglu": 4 * n * f * c,
        # A float8 layer casts its weight to float8 itself (no autocast copy) and saves the weight and its input
        # in high precision (torchao's autograd function); its float8 weight is cast again in the backward pass,
        # compiled or not (measured: see the module docstring).
        "weight_casts": (4 * d * d + 3 * d * f - float8_block_elements(cfg)) * c if _weights_cast(cfg, precision)
        else 0,
    }
    if materializes_scores(cfg.attention):
        terms["attention"] = n * d * c + t * t + b * h * t * t * 4 + (b * h * t * t * c if c != 4 else 0)
    else:
        lse_len = -(-t // 32) * 32 if device_type == "cuda" and cfg.attention == "sdpa" and c == 4 else t
        terms["attention"] = 3 * n * d * c + n * d * c + b * h * lse_len * 4
    return terms


def head_activation_bytes(
    cfg: ModelConfig, batch_size: int, seq_len: int, precision: str = "32-true"
) -> dict[str, int]:
    """Bytes saved for backward outside the layers: final norm, output head, loss, token ids.

    With ``loss_chunk_tokens`` the chunks keep their inputs, views of the final norm's output (n*D in the
    residual's dtype), instead of the head's cast input, its weight cast and the log-softmax.
    """
    c, _, _ = _widths(precision)
    n, d, v = batch_size * seq_len, cfg.d_model, cfg.vocab_size
    chunked = cfg.loss_chunk_tokens > 0
    return {
        "final_norm": n * d * 4 + n * d * 4 + n * 4,
        "head_input": n * d * (_residual_width(precision) if chunked else c),
        "head_weight_cast": v * d * c if _weights_cast(cfg, precision) and not chunked and not float8_head(cfg) else 0,
        "log_softmax": 0 if chunked else n * v * 4,
        "tokens": batch_size * (seq_len + 1) * 8 + n * 8 + 4,  # embedding indices, flat targets, loss weight
    }


def saved_activation_bytes(
    cfg: ModelConfig, batch_size: int, seq_len: int, precision: str = "32-true", device_type: str = "cuda"
) -> int:
    """Total bytes kept on the device for backward by one forward pass.

    Without ``selective`` checkpointing this is what ``saved_tensors_hooks`` counts; ``selective`` keeps its
    matrix-product and attention outputs in the checkpoint's own cache; ``offload`` keeps the layer inputs on
    the host (:func:`host_activation_bytes`).
    """
    head = sum(head_activation_bytes(cfg, batch_size, seq_len, precision).values())
    policy = cfg.activation_checkpointing
    n = batch_size * seq_len
    layer = sum(layer_activation_bytes(cfg, batch_size, seq_len, precision, device_type).values())
    if policy == "none":
        return cfg.num_layers * layer + head
    k = checkpointed_layers(cfg)
    layer_input = n * cfg.d_model * _residual_width(precision)
    # Blocks past checkpoint_layers keep everything, or under checkpoint_rest: selective their kept outputs.
    rest = (layer_input + selective_kept_bytes(cfg, batch_size, seq_len, precision)
            if cfg.checkpoint_rest == "selective" else layer)
    plain = (cfg.num_layers - k) * rest
    if policy == "full":
        return k * layer_input + plain + head
    if policy == "offload":
        return plain + head
    return k * (layer_input + selective_kept_bytes(cfg, batch_size, seq_len, precision)) + plain + head


def checkpointed_layers(cfg: ModelConfig) -> int:
    """Blocks that ``cfg.activation_checkpointing`` applies to (``checkpoint_layers``, at most all of them)."""
    if cfg.activation_checkpointing == "none":
        return 0
    return cfg.num_layers if cfg.checkpoint_layers is None else min(cfg.checkpoint_layers, cfg.num_layers)


def _residual_width(precision: str) -> int:
    """Bytes per element of the residual stream: the parameter dtype's (fp32 unless ``*-true`` half precision)."""
    return 2 if precision.endswith("-true") and precision != "32-true" else 4


def selective_kept_bytes(cfg: ModelConfig, batch_size: int, seq_len: int, precision: str = "32-true") -> int:
    """Bytes one layer keeps under ``selective`` checkpointing besides its input: product and attention outputs."""
    c, _, _ = _widths(precision)
    n, d, f = batch_size * seq_len, cfg.d_model, cfg.d_ff
    products = (3 + 1 + 1) * n * d * c + 2 * n * f * c  # qkv, out, w2; w1, w3
    attention = n * d * c + batch_size * cfg.num_heads * seq_len * 4 if cfg.attention in ("sdpa", "flash_triton") else 0
    return products + attention


def host_activation_bytes(cfg: ModelConfig, batch_size: int, seq_len: int, precision: str = "32-true") -> int:
    """Pinned host memory the ``offload`` policy fills in one forward pass (every layer's input)."""
    if cfg.activation_checkpointing != "offload":
        return 0
    return checkpointed_layers(cfg) * batch_size * seq_len * cfg.d_model * _residual_width(precision)


def largest_parameter_elements(cfg: ModelConfig) -> int:
    """Elements of the largest parameter tensor (embedding/head V*D, qkv 3*D*D, SwiGLU D*F)."""
    return cfg.d_model * max(cfg.vocab_size, 3 * cfg.d_model, cfg.d_ff)


def device_capacity_bytes(gpu_memory_gib: float | None = None, device: Any = None) -> int:
    """Bytes a training step may plan for on the device: total memory minus the context and fragmentation.

    Args:
        gpu_memory_gib: device memory in GiB when no CUDA device is visible (planning for another machine);
            ignored when one is.
        device: CUDA device to read (default: the current one).

    Returns:
        total - ``CUDA_CONTEXT_BYTES`` - ``FRAGMENTATION_FRACTION`` * total.

    Raises:
        LmtrainError: ``gpu_memory_gib`` is not positive, or leaves nothing usable; or no CUDA device and no
            ``gpu_memory_gib``.
    """
    import torch

    if gpu_memory_gib is not None and not gpu_memory_gib > 0:
        raise LmtrainError("--gpu-memory-gib", f"must be > 0, got {gpu_memory_gib:g}.",
                           "give the device's memory in GiB, e.g. --gpu-memory-gib 80 for an 80 GB H100.")
    if torch.cuda.is_available():
        total = torch.cuda.mem_get_info(device)[1]
    elif gpu_memory_gib is not None:
        total = int(gpu_memory_gib * GIB)
        if usable_bytes(total) <= 0:
            floor = (CUDA_CONTEXT_BYTES / (1 - FRAGMENTATION_FRACTION)) / GIB
            raise LmtrainError("--gpu-memory-gib", f"{gpu_memory_gib:g} GiB leaves nothing to plan for after the "
                               f"CUDA context ({CUDA_CONTEXT_BYTES / GIB:g} GiB) and {FRAGMENTATION_FRACTION:.0%} for "
                               "fragmentation.", f"give the device's real memory, more than {floor:.2f} GiB.")
    else:
        raise LmtrainError("--gpu-memory-gib", "no CUDA device is visible to read its memory size from.",
                           "give the device's memory in GiB, e.g. --gpu-memory-gib 80 for an 80 GB H100.")
    return usable_bytes(total)


def usable_bytes(total: int) -> int:
    """Of a device's ``total`` bytes, those a training step may plan for: less ``CUDA_CONTEXT_BYTES`` and
    ``FRAGMENTATION_FRACTION`` of the total."""
    return int(total - CUDA_CONTEXT_BYTES - FRAGMENTATION_FRACTION * total)


def fits(estimate: MemoryEstimate, capacity_bytes: int) -> bool:
    """Whether a plan's peak and cached loss buffers (``estimate.needed``) fit ``capacity_bytes`` (from
    :func:`device_capacity_bytes`, allowances included)."""
    return estimate.needed <= capacity_bytes


@dataclass
class MemoryEstimate:
    """A memory plan: components in bytes and the predicted peak.

    Attributes:
        components: name -> bytes (parameters, gradients, optimizer_states, activations, transients,
            workspace), the terms that sum to ``peak``.
        peak: predicted ``torch.cuda.max_memory_allocated`` of the step, in bytes.
        moment: which moment of the step sets the peak (see the module docstring).
        details: the activation terms of one layer and of the head, and all gradient bytes, for the curious.
        cached: bytes the device must hold beyond ``peak`` because the caching allocator keeps the whole loss's
            freed transient buffers (see "Fits?" in the module docstring): the largest of the moments after the
            loss plus those buffers, less the peak, or 0. Not part of ``max_memory_allocated``; :func:`fits`
            adds it.
    """

    components: dict[str, int]
    peak: int
    moment: str
    details: dict[str, Any] = field(default_factory=dict)
    cached: int = 0

    @property
    def peak_gib(self) -> float:
        return self.peak / GIB

    @property
    def needed(self) -> int:
        """Bytes the device must hold for the step: the peak and the cached loss buffers."""
        return self.peak + self.cached

    def table(self) -> str:
        """Markdown table (component, GiB) ending with the peak (and the cached loss buffers, if any)."""
        rows = [f"| {k} | {v / GIB:.3f} |" for k, v in self.components.items()]
        rows.append(f"| **peak** ({self.moment}) | **{self.peak_gib:.3f}** |")
        if self.cached:
            rows.append(f"| loss buffers still cached after the loss | {self.cached / GIB:.3f} |")
            rows.append(f"| **needed** | **{self.needed / GIB:.3f}** |")
        return "\n".join(["| component | GiB |", "| --- | --- |", *rows])


#: Moments of a training step at which the loss's transient buffers are alive (``_train_moments``).
LOSS_MOMENTS = ("end of forward", "loss backward")


def _train_moments(
    cfg: ModelConfig, batch_size: int, seq_len: int, precision: str, mode: str, device_type: str
) -> tuple[dict[str, tuple[int, int, int]], dict[str, Any]]:
    """(gradients, activations, transients) at each moment of a training step, and extra details.

    One table of moments for :func:`estimate_memory` and the distributed plans (see the module docstring).
    """
    c, w, _ = _widths(precision)
    t = seq_len
    b, n, v = batch_size, batch_size * t, cfg.vocab_size
    grads = static_bytes(cfg, precision, mode)[1]
    layer = layer_activation_bytes(cfg, b, t, precision, device_type)
    head = head_activation_bytes(cfg, b, t, precision)
    details: dict[str, Any] = {}
    saved = saved_activation_bytes(cfg, b, t, precision, device_type)
    policy = cfg.activation_checkpointing
    layer_bytes = sum(layer.values())
    layer_input = n * cfg.d_model * _residual_width(precision)
    if policy in ("full", "offload"):
        recompute = layer_bytes
    elif policy == "selective":
        recompute = max(0, layer_bytes - selective_kept_bytes(cfg, b, t, precision))
    else:
        recompute = 0
    details["host_bytes"] = host_activation_bytes(cfg, b, t, precision)
    # Gradients alive while the backward pass runs: all of them (less the embedding's, made last) by the first
    # layer's backward, or with the optimizer in the backward pass at most two parameters' (the one being
    # produced, the one being applied).
    if cfg.optimizer_in_backward and mode == "train":
        grads_late = grads_early = 2 * largest_parameter_elements(cfg) * w
        details["in_backward_gradients"] = grads_late
    else:
        grads_late, grads_early = grads - cfg.vocab_size * cfg.d_model * w, 0
    k = min(cfg.loss_chunk_tokens, n) if cfg.loss_chunk_tokens else n
    loss_forward = k * v * c + (k * v * 4 if c != 4 else 0) + (k * v * 4 if cfg.loss_chunk_tokens else 0)
    loss_backward = (k * v * (2 * c + 3 * 4) + 2 * n * cfg.d_model * 4 if cfg.loss_chunk_tokens
                     else 2 * n * v * 4 + n * v * c)
    # The first layer's own saved activations at its backward pass (its input with checkpointing; on the device
    # again, for offload, once copied back).
    first_layer = layer_bytes if policy == "none" else layer_input + recompute
    if policy == "selective":
        first_layer = layer_input + selective_kept_bytes(cfg, b, t, precision) + recompute
    end_grads = grads if not cfg.optimizer_in_backward or mode != "train" else grads_early
    # Each moment: (gradients, activations, transients) alive at that point of the step. No gradients exist
    # before the backward pass: LMModule.optimizer_step frees them after each step.
    # The last layer's backward pass: the head's saved tensors are freed by then (its backward has run); the
    # layer's own activations are recomputed (with offload its input is back on the device first), and its
    # backward holds the incoming and outgoing gradients of the residual stream (fp32) and the gradients of
    # the SwiGLU's two products.
    head_saved = sum(head.values()) - head["tokens"]
    returned_input = layer_input if policy == "offload" else 0
    block_backward = 2 * n * cfg.d_model * 4 + 2 * n * cfg.d_ff * c + float8_cast_transient_bytes(cfg, n)
    # The whole loss's (tokens x vocabulary)-sized buffers, which CUDA's caching allocator keeps once freed; loss
    # chunks are small enough for later allocations to reuse.
    kept = cfg.loss_chunk_tokens == 0 and device_type == "cuda"
    details["loss_transient_bytes"] = max(loss_forward, loss_backward) if kept else 0
    moments = {
        "end of forward": (0, saved, loss_forward),
        "loss backward": (grads_early, saved, loss_backward),
        "last layer backward": (grads_early, saved - head_saved + returned_input, recompute + block_backward),
        "first layer backward": (grads_late, first_layer, 2 * n * cfg.d_model * 4),
        "end of backward": (end_grads, 0, n * cfg.d_model * 4),
    }
    if materializes_scores(cfg.attention) and policy == "none":
        # Last layer, inside softmax: its post-attention activations and the head's do not exist yet.
        post_attention = (layer["swiglu"] + layer["linear_inputs"] * 3 // 4 + layer["norm_inputs"] // 2
                          + layer["norm_scaled"] // 2 + layer["norm_rsqrt"] // 2)
        scores = b * cfg.num_heads * t * t * (2 * c + 4 if c != 4 else 2 * 4)
        moments["naive softmax (last layer)"] = (0, saved - sum(head.values()) - post_attention,
                                                 scores)
    return moments, details


def estimate_memory(
    cfg: ModelConfig,
    batch_size: int,
    seq_len: int | None = None,
    precision: str = "32-true",
    mode: str = "train",
    device_type: str = "cuda",
    *,
    strategy: str = "single",
    world_size: int = 1,
    gradient_as_bucket_view: bool = False,
) -> MemoryEstimate:
    """Predicted peak memory of one step on one GPU (see the module docstring for every term).

    Args:
        cfg: the options of the run (``ModelConfig``): the shape and every step option (``plan_options``).
        batch_size: sequences per batch (per GPU under ``ddp`` and ``fsdp``).
        seq_len: tokens per sequence (None: ``cfg.context_length``).
        precision: Lightning precision string (``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``); under
            ``fsdp`` one of ``lmtrain.distributed.FSDP_PRECISIONS``.
        mode: ``train`` (AdamW), ``forward_backward`` or ``forward``.
        device_type: ``cuda`` (adds the workspace term) or ``cpu``.
        strategy: ``single`` (one device), ``ddp`` or ``fsdp`` (``strategy_kind`` maps Lightning's names); the
            plan is then rank 0's (see the comment above :func:`strategy_kind`).
        world_size: GPUs in the data-parallel group (nodes x devices) under ``ddp`` and ``fsdp``.
        gradient_as_bucket_view: DDP's option of that name (gradients are views into the buckets).

    Returns:
        The plan; ``details["options"]`` holds the step options it planned (``plan_options``), and under ``ddp`` and
        ``fsdp`` ``details`` also holds the strategy, the world size and the per-GPU element counts.
    """
    if strategy == "single":
        plan = _single_plan(cfg, batch_size, seq_len, precision, mode, device_type)
    else:
        plan = _data_parallel_plan(cfg, batch_size, seq_len, precision, strategy, world_size, mode, device_type,
                                   gradient_as_bucket_view)
    plan.details["options"] = plan_options(cfg)
    return plan


def plan_options(cfg: ModelConfig) -> dict[str, Any]:
    """The step options a plan depends on: every step field of the config's schema (``lmtrain.config.step_fields``:
    the memory and speed groups, and any group derived from them), with its value."""
    return {f.name: getattr(cfg, f.name) for f in step_fields(type(cfg))}


def _single_plan(cfg: ModelConfig, batch_size: int, seq_len: int | None, precision: str, mode: str,
                 device_type: str, gradients_elsewhere: bool = False) -> MemoryEstimate:
    """``estimate_memory`` on one device; ``gradients_elsewhere``: the gradients live in memory planned apart
    (DDP's buckets under ``gradient_as_bucket_view``), so no moment counts them and the peak is the largest
    moment without them."""
    if mode not in STEP_MODES:
        raise ValueError(f"mode must be one of {STEP_MODES}, got {mode!r}")
    t = cfg.context_length if seq_len is None else seq_len
    c, w, mixed = _widths(precision)
    b, n, v = batch_size, batch_size * t, cfg.vocab_size
    params, grads, optim = static_bytes(cfg, precision, mode)
    params += t * cfg.head_dim * 4  # + RoPE cos/sin buffers (built for the context length)
    workspace = CUDA_WORKSPACE_BYTES if device_type == "cuda" else 0
    layer = layer_activation_bytes(cfg, b, t, precision, device_type)
    head = head_activation_bytes(cfg, b, t, precision)
    details = {"layer": layer, "head": head, "gradients": {"all": grads}}

    if mode == "forward":
        weight_cast = cfg.d_model * max(v, cfg.d_ff, 3 * cfg.d_model) * c if _weights_cast(cfg, precision) else 0
        # Largest of: the loss (logits, their fp32 copy, the log-softmax) and a SwiGLU block (residual,
        # fp32 norm output and its cast, silu(w1 x), w3 x and their product).
        loss = n * v * (c + 4 + (4 if c != 4 else 0))
        block = n * cfg.d_model * (4 + 4 + (c if mixed else 0)) + 3 * n * cfg.d_ff * c
        transient = max(loss, block)
        components = {"parameters": params, "weight_cast": weight_cast, "transients": transient,
                      "workspace": workspace}
        return MemoryEstimate(components, sum(components.values()), "forward (no_grad)", details)

    moments, extra = _train_moments(cfg, b, t, precision, mode, device_type)
    if gradients_elsewhere:
        moments = {k: (0, activations, transients) for k, (_, activations, transients) in moments.items()}
    details["host_bytes"] = extra["host_bytes"]
    if "in_backward_gradients" in extra:
        details["gradients"]["in_backward"] = extra["in_backward_gradients"]
    moment = max(moments, key=lambda k: sum(moments[k]))
    grads_part, activations, transients = moments[moment]
    components = {"parameters": params, "gradients": grads_part, "optimizer_states": optim,
                  "activations": activations, "transients": transients, "workspace": workspace}
    # What the device must hold: at a moment after the loss, that moment's bytes and the loss's cached buffers.
    cached = _cached_after_loss(moments, moment, extra["loss_transient_bytes"])
    return MemoryEstimate(components, sum(components.values()), moment, details, cached=cached)


def max_fitting(
    cfg: ModelConfig,
    budget_bytes: int,
    batch_size: int | None = None,
    seq_len: int | None = None,
    precision: str = "32-true",
    mode: str = "train",
    limit: int = 1 << 20,
    *,
    strategy: str = "single",
    world_size: int = 1,
    gradient_as_bucket_view: bool = False,
) -> int:
    """Largest context (``seq_len=None``) or batch size (``batch_size=None``, per GPU under ``ddp``/``fsdp``)
    whose estimate fits the budget.

    Exactly one of ``batch_size`` and ``seq_len`` is None: that one is searched (binary search; the
    estimate grows with both). Returns 0 when even 1 does not fit. The other arguments are ``estimate_memory``'s.
    """
    if (batch_size is None) == (seq_len is None):
        raise ValueError("give exactly one of batch_size and seq_len; the other is searched")

    def fits(x: int) -> bool:
        b, t = (x, seq_len) if batch_size is None else (batch_size, x)
        plan = estimate_memory(cfg, b, t, precision, mode, strategy=strategy, world_size=world_size,
                               gradient_as_bucket_view=gradient_as_bucket_view)
        return plan.needed <= budget_bytes

    return _largest(fits, limit)


def _largest(fits: Any, limit: int) -> int:
    """The largest x in [1, limit] with ``fits(x)`` (``fits`` grows false with x), or 0 when ``fits(1)`` is false:
    doubling, then bisection."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def trainer_plan_arguments(trainer: Any) -> dict[str, Any] | None:
    """The arguments of ``estimate_memory`` that a Lightning trainer sets: its precision, its strategy's kind, the
    world size and, under DDP, the strategy's own ``gradient_as_bucket_view`` (lmtrain's ``strategy: ddp`` sets it,
    ``lmtrain.distributed.DDP_DEFAULTS``; Lightning's ``auto`` on several devices does not). None for a precision or
    strategy the planner does not know."""
    precision = str(trainer.precision)
    if precision not in PRECISIONS:
        return None
    try:
        kind = strategy_kind(trainer.strategy)
    except ValueError:
        return None
    # DDPStrategy keeps the DistributedDataParallel arguments it was built with, and has no public accessor for them.
    ddp_kwargs = getattr(trainer.strategy, "_ddp_kwargs", None) or {}
    return {"precision": precision, "strategy": kind, "world_size": int(trainer.world_size) if kind != "single" else 1,
            "gradient_as_bucket_view": kind == "ddp" and bool(ddp_kwargs.get("gradient_as_bucket_view", False))}


def fit_plan(module: Any, datamodule: Any, trainer: Any) -> MemoryEstimate | None:
    """The plan of ``fit`` on each GPU of ``trainer`` (on a CUDA device): ``estimate_memory`` with the module's
    options and step mode, the data module's batch size and :func:`trainer_plan_arguments`; None where those are
    None."""
    planned = trainer_plan_arguments(trainer)
    if planned is None:
        return None
    batch = int(getattr(datamodule, "batch_size", 1) or 1)
    return estimate_memory(module.config, batch, None, mode=module.step_mode, **planned)


def warn_if_too_large(module: Any, datamodule: Any, trainer: Any) -> MemoryEstimate | None:
    """Warn (once, rank 0) when the plan of ``fit`` on each GPU exceeds the GPU's memory. Call before ``trainer.fit``.

    Args:
        module: an ``LMModule`` (its ``config`` and ``step_mode`` are read).
        datamodule: an ``LMDataModule`` (its ``batch_size``, per GPU), or None for batch size 1.
        trainer: the ``Trainer`` (its precision, strategy, world size and root device:
            :func:`trainer_plan_arguments`).

    Returns:
        The estimate, or None when the trainer does not run on a CUDA device or its precision or strategy is not
        planned.
    """
    import torch
    from lightning.pytorch.utilities import rank_zero_warn

    device = getattr(trainer.strategy, "root_device", None)
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    plan = fit_plan(module, datamodule, trainer)
    if plan is None:
        return None
    capacity = device_capacity_bytes(device=device)
    if not fits(plan, capacity):
        planned = trainer_plan_arguments(trainer)
        batch = int(getattr(datamodule, "batch_size", 1) or 1)
        fit_t = max_fitting(module.config, capacity, batch_size=batch, mode=module.step_mode, **planned)
        where = "" if planned["strategy"] == "single" else f" per GPU ({planned['strategy']} over " \
            f"{planned['world_size']} GPUs)"
        rank_zero_warn(
            f"The memory plan of this run needs {plan.needed / GIB:.1f} GiB{where} (peak {plan.peak_gib:.1f} GiB at "
            f"{plan.moment}{', and the whole loss buffers still cached' if plan.cached else ''}) but "
            f"{torch.cuda.get_device_name(device)} leaves {capacity / GIB:.1f} GiB to tensors (its total less the "
            f"CUDA context and an allowance for fragmentation): expect CUDA out of memory. "
            f"Largest context that fits at batch size {batch}: {fit_t}. Lower data.batch_size or "
            f"model.context_length, use trainer.precision bf16-mixed, model.attention sdpa/flash_triton, "
            f"model.activation_checkpointing full/offload, model.optimizer_in_backward true or "
            f"model.loss_chunk_tokens 4096 (`python -m lmtrain estimate` shows the plan; docs/long_context.md)."
        )
    return plan


# -- many GPUs: DDP and FSDP2 --------------------------------------------------------------------------------
#
# Per-GPU plans of ``estimate_memory(strategy="ddp" | "fsdp")``. ``b`` is the batch size *per GPU*, N the world size.
#
# **DDP** (``trainer.strategy: ddp``): every GPU holds the single-GPU plan at batch b, plus DDP's gradient
# buckets. ``bucket_cap_mb`` (PyTorch's 25 MiB, the first bucket 1 MiB; 100 MiB under lmtrain's ``strategy: ddp``,
# ``lmtrain.distributed.DDP_DEFAULTS``) only sets how the parameters are grouped for all-reduce: DDP's reducer
# allocates one flat buffer per bucket when it is built, and the buckets together cover every parameter, so they
# add P * w bytes for the whole run (from the first forward on). With PyTorch's default
# (``gradient_as_bucket_view=False``, what Lightning's ``auto`` builds) ``param.grad`` tensors are separate and
# copied into the buckets, so at the end of the backward pass the gradients count twice; with
# ``gradient_as_bucket_view=True`` (lmtrain's ``strategy: ddp``) the gradients are views into the buckets and
# count once (but the buckets exist at every moment).
#
# **FSDP2** (``ModelParallelStrategy`` + ``lmtrain.distributed.shard_model``): each tensor is split along dim
# 0 into N chunks, each padded to ceil(rows / N) rows; parameters, gradients and AdamW state are those padded
# shards (the plan is rank 0's, which holds full chunks). On top of them:
#
#     root unsharded       embedding, final norm and output head, all-gathered in param_dtype and kept from
#                          the forward to the backward pass (FSDP does not reshard the root after forward)
#     blocks in flight     two blocks' all-gathered parameters in param_dtype: the one computing and the
#                          next one prefetched (forward and backward both prefetch one block)
#     reduce-scatter       during a block's backward: its unsharded gradients in param_dtype and the
#                          reduce-scatter input in reduce_dtype (N padded shards)
#     end of backward      all sharded gradients, plus the root's unsharded gradients and their
#                          reduce-scatter input (the root reduces last)
#
# Activations are those of the single-GPU plan at batch b, with one difference under ``bf16-mixed``:
# FSDP2's policy all-gathers bf16 parameters, so the residual stream is bf16 and no weight is cast by
# autocast; the activations are those of ``bf16-true`` (see ``lmtrain.distributed``).
# Not modelled: NCCL's own buffers (not allocated through PyTorch's allocator, so not in
# ``max_memory_allocated``), the all-gather copy-in buffer (one block's shard in param_dtype) and the
# transient flat all-gather output during copy-out (one block in param_dtype).

#: Strategies the distributed planner models.
DISTRIBUTED_STRATEGIES = ("ddp", "fsdp")


def strategy_kind(strategy: Any) -> str:
    """``ddp``, ``fsdp`` or ``single`` for a Lightning strategy name, class path or instance.

    Args:
        strategy: e.g. ``"ddp"``, ``"ddp_spawn"``, ``"auto"``, ``"lightning.pytorch.strategies.ModelParallelStrategy"``
            or a strategy object.
    """
    # An object is known by its class or the nearest base class that is (a subclass of DDPStrategy is DDP); so is a
    # class path whose own name says nothing, once it imports (lmtrain.distributed.SameStreamDDPStrategy is a
    # DDPStrategy). A known name is not imported: planning an FSDP2 config does not load Lightning.
    names = [strategy] if isinstance(strategy, str) else [c.__name__ for c in type(strategy).__mro__]
    kind = _kind_of_names(names)
    if kind is None and isinstance(strategy, str) and "." in strategy:
        cls = imported_class(strategy)
        kind = None if cls is None else _kind_of_names([c.__name__ for c in cls.__mro__])
    if kind is not None:
        return kind
    raise ValueError(f"no memory plan for strategy {strategy!r}; planned: ddp, ModelParallelStrategy (fsdp), auto")


#: Lightning strategies that subclass ``DDPStrategy`` without being DDP (ZeRO shards the state; XLA is no CUDA DDP):
#: a class, or a class path, that is or derives from one of them is planned as none of lmtrain's kinds.
_NOT_DDP = ("deepspeedstrategy", "xlastrategy")


def _kind_of_names(names: list[str]) -> str | None:
    """The strategy kind of the first of ``names`` (strategy names, class names or paths) that has one; None if
    none has, or a strategy of :data:`_NOT_DDP` comes first."""
    for name in (n.rsplit(".", 1)[-1].lower() for n in names):
        if name in _NOT_DDP:
            return None
        if name.startswith("ddp"):
            return "ddp"
        if name in ("modelparallelstrategy", "model_parallel", "fsdp2"):
            return "fsdp"
        if name in ("auto", "single_device", "singledevicestrategy"):
            return "single"
    return None


def imported_class(path: str) -> type | None:
    """The class a dotted path names, or None where it does not import (its module missing, no such class)."""
    import importlib

    module, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if isinstance(found, type) else None


def parameter_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    """Shapes of the parameters of ``TransformerLM(cfg)`` in registration order (embedding, blocks, final
    norm, output head); a block's are attn_norm, qkv, out, mlp_norm, w1, w2, w3."""
    d, v = cfg.d_model, cfg.vocab_size
    weight = {name: (out_f, in_f) for name, (in_f, out_f) in block_linear_shapes(cfg).items()}  # nn.Linear: (out, in)
    block = [(d,), weight["attn.qkv"], weight["attn.out"], (d,), weight["mlp.w1"], weight["mlp.w2"], weight["mlp.w3"]]
    return [(v, d), *block * cfg.num_layers, (d,), (v, d)]


def shard_numel(shape: tuple[int, ...], world_size: int) -> int:
    """Elements of one FSDP2 shard of a tensor: dim 0 split into ``world_size`` chunks of ceil(rows / N)."""
    rest = 1
    for s in shape[1:]:
        rest *= s
    return -(-shape[0] // world_size) * rest


def _root_and_block_shapes(cfg: ModelConfig) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    shapes = parameter_shapes(cfg)
    per_block = (len(shapes) - 3) // cfg.num_layers
    return [shapes[0], *shapes[-2:]], shapes[1:1 + per_block]


def _activation_moments(
    cfg: ModelConfig, batch_size: int, seq_len: int, precision: str, device_type: str
) -> tuple[dict[str, tuple[int, int]], int]:
    """(activations, transients) of each moment of ``estimate_memory``'s training step, gradients left out, and
    the whole loss's buffers the allocator keeps cached after the loss (0 off CUDA).

    The same moments as ``estimate_memory`` (one table, :func:`_train_moments`), kept apart from the gradients
    so that the distributed plans can add their own gradient and buffer terms to each.
    """
    moments, extra = _train_moments(cfg, batch_size, seq_len, precision, "train", device_type)
    per_moment = {k: (activations, transients) for k, (_, activations, transients) in moments.items()}
    return per_moment, extra["loss_transient_bytes"]


def _cached_after_loss(moments: dict[str, tuple[int, ...]], peak_moment: str, loss_cache: int) -> int:
    """``MemoryEstimate.cached``: what a moment after the loss, with the loss's cached buffers, needs beyond the
    peak (or 0)."""
    totals = {k: sum(v) for k, v in moments.items()}
    needed = max([totals[peak_moment]] + [v + loss_cache for k, v in totals.items() if k not in LOSS_MOMENTS])
    return needed - totals[peak_moment]


def _data_parallel_plan(cfg: ModelConfig, batch_size: int, seq_len: int | None, precision: str, strategy: str,
                        world_size: int, mode: str, device_type: str, gradient_as_bucket_view: bool) -> MemoryEstimate:
    """``estimate_memory`` on rank 0 of ``ddp`` or ``fsdp`` (see the comment above ``strategy_kind``)."""
    if strategy not in DISTRIBUTED_STRATEGIES:
        raise ValueError(f"strategy must be 'single' or one of {DISTRIBUTED_STRATEGIES}, got {strategy!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if mode not in STEP_MODES:
        raise ValueError(f"mode must be one of {STEP_MODES}, got {mode!r}")
    t = cfg.context_length if seq_len is None else seq_len
    c, w, _ = _widths(precision)
    workspace = CUDA_WORKSPACE_BYTES if device_type == "cuda" else 0
    rope = t * cfg.head_dim * 4

    if strategy == "ddp":
        buckets = static_bytes(cfg, precision, mode)[1]  # one bucket slot per gradient element, in its dtype
        if mode == "forward":
            single = _single_plan(cfg, batch_size, t, precision, mode, device_type)
            components = {**single.components, "ddp_buckets": buckets}
            return MemoryEstimate(components, sum(components.values()), single.moment,
                                  {"strategy": "ddp", "world_size": world_size})
        # The single-GPU step (its gradients included: DDP fills param.grad as usual) plus the buckets; with
        # gradient_as_bucket_view the gradients are views into the buckets and take no memory of their own, so
        # the peak is the largest moment without them (not the one-GPU peak with them taken off).
        single = _single_plan(cfg, batch_size, t, precision, mode, device_type,
                              gradients_elsewhere=gradient_as_bucket_view)
        components = {**single.components, "ddp_buckets": buckets}
        return MemoryEstimate(components, sum(components.values()), single.moment,
                              {"strategy": "ddp", "world_size": world_size,
                               "gradient_as_bucket_view": gradient_as_bucket_view},
                              cached=single.cached)

    # FSDP2.
    from lmtrain.distributed import FSDP_PRECISIONS

    if cfg.master_weights:
        check_master_weights_precision(precision)
    if precision not in FSDP_PRECISIONS:
        raise ValueError(f"FSDP2 runs in {FSDP_PRECISIONS}, got {precision!r}")
    # param_dtype: bf16 under bf16-mixed (the policy), else the parameters' own; reduce_dtype: fp32 or w.
    gather, reduce = (2, 4) if precision == "bf16-mixed" else (w, w)
    act_precision = "bf16-true" if precision == "bf16-mixed" else precision
    # The activations and transients as under bf16-true; master weights change only the optimizer state (below).
    act_cfg = replace(cfg, master_weights=False, optimizer_state_dtype="float32") if cfg.master_weights else cfg
    root_shapes, block_shapes = _root_and_block_shapes(cfg)
    sharded = sum(shard_numel(s, world_size) for s in parameter_shapes(cfg))
    root_full = world_size * sum(shard_numel(s, world_size) for s in root_shapes)
    block_full = world_size * sum(shard_numel(s, world_size) for s in block_shapes)
    # With master weights the fp32 shards are the masters (MasterWeightAdamW(params_are_masters=True)): the state of
    # a linear weight is its two moments, bf16 under the compact state. The linear share of the shards is taken in
    # proportion to the parameter counts (padding aside).
    moment_bytes = 2 if cfg.master_weights and cfg.optimizer_state_dtype == "bfloat16" else w
    linear_sharded = sharded * linear_parameter_count(cfg) // parameter_count(cfg) if cfg.master_weights else 0
    states = 2 * linear_sharded * moment_bytes + 2 * (sharded - linear_sharded) * w + parameter_tensor_count(cfg) * 4
    static = {
        "parameters": sharded * w + rope,
        "optimizer_states": states if mode == "train" else 0,
        "root_unsharded": root_full * gather,
        "workspace": workspace,
    }
    details = {"strategy": "fsdp", "world_size": world_size, "sharded_numel": sharded,
               "block_unsharded_numel": block_full, "root_unsharded_numel": root_full,
               "param_dtype_bytes": gather, "reduce_dtype_bytes": reduce}
    # tensorwise float8 all-gathers its layers' weights in float8 (1 byte; torchao's enable_fsdp_float8_all_gather)
    float8_gathered = world_size * sum(shard_numel((o, i), world_size) for i, o in block_linear_shapes(cfg).values()
                                       if converts_shape(i, o, False, cfg)) if cfg.float8 == "tensorwise" else 0
    gathered_block = (block_full - float8_gathered) * gather + float8_gathered
    in_flight = 2 * gathered_block if cfg.num_layers > 1 else gathered_block
    details["float8_gathered_numel"] = float8_gathered
    if mode == "forward":
        single = _single_plan(act_cfg, batch_size, t, act_precision, mode, device_type)
        components = {**static, "blocks_in_flight": in_flight, "transients": single.components["transients"]}
        return MemoryEstimate(components, sum(components.values()), single.moment, details)
    moments, loss_cache = _activation_moments(act_cfg, batch_size, t, act_precision, device_type)
    block_reduce = block_full * (gather + reduce)  # a block's unsharded gradients + reduce-scatter input
    # fsdp_reshard_after_forward none: every block stays gathered from its forward to its backward, so all of them
    # are held when the backward starts (planned at every moment before the end of the backward: an upper bound).
    held = (cfg.num_layers - 1) * gathered_block if cfg.fsdp_reshard_after_forward == "none" else 0
    details["blocks_held_bytes"] = held
    # Sharded gradients alive: every block's but the first's by the first block's backward, all of them at its
    # end; with the optimizer in the backward pass at most two parameters' (each update follows its reduce-scatter
    # and frees the gradient).
    block_sharded = sum(shard_numel(s, world_size) for s in block_shapes)
    if cfg.optimizer_in_backward and mode == "train":
        grads_first = grads_end = 2 * max(shard_numel(s, world_size) for s in parameter_shapes(cfg)) * w
    else:
        grads_first, grads_end = (cfg.num_layers - 1) * block_sharded * w, sharded * w
    totals: dict[str, tuple[int, int, int, int]] = {}  # gradients, buffers, activations, transients
    for k, (activations, transients) in moments.items():
        if k == "end of backward":
            totals[k] = (grads_end, root_full * (gather + reduce), activations, transients)
        elif k == "last layer backward":
            totals[k] = (0, held + in_flight + block_reduce, activations, transients)
        elif k == "first layer backward":
            # the other blocks are resharded after their backward by then: their sharded gradients, not their
            # gathered parameters, are what they leave
            totals[k] = (grads_first, in_flight, activations, transients)
        else:
            totals[k] = (0, held + in_flight, activations, transients)
    moment = max(totals, key=lambda k: sum(totals[k]))
    grads, buffers, activations, transients = totals[moment]
    components = {**static, "gradients": grads, "fsdp_buffers": buffers, "activations": activations,
                  "transients": transients}
    cached = _cached_after_loss(totals, moment, loss_cache)
    return MemoryEstimate(components, sum(components.values()), moment, details, cached=cached)
