"""Read TensorBoard event files back with TensorBoard's own reader (shared by the tests)."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_events(log_dir: str | Path) -> EventAccumulator:
    """Load every event file under ``log_dir`` (recursively merged by TensorBoard) with no size limits."""
    files = sorted(Path(log_dir).rglob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"no TensorBoard event file under {log_dir}")
    acc = EventAccumulator(str(files[0].parent), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] for every scalar logged."""
    acc = read_events(log_dir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def texts(log_dir: str | Path) -> dict[str, list[str]]:
    """tag -> logged text strings (TensorBoard stores text as string tensors, tag suffixed /text_summary)."""
    acc = read_events(log_dir)
    out: dict[str, list[str]] = {}
    for tag in acc.Tags()["tensors"]:
        values = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag) if e.tensor_proto.string_val]
        if values:
            out[tag.removesuffix("/text_summary")] = values
    return out


def images(log_dir: str | Path) -> dict[str, list[bytes]]:
    """tag -> encoded PNG images logged."""
    acc = read_events(log_dir)
    return {tag: [e.encoded_image_string for e in acc.Images(tag)] for tag in acc.Tags()["images"]}
