"""Ready-made studies of ``python -m lmtrain bench model --study NAME``: sweep presets and their tables.

Each study is a preset of the sweep flags of ``lmtrain.bench.model`` (flags given explicitly override it) and
a function that turns the study's rows into the tables of the reference profiling study. A preset may list
``variants``: partial presets (flag name -> values, like the preset's own) that each override the preset; the
study's cells are then the union of the variants' products, the cells of one size and context adjacent, in
variant order. Steps are kept modest (warm-up 3, 10 measured steps unless a study says otherwise) so that a
study fits a short GPU session; raise ``--steps`` for tighter error bars.

    timing              all five sizes x contexts 128, 256, 512, 1024; forward and forward+backward; fp32
    warmup              small at context 512, warm-up 0, 1, 2, 5: mean, std and the first step
    precision           fp32 vs bf16-mixed per size (contexts 128, 512, 1024), forward+backward and train; speed-up
    compile             eager vs torch.compile: all five sizes at contexts 128, 512, 1024; forward, fwd+bwd, train
    memory              2.7B at contexts 128, 256, 512, 1024, 2048: forward vs train, fp32 vs bf16-mixed peaks
                        next to the memory plan (warm-up 1, 2 steps: a peak needs no statistics); on an
                        80 GB GPU the 2048 train cells run out of memory
    attention-backends  small, bf16-mixed, forward+backward: naive vs sdpa vs flash_triton at contexts 256
                        .. 16384, stopping each backend at its first OOM
    long-context        2.7B bf16-mixed batch 4, train, contexts 2048 .. 32768 x checkpointing full / selective /
                        offload x optimizer in backward off/on x loss chunks 0/4096 x sdpa, flash_triton, stopping
                        each combination at its first OOM (warm-up 1, 2 steps); the plan and its error per cell,
                        whether it said "fits", and the planner's record over the study (docs/long_context.md)
    speed               the five sizes at context 512 and small at 128, bf16-mixed, batch 4, train, warm-up 5,
                        20 steps; variants eager, compile, compile+graphs, compile+graphs+overlap,
                        compile+graphs+master (full and compact optimizer state), that fast recipe with float8
                        linears (tensorwise, rowwise) and the plain-PyTorch reference (torch.compile
                        reduce-overhead):
                        step time by the timer, by the cell's own CUDA events and per step of the pipeline,
                        tokens/s, MFU, peak, speed-up vs eager, and each variant's losses against eager's
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmtrain.analysis.tables import markdown_table
from lmtrain.bench.tables import fmt, fmt_ms, is_on, markdown_rows, skipped_by_plan, status_text
from lmtrain.config import STUDY_SIZES
from lmtrain.memory_plan import GIB, usable_bytes

Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class Study:
    """A named sweep preset and its tables."""

    name: str
    title: str
    preset: dict[str, Any]
    render: Callable[[Rows], str]


def _step_or_status(row: dict[str, Any] | None, phase: str = "step") -> str:
    if row is None:
        return "not run"
    return fmt_ms(row, phase) if row.get("status") == "ok" else status_text(row)


def _index(rows: Rows, *keys: str) -> dict[tuple, dict[str, Any]]:
    return {tuple(r.get(k) for k in keys): r for r in rows}


def _ordered(values: list[Any]) -> list[Any]:
    """Unique values, the study's model sizes in table order, others as first seen."""
    unique = list(dict.fromkeys(values))
    rank = {s: i for i, s in enumerate(STUDY_SIZES)}
    return sorted(unique, key=lambda v: (rank.get(v, len(rank)), unique.index(v)))


def render_timing(rows: Rows) -> str:
    """The reference study's table: per size and context, forward and forward+backward (and backward alone) in ms."""
    idx = _index(rows, "size", "context", "precision", "mode")
    lines = ["### Timing (ms per step, mean ± std over the measured steps)", ""]
    for precision in _ordered([r["precision"] for r in rows]):
        body = []
        for size in _ordered([r["size"] for r in rows]):
            for t in sorted({r["context"] for r in rows if r["size"] == size}):
                fwd = idx.get((size, t, precision, "forward"))
                fb = idx.get((size, t, precision, "forward_backward"))
                params = (fwd or fb or {}).get("params")
                body.append([size, fmt(params, ","), t, _step_or_status(fwd), _step_or_status(fb),
                             _step_or_status(fb, "backward"), fmt((fb or {}).get("tokens_per_s"), ",.0f"),
                             fmt((fb or {}).get("mfu"), ".1%")])
        lines += [f"precision `{precision}`", "", markdown_table(
            ["size", "params", "context", "forward ms", "forward+backward ms", "backward ms (in fwd+bwd)",
             "tokens/s (fwd+bwd)", "MFU (fwd+bwd)"], body), ""]
    return "\n".join(lines).rstrip()


def render_warmup(rows: Rows) -> str:
    """Warm-up effect: mean, std and max of the measured steps, and the very first step, per warm-up count."""
    body = [[r["size"], r["context"], r["mode"], r["warmup"], _step_or_status(r), fmt(r.get("step_ms_max"), ".2f"),
             fmt(r.get("first_step_ms"), ".2f")] for r in sorted(rows, key=lambda r: (r["size"], r["warmup"]))]
    return "\n".join(["### Warm-up (ms per step)", "", markdown_table(
        ["size", "context", "mode", "warm-up steps", "step ms (measured)", "max step ms (measured)",
         "first step ms (of the run)"], body)])


def _speedup(base: dict[str, Any] | None, new: dict[str, Any] | None) -> str:
    a, b = (base or {}).get("step_ms_mean"), (new or {}).get("step_ms_mean")
    return f"{a / b:.2f}x" if a and b else "-"


def render_precision(rows: Rows) -> str:
    """fp32 vs bf16-mixed per size, context and mode: step times, speed-up, peaks."""
    idx = _index(rows, "size", "context", "mode", "precision")
    body = []
    for size in _ordered([r["size"] for r in rows]):
        for mode in _ordered([r["mode"] for r in rows]):
            for t in sorted({r["context"] for r in rows if r["size"] == size}):
                fp32, bf16 = idx.get((size, t, mode, "32-true")), idx.get((size, t, mode, "bf16-mixed"))
                if fp32 is None and bf16 is None:
                    continue
                body.append([size, t, mode, _step_or_status(fp32), _step_or_status(bf16), _speedup(fp32, bf16),
                             fmt((fp32 or {}).get("peak_gib"), ".2f"), fmt((bf16 or {}).get("peak_gib"), ".2f")])
    return "\n".join(["### FP32 vs BF16 mixed precision (ms per step)", "", markdown_table(
        ["size", "context", "mode", "fp32 ms", "bf16-mixed ms", "speed-up", "fp32 peak GiB", "bf16 peak GiB"],
        body)])


def render_compile(rows: Rows) -> str:
    """Eager vs torch.compile per size, context, precision and mode: forward / backward / optimizer / step."""
    idx = _index(rows, "size", "context", "precision", "mode", "compile")
    body = []
    for size in _ordered([r["size"] for r in rows]):
        for precision in _ordered([r["precision"] for r in rows]):
            for mode in _ordered([r["mode"] for r in rows]):
                for t in sorted({r["context"] for r in rows}):
                    eager, comp = idx.get((size, t, precision, mode, "off")), idx.get((size, t, precision, mode, "on"))
                    if eager is None and comp is None:
                        continue
                    body.append([size, t, precision, mode, _step_or_status(eager, "forward"),
                                 _step_or_status(comp, "forward"), _step_or_status(eager), _step_or_status(comp),
                                 _speedup(eager, comp)])
    return "\n".join(["### Eager vs torch.compile (ms)", "", markdown_table(
        ["size", "context", "precision", "mode", "eager forward", "compiled forward", "eager step", "compiled step",
         "speed-up (step)"], body)])


def render_memory(rows: Rows) -> str:
    """Peak memory (``torch.cuda.max_memory_allocated``) per context, mode and precision, with the plan."""
    body = []
    for r in sorted(rows, key=lambda r: (r["size"], r["precision"], r["mode"], r["context"])):
        err = r.get("estimate_error_pct")
        body.append([r["size"], r["context"], r["batch_size"], r["precision"], r["mode"], fmt(r.get("peak_gib"), ".2f"),
                     fmt(r.get("estimate_gib"), ".2f"), fmt(err, "+.1f") + ("%" if err is not None else ""),
                     fmt(r.get("reserved_gib"), ".2f"), status_text(r)])
    return "\n".join(["### Memory peaks (GiB) and the memory plan", "", markdown_table(
        ["size", "context", "batch", "precision", "mode", "peak GiB", "estimate GiB", "estimate error",
         "reserved GiB", "status"], body)])


def render_attention(rows: Rows) -> str:
    """Step time and peak per context for each attention backend; OOM cells shown."""
    backends = _ordered([r["attention"] for r in rows])
    idx = _index(rows, "attention", "context")
    body = []
    for t in sorted({r["context"] for r in rows}):
        line: list[Any] = [t]
        for b in backends:
            r = idx.get((b, t))
            line += [_step_or_status(r), fmt((r or {}).get("peak_gib"), ".2f")]
        body.append(line)
    header = ["context"] + [h for b in backends for h in (f"{b} ms", f"{b} peak GiB")]
    return "\n".join(["### Attention backends (whole-model step, ms)", "", markdown_table(header, body)])


def variant_name(row: dict[str, Any]) -> str:
    """How a speed-study row computes its step: ``eager``, ``compile``, ``compile+graphs``,
    ``compile+graphs+overlap``, ``compile+graphs+master``, ``compile+graphs+master+bf16 state``, with
    ``+float8 tensorwise`` or ``+float8 rowwise`` for float8 linears (``in-backward`` where the in-backward
    optimizer runs without overlap; ``compile(MODE)`` for a compile mode other than the default), and
    ``plain ...`` for the plain-PyTorch reference loop."""
    parts = [name for name, key in (("compile", "compile"), ("graphs", "cuda_graphs")) if is_on(row.get(key))]
    if parts and row.get("compile_mode") not in (None, "", "default"):
        parts[0] = f"compile({row['compile_mode']})"
    if is_on(row.get("optimizer_overlap")):
        parts.append("overlap")
    elif is_on(row.get("optimizer_in_backward")):
        parts.append("in-backward")
    if is_on(row.get("master_weights")):
        parts.append("master")
        if row.get("optimizer_state_dtype") == "bfloat16":
            parts.append("bf16 state")
    if row.get("float8") not in (None, "", "none"):
        parts.append(f"float8 {row['float8']}")
    name = "+".join(parts) or "eager"
    return f"plain {name}" if row.get("runner") == "plain" else name


def _speed_groups(rows: Rows) -> dict[tuple, Rows]:
    """Rows by what the variants share (size, context, batch, precision, attention, mode), in order of appearance."""
    groups: dict[tuple, Rows] = {}
    for r in rows:
        key = tuple(r.get(k) for k in ("size", "context", "batch_size", "precision", "attention", "mode"))
        groups.setdefault(key, []).append(r)
    return groups


def _loss_differences(base: list[float], other: list[float]) -> tuple[int, float, float]:
    """(steps compared, max |other - base|, max |other - base| / |base|) over the steps both have."""
    pairs = list(zip(base, other, strict=False))
    diffs = [abs(b - a) for a, b in pairs]
    relative = [d / abs(a) for d, (a, _) in zip(diffs, pairs, strict=True) if a]
    return len(pairs), max(diffs, default=0.0), max(relative, default=0.0)


def render_speed(rows: Rows) -> str:
    """Per size and context: each variant's step time three ways, throughput, memory and speed-up vs eager;
    then each Lightning variant's losses against eager's (same weights and batches)."""
    lines = ["### Step speed (ms per step)", "",
             "step ms: CudaSyncTimer, mean ± std over the measured steps (plain rows: the loop's CUDA events). "
             "events ms: the cell's own CUDA events at batch start and end. pipeline: first measured step's start "
             "to last one's end, per step (gaps between steps included). tokens/s and MFU at the step-ms mean.", ""]
    header = ["variant", "step ms", "events ms", "pipeline ms/step", "timer vs events", "tokens/s", "MFU", "peak GiB",
              "vs eager"]
    loss_body = []
    for (size, context, batch, precision, attention, mode), group in _speed_groups(rows).items():
        eager = next((r for r in group if variant_name(r) == "eager"), None)
        body = []
        for r in group:
            pct = r.get("timer_vs_events_pct")
            body.append([variant_name(r), _step_or_status(r), fmt(r.get("events_step_ms_mean"), ".2f"),
                         fmt(r.get("pipeline_step_ms"), ".2f"), fmt(pct, "+.1f") + ("%" if pct is not None else ""),
                         fmt(r.get("tokens_per_s"), ",.0f"), fmt(r.get("mfu"), ".1%"), fmt(r.get("peak_gib"), ".2f"),
                         _speedup(eager, r) if r.get("status") == "ok" else "-"])
            base = (eager or {}).get("losses")
            if r is eager or r.get("runner") == "plain" or not base or not r.get("losses"):
                continue
            n, most, relative = _loss_differences(base, r["losses"])
            loss_body.append([size, context, variant_name(r), n, fmt(most, ".2e"), fmt(relative, ".2e")])
        lines += [f"`{size}`, context {context}, batch {batch}, {precision}, {attention}, {mode}", "",
                  markdown_table(header, body), ""]
    lines += ["### Losses vs eager", "",
              "Each Lightning variant's training losses against the eager cell's of the same size and context, over "
              "the steps both have (warm-up included; same initial weights and batches). The plain reference draws "
              "its own batches and is left out.", "",
              markdown_table(["size", "context", "variant", "steps", "max abs difference", "max relative difference"],
                             loss_body)]
    return "\n".join(lines)


#: The speed study's (size, context) points and variants: each variant over each point.
_SPEED_POINTS = [{"sizes": list(STUDY_SIZES), "contexts": [512]}, {"sizes": ["small"], "contexts": [128]}]
_SPEED_VARIANTS = [
    {"compile": ["off"]},
    {"compile": ["on"]},
    {"compile": ["on"], "cuda_graphs": ["on"]},
    {"compile": ["on"], "cuda_graphs": ["on"], "optimizer_in_backward": ["on"], "optimizer_overlap": ["on"]},
    {"compile": ["on"], "cuda_graphs": ["on"], "master_weights": ["on"]},
    {"compile": ["on"], "cuda_graphs": ["on"], "master_weights": ["on"], "optimizer_state_dtype": ["bfloat16"]},
    # The fast recipe with float8 linears; the size rule (float8_min_features 2048) leaves the sizes below 2.7B
    # in bf16, so there the variants measure what a float8 setting costs where nothing converts.
    *({"compile": ["on"], "cuda_graphs": ["on"], "master_weights": ["on"], "optimizer_state_dtype": ["bfloat16"],
       "float8": [recipe]} for recipe in ("tensorwise", "rowwise")),
    {"runner": ["plain"], "compile": ["on"], "cuda_graphs": ["on"]},  # torch.compile(mode="reduce-overhead")
]

STUDIES: dict[str, Study] = {
    "timing": Study("timing", "Timing per size and context", {
        "sizes": list(STUDY_SIZES), "contexts": [128, 256, 512, 1024], "mode": ["forward", "forward_backward"],
        "precision": ["32-true"]}, render_timing),
    "warmup": Study("warmup", "Warm-up study", {
        "sizes": ["small"], "contexts": [512], "warmup": [0, 1, 2, 5], "mode": ["forward_backward"]}, render_warmup),
    "precision": Study("precision", "FP32 vs BF16", {
        "sizes": list(STUDY_SIZES), "contexts": [128, 512, 1024], "precision": ["32-true", "bf16-mixed"],
        "mode": ["forward_backward", "train"]}, render_precision),
    "compile": Study("compile", "Eager vs torch.compile", {
        "sizes": list(STUDY_SIZES), "contexts": [128, 512, 1024], "compile": ["off", "on"],
        "mode": ["forward", "forward_backward", "train"]}, render_compile),
    "memory": Study("memory", "Memory peaks", {
        "sizes": ["2.7B"], "contexts": [128, 256, 512, 1024, 2048], "mode": ["forward", "train"],
        "precision": ["32-true", "bf16-mixed"], "warmup": [1], "steps": [2]}, render_memory),
    "attention-backends": Study("attention-backends", "Attention backends", {
        "sizes": ["small"], "contexts": [256, 1024, 4096, 8192, 16384], "attention": ["naive", "sdpa", "flash_triton"],
        "mode": ["forward_backward"], "precision": ["bf16-mixed"], "batch_size": [1], "stop_after_oom": True},
        render_attention),
    "long-context": Study("long-context", "Long context on one GPU", {
        "sizes": ["2.7B"], "contexts": [2048, 4096, 8192, 16384, 32768], "precision": ["bf16-mixed"],
        "batch_size": [4], "mode": ["train"], "attention": ["sdpa", "flash_triton"], "warmup": [1], "steps": [2],
        "activation_checkpointing": ["full", "selective", "offload"], "optimizer_in_backward": ["off", "on"],
        "loss_chunk_tokens": [0, 4096], "stop_after_oom": True},
        lambda rows: _long_context(rows)),
    "speed": Study("speed", "Step speed near the hardware limit", {
        "precision": ["bf16-mixed"], "batch_size": [4], "mode": ["train"], "attention": ["sdpa"],
        # Warm-up covers compilation and the CUDA-graph capture, which follows a few eager steps.
        "warmup": [5], "steps": [20],
        "variants": [{**point, **variant} for point in _SPEED_POINTS for variant in _SPEED_VARIANTS]},
        render_speed),
}


def _long_context(rows: Rows) -> str:
    """Per memory option: step time, tokens/s, measured peak and the plan, then the planner's record.

    "plan fits" judges what the plan says the step needs (``estimate_needed_gib``: the peak, and the whole loss's
    buffers the allocator keeps cached after the loss) against the device's usable memory as ``estimate`` does
    (``lmtrain.memory_plan.usable_bytes``: total less the CUDA context and the fragmentation allowance), the total
    read from the cells' rows (``device_memory_gib``); without a GPU row it is left blank.
    """
    totals = [r["device_memory_gib"] for r in rows if r.get("device_memory_gib")]
    capacity = usable_bytes(int(max(totals) * GIB)) / GIB if totals else None
    header = ["context", "attention", "checkpointing", "optimizer in backward", "loss chunk", "step ms", "tokens/s",
              "peak GiB", "plan GiB", "plan - peak", "plan fits", "status"]
    body = []
    for r in rows:
        plan, error = r.get("estimate_gib"), r.get("estimate_error_pct")
        body.append([r.get("context"), r.get("attention"), r.get("activation_checkpointing") or "none",
                     "on" if is_on(r.get("optimizer_in_backward")) else "off", r.get("loss_chunk_tokens") or 0,
                     fmt(r.get("step_ms_median"), ".0f"), fmt(r.get("tokens_per_s"), ",.0f"),
                     fmt(r.get("peak_gib"), ".2f"), fmt(plan, ".2f"), fmt(error, "+.1f") + ("%" if error is not None
                                                                                          else ""),
                     _fits_text(_needed(r), capacity), status_text(r)])
    lines = ["### Long context (2.7B, bf16-mixed, batch 4)", "", markdown_table(header, body), ""]
    lines += planner_record(rows, capacity)
    return "\n".join(lines)


def _needed(r: dict[str, Any]) -> float | None:
    """What the plan says the device must hold (GiB): the peak and the cached loss buffers (rows written before
    that column existed: the peak)."""
    needed = r.get("estimate_needed_gib")
    return needed if needed is not None else r.get("estimate_gib")


def _fits_text(plan: float | None, capacity: float | None) -> str:
    if plan is None or capacity is None:
        return ""
    return "yes" if plan <= capacity else "no"


def planner_record(rows: Rows, capacity_gib: float | None, tolerance_pct: float = 10.0) -> list[str]:
    """Sentences on the memory planner over a study's rows: its error on every cell that ran, and whether every
    cell it judged to fit ``capacity_gib`` ran (and every one it judged not to fit ran out of memory)."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("estimate_error_pct") is not None]
    lines = []
    if ok:
        errors = [r["estimate_error_pct"] for r in ok]
        worst = max(ok, key=lambda r: abs(r["estimate_error_pct"]))
        outside = [r for r in ok if abs(r["estimate_error_pct"]) > tolerance_pct]
        lines.append(f"- Planner error (plan - peak) over the {len(ok)} cells that ran: {min(errors):+.1f}% .. "
                     f"{max(errors):+.1f}%; largest {worst['estimate_error_pct']:+.1f}% ({_cell_name(worst)}); "
                     + (f"{len(outside)} cells outside +-{tolerance_pct:g}%: "
                        + "; ".join(_cell_name(r) for r in outside) + "." if outside
                        else f"every one within +-{tolerance_pct:g}%."))
    if capacity_gib is not None:
        planned = [r for r in rows if _needed(r) is not None and r.get("status") != "skipped"]
        said_fits = [r for r in planned if _needed(r) <= capacity_gib]
        failed = [r for r in said_fits if r.get("status") != "ok"]
        said_not = [r for r in planned if _needed(r) > capacity_gib]
        ran_anyway = [r for r in said_not if r.get("status") == "ok"]
        lines.append(f"- Usable memory {capacity_gib:.2f} GiB. The planner said \"fits\" for {len(said_fits)} cells: "
                     + (f"{len(failed)} of them did not run: " + "; ".join(
                         f"{_cell_name(r)} ({status_text(r)})" for r in failed) + "." if failed else "every one ran.")
                     + f" It said \"does not fit\" for {len(said_not)}: "
                     + (f"{len(ran_anyway)} ran anyway (the plan is conservative there): "
                        + "; ".join(_cell_name(r) for r in ran_anyway) + "." if ran_anyway
                        else "none of them ran (out of memory, or skipped after a smaller context ran out)."))
    unrun = [r for r in rows if skipped_by_plan(r)]
    if unrun:
        lines.append(f"- {len(unrun)} cells were not run because their plan does not fit (`--skip-unfit`): "
                     + "; ".join(_cell_name(r) for r in unrun) + ".")
    return lines


def _cell_name(r: dict[str, Any]) -> str:
    ib = "in-backward" if is_on(r.get("optimizer_in_backward")) else "no in-backward"
    chunk = f"chunk {r.get('loss_chunk_tokens')}" if r.get("loss_chunk_tokens") else "no chunk"
    return f"{r.get('context')} {r.get('attention')} {r.get('activation_checkpointing')} {ib} {chunk}"


def render_all(per_study: dict[str, Rows]) -> str:
    """Every study's tables, then the per-cell table of all rows."""
    parts = [STUDIES[name].render(rows) for name, rows in per_study.items()]
    all_rows = list({r["key"]: r for rows in per_study.values() for r in rows}.values())
    return "\n\n".join(parts + ["### All cells", "", markdown_rows(all_rows)])
