"""Where float8 gains and loses time at one token count in two shapes: a few blocks of a model size, compiled.

Usage (a CUDA GPU with float8 tensor cores, torchao installed)::

    python benchmarks/scripts/float8_context_probe.py LAYERS [CONTEXT:BATCH:FLOAT8[:VARIANT] ...]

For each case (default ``2048:4:none 2048:4:tensorwise 8192:1:none 8192:1:tensorwise``) it builds ``LAYERS``
blocks of 2.7B's width (``--size`` to change), converts them with ``lmtrain.float8.convert_model``, compiles the
model (``TransformerLM.compile``), runs 4 warm-up steps of forward + backward under bf16 autocast on random token
ids, times 10 (CUDA events, median), profiles one more and prints its 14 longest kernels (total time, launches,
name) and the attention kernels' total. ``VARIANT`` ``nopersist`` turns inductor's persistent reductions off,
``nosplit`` its split reductions. A table of every case ends the output.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import torch._inductor.config as inductor_config

from lmtrain.config import ModelConfig
from lmtrain.float8 import convert_model
from lmtrain.model import TransformerLM

DEFAULT_CASES = ["2048:4:none", "2048:4:tensorwise", "8192:1:none", "8192:1:tensorwise"]
ATTENTION_WORDS = ("flash", "fmha", "attention", "sdpa", "cudnn")
VARIANTS = ("nopersist", "nosplit", "cdt", "multi")


def run_case(size: str, layers: int, context: int, batch: int, float8: str, variant: str) -> dict:
    options = set(variant.split("+")) - {""}
    inductor_config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    inductor_config.triton.persistent_reductions = "nopersist" not in options
    inductor_config.split_reductions = "nosplit" not in options
    inductor_config.coordinate_descent_tuning = "cdt" in options
    inductor_config.triton.multi_kernel = 1 if "multi" in options else 0
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = ModelConfig.from_size(size, num_layers=layers, context_length=context, attention="sdpa", float8=float8,
                                compile=True)
    model = TransformerLM(cfg).cuda()
    convert_model(model, cfg)
    model.compile()
    tokens = torch.randint(0, cfg.vocab_size, (batch, context), device="cuda")
    targets = torch.randint(0, cfg.vocab_size, (batch, context), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(tokens, targets)
        loss.backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] += event.device_time
            count[event.name] += 1
    label = f"{float8} {variant}".strip()
    print(f"\n== ctx {context} x {batch}, float8 {label}, {layers} layers: median step {times[5]:.2f} ms", flush=True)
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {us / 1000:8.2f} ms  x{count[name]:<4d} {name[:150]}")
    attention = sum(us for name, us in total.items() if any(w in name.lower() for w in ATTENTION_WORDS)) / 1000
    return {"context": context, "batch": batch, "float8": label, "step_ms": times[5], "attention_ms": attention}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("layers", type=int, help="blocks of the model")
    parser.add_argument("cases", nargs="*", default=DEFAULT_CASES, help="CONTEXT:BATCH:FLOAT8[:VARIANT]")
    parser.add_argument("--size", default="2.7B", help="the named size whose width the blocks take")
    args = parser.parse_args(argv)
    cases = []
    for case in args.cases:  # every case checked before the first one compiles
        parts = case.split(":")
        if len(parts) not in (3, 4) or not (parts[0].isdigit() and parts[1].isdigit()):
            parser.error(f"case {case!r}: use CONTEXT:BATCH:FLOAT8[:VARIANT], e.g. 8192:1:tensorwise")
        variant = parts[3] if len(parts) == 4 else ""
        unknown = set(variant.split("+")) - {""} - set(VARIANTS)
        if unknown:
            parser.error(f"case {case!r}: unknown variant(s) {', '.join(sorted(unknown))}; use "
                         f"{', '.join(VARIANTS)}, several joined by +")
        cases.append((int(parts[0]), int(parts[1]), parts[2], variant))
    rows = [run_case(args.size, args.layers, *case) for case in cases]
    print("\n| ctx x b | float8 | step ms | attention kernels ms |")
    for r in rows:
        print(f"| {r['context']} x {r['batch']} | {r['float8']} | {r['step_ms']:.2f} | {r['attention_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
