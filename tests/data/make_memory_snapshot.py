"""Regenerate ``memory_snapshot_constructed.pickle``: a small allocator snapshot built by hand.

A CPU cannot capture a CUDA snapshot, so this one is constructed, in the format that
``torch.cuda.memory._snapshot()`` returns and ``torch/cuda/_memory_viz.py`` documents (``segments`` of
``blocks``, one ``device_traces`` list per device of ``alloc`` / ``free_requested`` / ``free_completed`` /
``segment_alloc`` entries with ``addr``, ``size``, ``stream``, ``time_us`` and ``frames``, innermost first).
It tells one training step of a small model on device 0: weights allocated before the recording started,
a forward pass that keeps two activations and frees a temporary, a backward pass that frees the
activations and allocates gradients, and an AdamW step that allocates its two state tensors. Sizes and
times are chosen, not measured. Run from the repository root: ``python tests/data/make_memory_snapshot.py``.
"""

from __future__ import annotations

import pickle
from pathlib import Path

OUT = Path(__file__).with_name("memory_snapshot_constructed.pickle")
MIB = 1024**2
SITE = "/usr/lib/python3.11/site-packages"


def frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


LIGHTNING = frame(f"{SITE}/lightning/pytorch/loops/training_epoch_loop.py", 300, "advance")
SCRIPT = frame("train.py", 12, "<module>")
LINEAR = [frame(f"{SITE}/torch/nn/modules/linear.py", 125, "forward"), frame("model.py", 91, "forward"), LIGHTNING,
          SCRIPT]
ATTENTION = [frame("model.py", 60, "attention"), frame("model.py", 88, "forward"), LIGHTNING, SCRIPT]
SCORES = [frame("model.py", 57, "attention"), frame("model.py", 88, "forward"), LIGHTNING, SCRIPT]
ADAMW = [frame(f"{SITE}/torch/optim/adamw.py", 160, "_init_group"),
         frame(f"{SITE}/torch/optim/optimizer.py", 480, "wrapper"), LIGHTNING, SCRIPT]

# Weights (allocated before the recording: no trace entry, still live at the snapshot)
W1, W2 = 0x7F0000000000, 0x7F0000800000
# Forward: activations H (linear output) and S (attention scores, a temporary freed in forward), A (attention out)
H, S, A = 0x7F0001000000, 0x7F0002000000, 0x7F0003000000
# Backward: gradients G1, G2; AdamW: exp_avg M1, M2 and exp_avg_sq V1, V2
G1, G2, M1, M2, V1, V2 = (0x7F0004000000 + i * 0x800000 for i in range(6))


def entry(action: str, addr: int, size_mib: float, time_us: int, frames: list[dict] | None = None) -> dict:
    return {"action": action, "addr": addr, "size": int(size_mib * MIB), "stream": 0, "time_us": time_us,
            "frames": frames or []}


def snapshot() -> dict:
    trace = [
        entry("segment_alloc", H, 64, 1_000),
        entry("alloc", H, 8, 1_010, LINEAR),  # forward
        entry("alloc", S, 16, 1_020, SCORES),
        entry("alloc", A, 8, 1_030, ATTENTION),
        entry("free_requested", S, 16, 1_040),
        entry("free_completed", S, 16, 1_040),
        entry("alloc", G1, 4, 2_010),  # backward: autograd's thread, no Python frame
        entry("free_requested", A, 8, 2_020),
        entry("free_completed", A, 8, 2_020),
        entry("alloc", G2, 4, 2_030),
        entry("free_requested", H, 8, 2_040),
        entry("free_completed", H, 8, 2_040),
        entry("alloc", M1, 4, 3_010, ADAMW),  # optimizer
        entry("alloc", V1, 4, 3_020, ADAMW),
        entry("alloc", M2, 4, 3_030, ADAMW),
        entry("alloc", V2, 4, 3_040, ADAMW),
    ]

    def block(addr: int, size_mib: float, frames: list[dict] | None = None, state: str = "active_allocated") -> dict:
        size = int(size_mib * MIB)
        return {"address": addr, "size": size, "requested_size": size, "state": state, "frames": frames or []}

    live = [block(W1, 4, LINEAR), block(W2, 4, LINEAR), block(G1, 4), block(G2, 4), block(M1, 4, ADAMW),
            block(V1, 4, ADAMW), block(M2, 4, ADAMW), block(V2, 4, ADAMW), block(H, 32, state="inactive")]
    segments = [{"device": 0, "address": W1, "total_size": 96 * MIB, "stream": 0, "segment_type": "large",
                 "segment_pool_id": (0, 0), "allocated_size": 32 * MIB, "active_size": 32 * MIB, "blocks": live}]
    return {"segments": segments, "device_traces": [trace]}


def main() -> None:
    with open(OUT, "wb") as f:
        pickle.dump(snapshot(), f)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
