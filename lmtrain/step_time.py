"""Step time and tokens per second on N GPUs under FSDP2 or DDP, from a one-GPU step and measured bus bandwidths.

The model (also in ``docs/distributed.md``, "Predicting step time"); every rank runs the same per-GPU batch:

- **Compute.** The forward and backward times of one GPU at that batch (a ``bench model`` record, a calibration
  file, or the step's FLOPs at an assumed MFU), the same on every rank. They are split over the FSDP units in
  proportion to their FLOPs: each block gets an equal share, the root (embedding, final norm, output head) the rest.
- **Optimizer.** The one-GPU AdamW time, divided by N under FSDP2 (each rank updates its shard), whole under DDP.
- **Communication.** A collective moving a whole buffer of ``size`` bytes over n ranks takes
  ``size * (n - 1) / n / busbw`` (all-gather, reduce-scatter) or ``2 * size * (n - 1) / n / busbw`` (all-reduce),
  with ``busbw`` the bus bandwidth that ``bench comm`` measured at that message size (interpolated on log size;
  across nodes the smaller of it and the inter-node bandwidth per GPU). FSDP2 all-gathers each unit's parameters in
  the compute dtype before its forward, again before its backward for every block resharded after forward (all but
  the last; the root stays unsharded), and reduce-scatters each unit's gradients in fp32 (``bf16-mixed``; the
  parameters' own dtype otherwise; FSDP2's ``reduce_dtype``, fp32 with ``model.master_weights`` too, whose masters
  are the fp32 shards). DDP all-reduces the gradients in buckets of ``bucket_cap_mb`` in their own dtype: fp32 under
  ``bf16-mixed``, but bf16 for the linear weights under ``model.master_weights`` (they are bf16 parameters before DDP
  wraps the model), bf16 under ``bf16-true``.
- **Overlap.** A collective overlaps the compute running while it runs and nothing else:
  forward: the root's and the first block's all-gathers are exposed, then block i+1's all-gather hides behind block
  i's forward (exposed: what exceeds it); backward: block k's backward hides block k-1's all-gather (prefetch) and
  block k+1's reduce-scatter; the last two reduce-scatters (block 0, then the root) are exposed. DDP: the all-reduce
  hides behind the backward except its last bucket.

- **Slowed compute.** NCCL's kernels take SMs and memory bandwidth from the compute beside them: while
  communication runs, compute progresses ``overlap_slowdown`` (s) times slower (KernelShare's
  ``kernels/compute_beside_comm_slowdown``). Where compute of ``b`` ms overlaps communication of ``c`` ms, the
  stretch takes ``c + max(0, b - c / s)`` instead of ``max(b, c)``: ``c * (1 - 1 / s)`` more when the compute is
  the longer, less when the communication is, nothing once the slowed compute fits under it (:func:`slowed_ms`).

Step = forward + backward + optimizer + exposed communication + slowed compute; tokens/s = N x batch x context /
step. Not modelled: host launch overhead, stragglers.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def ddp_bucket_bytes(ddp_kwargs: Mapping[str, Any] | None = None) -> int:
    """Bytes of one DDP all-reduce bucket under ``DDPStrategy(**ddp_kwargs)``: their ``bucket_cap_mb`` MiB, else
    ``DistributedDataParallel``'s own default (25 MiB). None: lmtrain's ``strategy: ddp``
    (``lmtrain.distributed.DDP_DEFAULTS``)."""
    if ddp_kwargs is None:
        from lmtrain.distributed import DDP_DEFAULTS

        ddp_kwargs = DDP_DEFAULTS
    cap = ddp_kwargs.get("bucket_cap_mb")
    if cap is None:
        # DistributedDataParallel's default when bucket_cap_mb is None; PyTorch keeps it in this module constant.
        from torch.nn.parallel.distributed import _DEFAULT_BUCKET_CAP_MB

        cap = _DEFAULT_BUCKET_CAP_MB
    return int(cap * 1024**2)


@dataclass(frozen=True)
class BusBandwidth:
    """Bus bandwidth (GB/s, 1e9 bytes) of one collective as a function of the message size.

    Args:
        sizes: whole-buffer message sizes in bytes, ascending.
        gbps: the bus bandwidth measured at each size.
        source: where the numbers come from (a record's path, or "assumed").
    """

    sizes: tuple[int, ...]
    gbps: tuple[float, ...]
    source: str = "assumed"

    @classmethod
    def constant(cls, gbps: float, source: str = "assumed") -> BusBandwidth:
        return cls((1,), (gbps,), source)

    def at(self, size: int) -> float:
        """GB/s at ``size`` bytes: linear in log size between measured sizes, the nearest one outside them."""
        if size <= self.sizes[0]:
            return self.gbps[0]
        if size >= self.sizes[-1]:
            return self.gbps[-1]
        i = bisect.bisect_right(self.sizes, size)
        lo, hi = self.sizes[i - 1], self.sizes[i]
        t = (math.log(size) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return self.gbps[i - 1] + t * (self.gbps[i] - self.gbps[i - 1])


@dataclass(frozen=True)
class Network:
    """The bus bandwidths of one machine (and across machines).

    Args:
        all_gather, reduce_scatter, all_reduce: intra-node bus bandwidth per collective.
        inter_node_gbps: bus bandwidth per GPU between nodes (its network interface), the ceiling when the ranks
            span several nodes.
    """

    all_gather: BusBandwidth
    reduce_scatter: BusBandwidth
    all_reduce: BusBandwidth
    inter_node_gbps: float

    def busbw(self, op: str, size: int, nodes: int) -> float:
        gbps = getattr(self, op).at(size)
        return min(gbps, self.inter_node_gbps) if nodes > 1 else gbps


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw of ``op`` on ``world_size`` ranks (nccl-tests' factors; ``lmtrain.bench.comm`` measures with
    them)."""
    n = world_size
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def collective_ms(op: str, size: int, world_size: int, busbw_gbps: float) -> float:
    """Milliseconds of ``op`` on a ``size``-byte buffer over ``world_size`` ranks at ``busbw_gbps`` (nccl-tests)."""
    if world_size < 2:
        return 0.0
    return size * bus_factor(op, world_size) / (busbw_gbps * 1e9) * 1e3


@dataclass(frozen=True)
class Units:
    """What the step time depends on in the model: the FSDP units' sizes and compute shares.

    Args:
        layers: transformer blocks (one FSDP unit each).
        block_params: parameters of one block.
        root_params: parameters of the root unit (embedding, final norm, output head).
        block_flops_share: share of the step's FLOPs in one block (the root has ``1 - layers * share``).
        gather_bytes: bytes per parameter all-gathered (the compute dtype under FSDP2's policy).
        grad_bytes: bytes per gradient element reduced (FSDP2's ``reduce_dtype``; under DDP the gradients' dtype).
        ddp_bf16_grads: gradient elements DDP all-reduces in bf16 whatever ``grad_bytes`` says: the linear weights
            under ``model.master_weights``, which are bf16 parameters before DDP wraps the model.
    """

    layers: int
    block_params: int
    root_params: int
    block_flops_share: float
    gather_bytes: int
    grad_bytes: int
    ddp_bf16_grads: int = 0

    def ddp_gradient_bytes(self) -> int:
        """Bytes DDP all-reduces in one step: every gradient in its own dtype."""
        params = self.layers * self.block_params + self.root_params
        return self.ddp_bf16_grads * 2 + (params - self.ddp_bf16_grads) * self.grad_bytes


@dataclass
class StepPrediction:
    """A predicted step on each of ``world_size`` GPUs; milliseconds unless named otherwise."""

    strategy: str
    world_size: int
    nodes: int
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    communication_ms: float  # every collective of the step, end to end
    exposed_ms: float  # the part not hidden behind compute
    tokens_per_step: int  # per GPU
    terms: dict[str, float] = field(default_factory=dict)  # collective times by name
    overlap_slowdown: float = 1.0  # compute beside communication runs this many times as long
    slowed_ms: float = 0.0  # step time the communication costs the compute beside it (:func:`slowed_ms`)

    @property
    def hidden_ms(self) -> float:
        """Communication hidden behind compute."""
        return max(0.0, self.communication_ms - self.exposed_ms)

    @property
    def step_ms(self) -> float:
        return self.forward_ms + self.backward_ms + self.optimizer_ms + self.exposed_ms + self.slowed_ms

    @property
    def tokens_per_s(self) -> float:
        """All GPUs together."""
        return self.world_size * self.tokens_per_step / (self.step_ms * 1e-3)


def units(cfg: object, batch_size: int, seq_len: int, precision: str) -> Units:
    """The FSDP units of ``TransformerLM(cfg)`` (``lmtrain.distributed.shard_model``): parameters and FLOP shares,
    and the dtypes the collectives move under ``precision``.

    FSDP2 all-gathers in its policy's ``param_dtype`` and reduce-scatters in its ``reduce_dtype``
    (``lmtrain.distributed.mixed_precision_policy``: bf16 and fp32 under ``bf16-mixed``, with or without master
    weights, whose masters are the fp32 shards; the parameters' dtype otherwise). DDP all-reduces each gradient in
    its parameter's dtype: fp32 under ``bf16-mixed`` and ``16-mixed``, bf16 under ``bf16-true``, and under
    ``model.master_weights`` bf16 for the linear weights (``LMModule.configure_model`` makes them bf16 before DDP
    wraps the model), fp32 for the embedding and the norm gains.
    """
    from lmtrain.flops import flops_per_step, matmul_parameter_count, parameter_count

    layers = cfg.num_layers
    root_params = 2 * cfg.vocab_size * cfg.d_model + cfg.d_model  # embedding, output head, final norm
    block_params = (parameter_count(cfg) - root_params) // layers
    total = flops_per_step(cfg, batch_size, seq_len, "train")
    head = 3 * 2.0 * batch_size * seq_len * cfg.d_model * cfg.vocab_size  # the output projection's matmul
    gather = 2 if precision.startswith("bf16") or precision.startswith("16") else 4
    grad = 2 if precision in ("bf16-true", "16-true") else 4
    master_weights = getattr(cfg, "master_weights", False) and precision == "bf16-mixed"
    bf16_grads = matmul_parameter_count(cfg) if master_weights else 0
    return Units(layers, block_params, root_params, (total - head) / layers / total, gather, grad, bf16_grads)


def slowed_ms(compute_ms: float, comm_ms: float, slowdown: float) -> float:
    """What a stretch of ``compute_ms`` of compute beside ``comm_ms`` of communication takes beyond
    ``max(compute, comm)`` when the compute runs ``slowdown`` times slower while the communication runs.

    During the communication the compute does ``comm / slowdown`` ms of its work, the rest after it at full speed:
    the stretch takes ``comm + max(0, compute - comm / slowdown)``.
    """
    return max(0.0, compute_ms - comm_ms / slowdown) - max(0.0, compute_ms - comm_ms)


def predict(u: Units, forward_ms: float, backward_ms: float, optimizer_ms: float, strategy: str, world_size: int,
            nodes: int, network: Network, tokens_per_step: int, reshard: str = "blocks",
            bucket_bytes: int | None = None, overlap_slowdown: float = 1.0) -> StepPrediction:
    """The step on ``world_size`` GPUs over ``nodes`` nodes under ``strategy`` (``fsdp``, ``ddp`` or ``single``),
    from one GPU's ``forward_ms``, ``backward_ms`` and ``optimizer_ms`` at the same per-GPU batch (see the module
    docstring for the model). ``reshard`` is ``model.fsdp_reshard_after_forward``: ``blocks`` (every block but the
    last is all-gathered again in the backward), ``all`` (the last too, exposed at the backward's start) or ``none``
    (no all-gather in the backward). ``bucket_bytes`` is DDP's bucket (:func:`ddp_bucket_bytes`; None: that of
    lmtrain's ``strategy: ddp``). ``overlap_slowdown`` (at least 1) is how many times as long compute takes beside
    communication (:func:`slowed_ms`, summed over the overlapped stretches; 1: not slowed)."""
    if not overlap_slowdown >= 1.0:
        raise ValueError(f"overlap_slowdown must be at least 1, got {overlap_slowdown!r}")
    n = world_size
    pred = StepPrediction(strategy, n, nodes, forward_ms, backward_ms, optimizer_ms, 0.0, 0.0, tokens_per_step,
                          overlap_slowdown=overlap_slowdown)
    if strategy == "single" or n < 2:
        return pred

    def ms(op: str, size: int) -> float:
        return collective_ms(op, size, n, network.busbw(op, size, nodes))

    if strategy == "ddp":
        grads = u.ddp_gradient_bytes()
        total = ms("all_reduce", grads)
        last = ms("all_reduce", min(grads, ddp_bucket_bytes() if bucket_bytes is None else bucket_bytes))
        pred.terms = {"all_reduce": total, "all_reduce_last_bucket": last}
        pred.communication_ms, pred.exposed_ms = total, max(last, total - backward_ms)
        # all but the last bucket beside the backward pass
        pred.slowed_ms = slowed_ms(backward_ms, max(0.0, total - last), overlap_slowdown)
        return pred
    if strategy != "fsdp":
        raise ValueError(f"strategy must be 'single', 'ddp' or 'fsdp', got {strategy!r}")
    pred.optimizer_ms = optimizer_ms / n
    ag_block = ms("all_gather", u.block_params * u.gather_bytes)
    ag_root = ms("all_gather", u.root_params * u.gather_bytes)
    rs_block = ms("reduce_scatter", u.block_params * u.grad_bytes)
    rs_root = ms("reduce_scatter", u.root_params * u.grad_bytes)
    fwd_block, bwd_block = forward_ms * u.block_flops_share, backward_ms * u.block_flops_share
    L = u.layers
    exposed_fwd = ag_root + ag_block + (L - 1) * max(0.0, ag_block - fwd_block)
    # Backward, block k = L-1 .. 0: k-1's all-gather (none for k = 0) and k+1's reduce-scatter (none for k = L-1)
    # run under k's backward; then block 0's and the root's reduce-scatters are left.
    if reshard not in ("blocks", "all", "none"):
        raise ValueError(f"reshard must be 'blocks', 'all' or 'none', got {reshard!r}")
    regather = reshard != "none"
    hidden = [(ag_block if k >= 1 and regather else 0.0) + (rs_block if k <= L - 2 else 0.0) for k in range(L)]
    exposed_bwd = sum(max(0.0, c - bwd_block) for c in hidden) + rs_block + rs_root
    if reshard == "all":  # the last block, resharded after its forward, is gathered again before any backward
        exposed_bwd += ag_block
    pred.terms = {"all_gather_block": ag_block, "all_gather_root": ag_root, "reduce_scatter_block": rs_block,
                  "reduce_scatter_root": rs_root}
    # Forward: every unit once; backward: the resharded blocks again; every unit reduce-scattered.
    regathered = {"blocks": L - 1, "all": L, "none": 0}[reshard]
    pred.communication_ms = ag_root + L * ag_block + regathered * ag_block + L * rs_block + rs_root
    pred.exposed_ms = exposed_fwd + exposed_bwd
    pred.slowed_ms = ((L - 1) * slowed_ms(fwd_block, ag_block, overlap_slowdown)
                      + sum(slowed_ms(bwd_block, c, overlap_slowdown) for c in hidden))
    return pred


def network_from_record(record: dict | None, source: str, intra_node_gbps: float, inter_node_gbps: float) -> Network:
    """The bus bandwidths of a ``bench comm`` record (``None``: ``intra_node_gbps`` for every collective)."""
    if record is None:
        assumed = BusBandwidth.constant(intra_node_gbps)
        return Network(assumed, assumed, assumed, inter_node_gbps)
    from lmtrain.errors import LmtrainError

    curves = {}
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        try:
            rows = sorted((int(r["bytes"]), float(r["busbw_gbps"])) for r in record["rows"] if r.get("op") == op)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LmtrainError("--comm", f"{source}: a row of {op} has no numeric bytes and busbw_gbps "
                               f"({type(exc).__name__}: {exc}).", "give a `bench comm --out` record.") from None
        if any(b <= 0 or not (g > 0 and math.isfinite(g)) for b, g in rows):
            raise LmtrainError("--comm", f"{source}: a row of {op} has bytes or busbw_gbps at or below 0.",
                               "give a `bench comm --out` record.")
        curves[op] = BusBandwidth(tuple(s for s, _ in rows), tuple(g for _, g in rows), source) if rows else \
            BusBandwidth.constant(intra_node_gbps)
    return Network(curves["all_gather"], curves["reduce_scatter"], curves["all_reduce"], inter_node_gbps)


def describe(pred: StepPrediction, inputs: Sequence[str]) -> str:
    """The prediction as text: the inputs used, the terms, step time and tokens/s."""
    lines = ["inputs:"] + [f"  {line}" for line in inputs]
    lines.append(f"prediction: {pred.strategy} on {pred.world_size} GPU(s)"
                 + (f" over {pred.nodes} nodes" if pred.nodes > 1 else ""))
    slowed = (f" + compute slowed beside communication {pred.slowed_ms:.2f} ms ({pred.hidden_ms:.2f} ms hidden at "
              f"{pred.overlap_slowdown:g}x)" if pred.slowed_ms > 0 else "")
    lines.append(f"  forward {pred.forward_ms:.2f} ms + backward {pred.backward_ms:.2f} ms + optimizer "
                 f"{pred.optimizer_ms:.2f} ms + exposed communication {pred.exposed_ms:.2f} ms "
                 f"(of {pred.communication_ms:.2f} ms in all){slowed} = step {pred.step_ms:.2f} ms")
    if pred.terms:
        lines.append("  collectives: " + ", ".join(f"{k} {v:.3f} ms" for k, v in pred.terms.items()))
    lines.append(f"  {pred.tokens_per_s:,.0f} tokens/s in all, {pred.tokens_per_s / pred.world_size:,.0f} per GPU")
    return "\n".join(lines)


@dataclass(frozen=True)
class OneGpuStep:
    """The one-GPU times the prediction scales, and where they come from."""

    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    source: str


def one_gpu_from_record(record: dict, source: str, size: str | None, batch_size: int, seq_len: int, precision: str,
                        attention: str | None = None, compile: bool | None = None) -> OneGpuStep:
    """The one-GPU step of a ``bench model`` record (``{"meta", "rows"}``) or a calibration file
    (``{"forward_ms", "backward_ms", "optimizer_ms"}``).

    Of a record, the first ``ok`` training row at this size, batch, context and precision with the three phase times,
    preferring one with the same attention backend and compile setting.

    Raises:
        LmtrainError: the file holds no such row, or is neither form.
    """
    from lmtrain.errors import LmtrainError

    keys = ("forward_ms", "backward_ms", "optimizer_ms")
    if all(isinstance(record.get(k), (int, float)) for k in keys):
        times = [float(record[k]) for k in keys]
        if not all(math.isfinite(t) and t >= 0 for t in times) or sum(times) <= 0:
            raise LmtrainError("--calibrate", f"{source}: the phase times must be finite, at least 0 and not all 0 "
                               f"(got {dict(zip(keys, times, strict=True))}).",
                               "give the medians of a measured one-GPU step, in ms.")
        return OneGpuStep(*times, source=source)
    rows = record.get("rows") if isinstance(record.get("rows"), list) else None
    if rows is None:
        raise LmtrainError("--calibrate", f"{source} is neither a bench model record nor a calibration file.",
                           'give `bench model --out` JSON, or {"forward_ms": F, "backward_ms": B, "optimizer_ms": O}.')
    wanted = {"size": size, "batch_size": batch_size, "context": seq_len, "precision": precision}
    timed = [r for r in rows if r.get("status") == "ok" and r.get("mode", "train") == "train"
             and all(isinstance(r.get(f"{k}_mean"), (int, float)) for k in keys)]
    matching = [r for r in timed if all(r.get(k) == v for k, v in wanted.items())]
    if not matching:
        held = sorted({f"{r.get('size')} batch {r.get('batch_size')} context {r.get('context')} {r.get('precision')}"
                       for r in timed})
        raise LmtrainError("--calibrate", f"{source} has no timed training step of {size} at batch {batch_size}, "
                           f"context {seq_len}, {precision} (it holds: {', '.join(held[:6]) or 'none'}).",
                           "measure that step with `python -m lmtrain bench model`, or plan the step the record has.")
    best = max(matching, key=lambda r: (r.get("attention") == attention,
                                        str(r.get("compile")) in (str(compile), "on" if compile else "off")))
    return OneGpuStep(*(float(best[f"{k}_mean"]) for k in keys),
                      source=f"{source} (row {best.get('key', '')})")


def one_gpu_from_flops(cfg: object, batch_size: int, seq_len: int, peak_flops: float, mfu: float,
                       memory_gbps: float) -> OneGpuStep:
    """The one-GPU step assumed: the step's FLOPs at ``mfu`` of ``peak_flops`` (forward a third, backward two
    thirds), AdamW moving 28 bytes per parameter at ``memory_gbps``."""
    from lmtrain.flops import flops_per_step, parameter_count

    compute_ms = flops_per_step(cfg, batch_size, seq_len, "train") / (peak_flops * mfu) * 1e3
    optimizer_ms = 28 * parameter_count(cfg) / (memory_gbps * 1e9) * 1e3
    return OneGpuStep(compute_ms / 3, 2 * compute_ms / 3, optimizer_ms,
                      source=f"assumed: the step's FLOPs at MFU {mfu:g} of {peak_flops / 1e12:g} TFLOP/s, AdamW at "
                             f"28 bytes per parameter and {memory_gbps:g} GB/s")
