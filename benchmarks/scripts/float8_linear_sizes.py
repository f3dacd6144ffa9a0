"""Float8 against bf16 for the linear layers of one transformer block, per model width (forward + backward, compiled).

    python benchmarks/scripts/float8_linear_sizes.py OUT.json [--widths 768 1024 1280 1600 2560] [--tokens 2048 8192]

For each (d_model, d_ff = 4 d_model) and token count M, the five linears of a block (qkv, out, w1, w3, w2; no
attention) run forward and backward under bf16 autocast, compiled, once as ``nn.Linear`` and once converted with
torchao's tensorwise and rowwise float8 recipes. Prints the median of 30 timed iterations (CUDA events) per cell and a
Markdown table of the speed-ups: the measurement behind the float8 size rule (``model.float8_min_features``).
Needs a GPU with float8 tensor cores and torchao (``pip install lmtrain[float8]``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

RECIPES = ("bf16", "tensorwise", "rowwise")


class BlockLinears(nn.Module):
    """The linear layers of a SwiGLU transformer block, wired so each one's output is used."""

    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.w1 = nn.Linear(d, f, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.out(self.qkv(x)[..., : x.shape[-1]])
        return x + self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


def median_ms(model: nn.Module, x: torch.Tensor, iterations: int = 30) -> float:
    """Median time of forward + backward (ms) after 5 untimed iterations."""
    for _ in range(5):
        model(x).float().square().mean().backward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iterations):
        start.record()
        model(x).float().square().mean().backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[iterations // 2]


def cell(d: int, tokens: int, recipe: str) -> float | str:
    """One measurement; an error's text instead of a time when the recipe fails."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = BlockLinears(d, 4 * d).cuda()
    if recipe != "bf16":
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    torch._dynamo.reset()  # a fresh compile per cell: the recompile limit is never what is measured
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cuda", torch.bfloat16):
        try:
            return round(median_ms(torch.compile(model), x), 3)
        except Exception as exc:  # a recipe that fails is a result of the probe, recorded as such
            return f"error {type(exc).__name__}: {str(exc)[:120]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--widths", type=int, nargs="+", default=[768, 1024, 1280, 1600, 2560])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    args = parser.parse_args()
    import torchao

    print("torch", torch.__version__, "torchao", torchao.__version__, torch.cuda.get_device_name())
    rows = []
    for d in args.widths:
        for tokens in args.tokens:
            row = {"d_model": d, "d_ff": 4 * d, "tokens": tokens} | {r: cell(d, tokens, r) for r in RECIPES}
            rows.append(row)
            print(json.dumps(row), flush=True)
            args.out.write_text(json.dumps(rows, indent=1))  # kept as it goes: a cut-off run keeps its rows
    print("| d_model | d_ff | tokens | bf16 ms | tensorwise ms | rowwise ms | tensorwise speed-up | rowwise speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        def speedup(recipe: str, r: dict = r) -> str:
            ok = isinstance(r[recipe], float) and isinstance(r["bf16"], float)
            return f"{r['bf16'] / r[recipe]:.2f}" if ok else "-"

        print(f"| {r['d_model']} | {r['d_ff']} | {r['tokens']} | {r['bf16']} | {r['tensorwise']} | {r['rowwise']} | "
              f"{speedup('tensorwise')} | {speedup('rowwise')} |")


if __name__ == "__main__":
    main()
