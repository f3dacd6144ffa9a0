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
    weight casts         (4 D^2 + 3 D F) * c  autocast's bf16/fp16 copies of the layer's weights (mixed only)
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
    backward start       saved activations + the gradient of the log-softmax and of the logits (2*n*V*4 +
                         n*V*c); no gradients yet
    end of backward      all gradients (``forward_backward`` and ``train``)
    forward only         parameters + the larger of the loss transients (n*V*(c + 4 + 4)) and a SwiGLU
                         block's (n*D*(4 + 4 [+ c]) + 3*n*F*c). No autocast weight cache: Lightning enters
                         autocast with ``cache_enabled=False``, so each weight's bf16 copy is made when it is
                         used and freed after (measured on an H100: 2.7B bf16-mixed forward peaks at the fp32
                         parameters plus 0.2-0.9 GiB at contexts 128-2048, not plus the 6.3 GiB a cache of
                         bf16 weights would hold)

plus a fixed CUDA workspace term (cuBLAS / cuBLASLt workspaces come from PyTorch's caching allocator and
are counted by ``max_memory_allocated``; see ``CUDA_WORKSPACE_BYTES``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmtrain.config import ModelConfig
from lmtrain.flops import STEP_MODES, parameter_count

GIB = 1024**3

#: Lightning precision strings the planner understands.
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")

#: Attention backends whose saved tensors the planner models (others are planned like ``sdpa``).
PLANNED_BACKENDS = ("naive", "sdpa", "flash_pytorch", "flash_triton")

#: cuBLAS / cuBLASLt workspace that PyTorch allocates through its caching allocator at the first matrix
#: product on a CUDA device: 28 MiB measured on an H100 with torch 2.11 + CUDA 13.0 (``memory_allocated``
#: before and after a first fp32 ``mm``, output excluded; a later bf16 ``mm`` added nothing).
CUDA_WORKSPACE_BYTES = 28 * 1024**2


def _widths(precision: str) -> tuple[int, int, bool]:
    """(compute bytes c, parameter bytes w, autocast?) for a Lightning precision string."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "32-true":
        return 4, 4, False
    if precision.endswith("-mixed"):
        return 2, 4, True
    return 2, 2, False


def parameter_tensor_count(cfg: ModelConfig) -> int:
    """Number of parameter tensors of ``TransformerLM(cfg)`` (one AdamW ``step`` tensor each)."""
    per_layer = 2 + 2 + 3  # two RMSNorm gains, qkv + out, w1 + w2 + w3
    return 3 + cfg.num_layers * per_layer  # embedding, final norm gain, output head


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
        "weight_casts": (4 * d * d + 3 * d * f) * c if mixed else 0,
    }
    if cfg.attention == "naive":
        terms["attention"] = n * d * c + t * t + b * h * t * t * 4 + (b * h * t * t * c if c != 4 else 0)
    else:
        lse_len = -(-t // 32) * 32 if device_type == "cuda" and cfg.attention == "sdpa" and c == 4 else t
        terms["attention"] = 3 * n * d * c + n * d * c + b * h * lse_len * 4
    return terms


def head_activation_bytes(
    cfg: ModelConfig, batch_size: int, seq_len: int, precision: str = "32-true"
) -> dict[str, int]:
    """Bytes saved for backward outside the layers: final norm, output head, loss, token ids."""
    c, _, mixed = _widths(precision)
    n, d, v = batch_size * seq_len, cfg.d_model, cfg.vocab_size
    return {
        "final_norm": n * d * 4 + n * d * 4 + n * 4,
        "head_input": n * d * c,
        "head_weight_cast": v * d * c if mixed else 0,
        "log_softmax": n * v * 4,
        "tokens": batch_size * (seq_len + 1) * 8 + n * 8 + 4,  # embedding indices, flat targets, loss weight
    }


def saved_activation_bytes(
    cfg: ModelConfig, batch_size: int, seq_len: int, precision: str = "32-true", device_type: str = "cuda"
) -> int:
    """Total bytes autograd saves for backward in one forward pass (what ``saved_tensors_hooks`` counts)."""
    head = sum(head_activation_bytes(cfg, batch_size, seq_len, precision).values())
    if cfg.activation_checkpointing:
        r = 2 if precision.endswith("-true") and precision != "32-true" else 4
        return cfg.num_layers * batch_size * seq_len * cfg.d_model * r + head
    layer = sum(layer_activation_bytes(cfg, batch_size, seq_len, precision, device_type).values())
    return cfg.num_layers * layer + head


@dataclass
class MemoryEstimate:
    """A memory plan: components in bytes and the predicted peak.

    Attributes:
        components: name -> bytes (parameters, gradients, optimizer_states, activations, transients,
            workspace), the terms that sum to ``peak``.
        peak: predicted ``torch.cuda.max_memory_allocated`` of the step, in bytes.
        moment: which moment of the step sets the peak (see the module docstring).
        details: the activation terms of one layer and of the head, and all gradient bytes, for the curious.
    """

    components: dict[str, int]
    peak: int
    moment: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_gib(self) -> float:
        return self.peak / GIB

    def table(self) -> str:
        """Markdown table (component, GiB) ending with the peak."""
        rows = [f"| {k} | {v / GIB:.3f} |" for k, v in self.components.items()]
        rows.append(f"| **peak** ({self.moment}) | **{self.peak_gib:.3f}** |")
        return "\n".join(["| component | GiB |", "| --- | --- |", *rows])


def estimate_memory(
    cfg: ModelConfig,
    batch_size: int,
    seq_len: int | None = None,
    precision: str = "32-true",
    mode: str = "train",
    device_type: str = "cuda",
) -> MemoryEstimate:
    """Predicted peak memory of one step (see the module docstring for every term).

    Args:
        cfg: model shape (attention backend and activation checkpointing included).
        batch_size: sequences per batch.
        seq_len: tokens per sequence (None: ``cfg.context_length``).
        precision: Lightning precision string (``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``).
        mode: ``train`` (AdamW), ``forward_backward`` or ``forward``.
        device_type: ``cuda`` (adds the workspace term) or ``cpu``.
    """
    if mode not in STEP_MODES:
        raise ValueError(f"mode must be one of {STEP_MODES}, got {mode!r}")
    t = cfg.context_length if seq_len is None else seq_len
    c, w, mixed = _widths(precision)
    b, n, v = batch_size, batch_size * t, cfg.vocab_size
    p = parameter_count(cfg)
    params = p * w + t * cfg.head_dim * 4  # + RoPE cos/sin buffers (built for the context length)
    grads = p * w
    optim = 2 * p * w + parameter_tensor_count(cfg) * 4 if mode == "train" else 0
    workspace = CUDA_WORKSPACE_BYTES if device_type == "cuda" else 0
    layer = layer_activation_bytes(cfg, b, t, precision, device_type)
    head = head_activation_bytes(cfg, b, t, precision)
    details = {"layer": layer, "head": head, "gradients": {"all": grads}}

    if mode == "forward":
        weight_cast = cfg.d_model * max(v, cfg.d_ff, 3 * cfg.d_model) * c if mixed else 0  # largest weight, cast
        # Largest of: the loss (logits, their fp32 copy, the log-softmax) and a SwiGLU block (residual,
        # fp32 norm output and its cast, silu(w1 x), w3 x and their product).
        loss = n * v * (c + 4 + (4 if c != 4 else 0))
        block = n * cfg.d_model * (4 + 4 + (c if mixed else 0)) + 3 * n * cfg.d_ff * c
        transient = max(loss, block)
        components = {"parameters": params, "weight_cast": weight_cast, "transients": transient,
                      "workspace": workspace}
        return MemoryEstimate(components, sum(components.values()), "forward (no_grad)", details)

    saved = saved_activation_bytes(cfg, b, t, precision, device_type)
    recompute = sum(layer.values()) if cfg.activation_checkpointing else 0
    # Each moment: (gradients, activations, transients) alive at that point of the step. No gradients exist
    # before the backward pass: LMModule.optimizer_step frees them after each step.
    moments = {
        "end of forward": (0, saved, n * v * c + (n * v * 4 if c != 4 else 0)),
        "backward start": (0, saved, 2 * n * v * 4 + n * v * c + recompute),
        "end of backward": (grads, 0, n * cfg.d_model * 4),
    }
    if cfg.attention == "naive" and not cfg.activation_checkpointing:
        # Last layer, inside softmax: its post-attention activations and the head's do not exist yet.
        post_attention = (layer["swiglu"] + layer["linear_inputs"] * 3 // 4 + layer["norm_inputs"] // 2
                          + layer["norm_scaled"] // 2 + layer["norm_rsqrt"] // 2)
        scores = b * cfg.num_heads * t * t * (2 * c + 4 if c != 4 else 2 * 4)
        moments["naive softmax (last layer)"] = (0, saved - sum(head.values()) - post_attention,
                                                 scores)
    moment = max(moments, key=lambda k: sum(moments[k]))
    grads_part, activations, transients = moments[moment]
    components = {"parameters": params, "gradients": grads_part, "optimizer_states": optim,
                  "activations": activations, "transients": transients, "workspace": workspace}
    return MemoryEstimate(components, sum(components.values()), moment, details)


def max_fitting(
    cfg: ModelConfig,
    budget_bytes: int,
    batch_size: int | None = None,
    seq_len: int | None = None,
    precision: str = "32-true",
    mode: str = "train",
    limit: int = 1 << 20,
) -> int:
    """Largest context (``seq_len=None``) or batch size (``batch_size=None``) whose estimate fits the budget.

    Exactly one of ``batch_size`` and ``seq_len`` is None: that one is searched (binary search; the
    estimate grows with both). Returns 0 when even 1 does not fit.
    """
    if (batch_size is None) == (seq_len is None):
        raise ValueError("give exactly one of batch_size and seq_len; the other is searched")

    def fits(x: int) -> bool:
        b, t = (x, seq_len) if batch_size is None else (batch_size, x)
        return estimate_memory(cfg, b, t, precision, mode).peak <= budget_bytes

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


def warn_if_too_large(module: Any, datamodule: Any, trainer: Any) -> MemoryEstimate | None:
    """Warn (once, rank 0) when the plan of ``fit`` exceeds the GPU's memory. Call before ``trainer.fit``.

    Args:
        module: an ``LMModule`` (its ``config`` and ``step_mode`` are read).
        datamodule: an ``LMDataModule`` (its ``batch_size``), or None for batch size 1.
        trainer: the ``Trainer`` (its precision and root device).

    Returns:
        The estimate, or None when the trainer does not run on a CUDA device.
    """
    import torch
    from lightning.pytorch.utilities import rank_zero_warn

    device = getattr(trainer.strategy, "root_device", None)
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    precision = str(trainer.precision)
    if precision not in PRECISIONS:
        return None
    batch = int(getattr(datamodule, "batch_size", 1) or 1)
    plan = estimate_memory(module.config, batch, None, precision, getattr(module, "step_mode", "train"))
    total = torch.cuda.get_device_properties(device).total_memory
    if plan.peak > total:
        cfg = module.config
        fit_t = max_fitting(cfg, total, batch_size=batch, precision=precision, mode=module.step_mode)
        rank_zero_warn(
            f"The memory plan of this run is {plan.peak_gib:.1f} GiB ({plan.moment}) but "
            f"{torch.cuda.get_device_name(device)} has {total / GIB:.1f} GiB: expect CUDA out of memory. "
            f"Largest context that fits at batch size {batch}: {fit_t}. Lower data.batch_size or "
            f"model.context_length, use trainer.precision bf16-mixed, model.attention sdpa/flash_triton, or "
            f"model.activation_checkpointing true (`python -m lmtrain estimate` shows the plan)."
        )
    return plan


# -- many GPUs: DDP and FSDP2 --------------------------------------------------------------------------------
#
# Per-GPU plans of ``estimate_memory_distributed``. ``b`` is the batch size *per GPU*, N the world size.
#
# **DDP** (``trainer.strategy: ddp``): every GPU holds the single-GPU plan at batch b, plus DDP's gradient
# buckets. ``bucket_cap_mb`` (25 MB; the first bucket 1 MB) only sets how the parameters are grouped for
# all-reduce: DDP's reducer allocates one flat buffer per bucket when it is built, and the buckets together
# cover every parameter, so they add P * w bytes for the whole run (from the first forward on). By default
# (``gradient_as_bucket_view=False``) ``param.grad`` tensors are separate and copied into the buckets, so at
# the end of the backward pass the gradients count twice; with ``gradient_as_bucket_view=True`` the
# gradients are views into the buckets and count once (but the buckets exist at every moment).
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
    name = strategy if isinstance(strategy, str) else type(strategy).__name__
    name = name.rsplit(".", 1)[-1].lower()
    if name.startswith("ddp"):
        return "ddp"
    if name in ("modelparallelstrategy", "model_parallel", "fsdp2"):
        return "fsdp"
    if name in ("auto", "single_device", "singledevicestrategy"):
        return "single"
    raise ValueError(f"no memory plan for strategy {strategy!r}; planned: ddp, ModelParallelStrategy (fsdp), auto")


def parameter_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    """Shapes of the parameters of ``TransformerLM(cfg)`` in registration order (embedding, blocks, final
    norm, output head); a block's are attn_norm, qkv, out, mlp_norm, w1, w2, w3."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    block = [(d,), (3 * d, d), (d, d), (d,), (f, d), (d, f), (f, d)]
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
) -> dict[str, tuple[int, int]]:
    """(activations, transients) of each moment of ``estimate_memory``'s training step, gradients left out.

    The same moments and terms as ``estimate_memory`` (see the module docstring), kept apart from the
    gradients so that the distributed plans can add their own gradient and buffer terms to each.
    """
    c, _, _ = _widths(precision)
    b, t, v = batch_size, seq_len, cfg.vocab_size
    n = b * t
    layer = layer_activation_bytes(cfg, b, t, precision, device_type)
    head = head_activation_bytes(cfg, b, t, precision)
    saved = saved_activation_bytes(cfg, b, t, precision, device_type)
    recompute = sum(layer.values()) if cfg.activation_checkpointing else 0
    moments = {
        "end of forward": (saved, n * v * c + (n * v * 4 if c != 4 else 0)),
        "backward start": (saved, 2 * n * v * 4 + n * v * c + recompute),
        "end of backward": (0, n * cfg.d_model * 4),
    }
    if cfg.attention == "naive" and not cfg.activation_checkpointing:
        post_attention = (layer["swiglu"] + layer["linear_inputs"] * 3 // 4 + layer["norm_inputs"] // 2
                          + layer["norm_scaled"] // 2 + layer["norm_rsqrt"] // 2)
        scores = b * cfg.num_heads * t * t * (2 * c + 4 if c != 4 else 2 * 4)
        moments["naive softmax (last layer)"] = (saved - sum(head.values()) - post_attention, scores)
    return moments


def estimate_memory_distributed(
    cfg: ModelConfig,
    batch_size: int,
    seq_len: int | None = None,
    precision: str = "32-true",
    strategy: str = "ddp",
    world_size: int = 2,
    mode: str = "train",
    device_type: str = "cuda",
    gradient_as_bucket_view: bool = False,
) -> MemoryEstimate:
    """Predicted peak memory of one GPU in a data-parallel step (see the comment above for every term).

    Args:
        cfg: model shape (attention backend and activation checkpointing included).
        batch_size: sequences per GPU (the global batch is ``batch_size * world_size``).
        seq_len: tokens per sequence (None: ``cfg.context_length``).
        precision: Lightning precision string; under ``fsdp`` one of ``lmtrain.distributed.FSDP_PRECISIONS``.
        strategy: ``ddp`` or ``fsdp`` (``strategy_kind`` maps Lightning's names); ``single`` gives
            ``estimate_memory``.
        world_size: GPUs in the data-parallel group (nodes x devices).
        mode: ``train`` (AdamW), ``forward_backward`` or ``forward``.
        device_type: ``cuda`` (adds the workspace term) or ``cpu``.
        gradient_as_bucket_view: DDP's option of that name (gradients are views into the buckets).

    Returns:
        The plan of rank 0; ``details`` holds the strategy, the world size and the per-GPU element counts.
    """
    if strategy == "single":
        return estimate_memory(cfg, batch_size, seq_len, precision, mode, device_type)
    if strategy not in DISTRIBUTED_STRATEGIES:
        raise ValueError(f"strategy must be one of {DISTRIBUTED_STRATEGIES} or 'single', got {strategy!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if mode not in STEP_MODES:
        raise ValueError(f"mode must be one of {STEP_MODES}, got {mode!r}")
    t = cfg.context_length if seq_len is None else seq_len
    c, w, _ = _widths(precision)
    p = parameter_count(cfg)
    workspace = CUDA_WORKSPACE_BYTES if device_type == "cuda" else 0
    rope = t * cfg.head_dim * 4

    if strategy == "ddp":
        buckets = p * w
        if mode == "forward":
            single = estimate_memory(cfg, batch_size, t, precision, mode, device_type)
            components = {**single.components, "ddp_buckets": buckets}
            return MemoryEstimate(components, sum(components.values()), single.moment,
                                  {"strategy": "ddp", "world_size": world_size})
        moments = _activation_moments(cfg, batch_size, t, precision, device_type)
        grads_at_end = 0 if gradient_as_bucket_view else p * w
        static = {"parameters": p * w + rope,
                  "optimizer_states": 2 * p * w + parameter_tensor_count(cfg) * 4 if mode == "train" else 0,
                  "ddp_buckets": buckets, "workspace": workspace}
        totals = {k: (grads_at_end if k == "end of backward" else 0, *moments[k]) for k in moments}
        moment = max(totals, key=lambda k: sum(totals[k]))
        grads, activations, transients = totals[moment]
        components = {**static, "gradients": grads, "activations": activations, "transients": transients}
        return MemoryEstimate(components, sum(components.values()), moment,
                              {"strategy": "ddp", "world_size": world_size,
                               "gradient_as_bucket_view": gradient_as_bucket_view})

    # FSDP2.
    from lmtrain.distributed import FSDP_PRECISIONS

    if precision not in FSDP_PRECISIONS:
        raise ValueError(f"FSDP2 runs in {FSDP_PRECISIONS}, got {precision!r}")
    # param_dtype: bf16 under bf16-mixed (the policy), else the parameters' own; reduce_dtype: fp32 or w.
    gather, reduce = (2, 4) if precision == "bf16-mixed" else (w, w)
    act_precision = "bf16-true" if precision == "bf16-mixed" else precision
    root_shapes, block_shapes = _root_and_block_shapes(cfg)
    sharded = sum(shard_numel(s, world_size) for s in parameter_shapes(cfg))
    root_full = world_size * sum(shard_numel(s, world_size) for s in root_shapes)
    block_full = world_size * sum(shard_numel(s, world_size) for s in block_shapes)
    static = {
        "parameters": sharded * w + rope,
        "optimizer_states": 2 * sharded * w + parameter_tensor_count(cfg) * 4 if mode == "train" else 0,
        "root_unsharded": root_full * gather,
        "workspace": workspace,
    }
    details = {"strategy": "fsdp", "world_size": world_size, "sharded_numel": sharded,
               "block_unsharded_numel": block_full, "root_unsharded_numel": root_full,
               "param_dtype_bytes": gather, "reduce_dtype_bytes": reduce}
    in_flight = 2 * block_full * gather if cfg.num_layers > 1 else block_full * gather
    if mode == "forward":
        single = estimate_memory(cfg, batch_size, t, act_precision, mode, device_type)
        components = {**static, "blocks_in_flight": in_flight, "transients": single.components["transients"]}
        return MemoryEstimate(components, sum(components.values()), single.moment, details)
    moments = _activation_moments(cfg, batch_size, t, act_precision, device_type)
    block_reduce = block_full * (gather + reduce)  # a block's unsharded gradients + reduce-scatter input
    totals: dict[str, tuple[int, int, int, int]] = {}  # gradients, buffers, activations, transients
    for k, (activations, transients) in moments.items():
        if k == "end of backward":
            totals[k] = (sharded * w, root_full * (gather + reduce), activations, transients)
        elif k == "backward start":
            totals[k] = (0, in_flight + block_reduce, activations, transients)
        else:
            totals[k] = (0, in_flight, activations, transients)
    moment = max(totals, key=lambda k: sum(totals[k]))
    grads, buffers, activations, transients = totals[moment]
    components = {**static, "gradients": grads, "fsdp_buffers": buffers, "activations": activations,
                  "transients": transients}
    return MemoryEstimate(components, sum(components.values()), moment, details)


def max_fitting_distributed(
    cfg: ModelConfig,
    budget_bytes: int,
    batch_size: int | None = None,
    seq_len: int | None = None,
    precision: str = "32-true",
    strategy: str = "ddp",
    world_size: int = 2,
    mode: str = "train",
    limit: int = 1 << 20,
    gradient_as_bucket_view: bool = False,
) -> int:
    """Largest context (``seq_len=None``) or batch size per GPU (``batch_size=None``) whose per-GPU plan
    fits ``budget_bytes``; 0 when even 1 does not. Arguments as in ``estimate_memory_distributed``."""
    if (batch_size is None) == (seq_len is None):
        raise ValueError("give exactly one of batch_size and seq_len; the other is searched")

    def fits(x: int) -> bool:
        b, t = (x, seq_len) if batch_size is None else (batch_size, x)
        plan = estimate_memory_distributed(cfg, b, t, precision, strategy, world_size, mode,
                                           gradient_as_bucket_view=gradient_as_bucket_view)
        return plan.peak <= budget_bytes

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
