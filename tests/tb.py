"""Read TensorBoard event files back with TensorBoard's own reader (shared by the tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

_SIZES = {"scalars": 0, "images": 0, "tensors": 0}


def _written_order(path: Path) -> tuple[int, int, str]:
    """Sort key of ``events.out.tfevents.<time>.<host>.<pid>.<counter>``: the order the files were created.

    TensorBoard's own directory reader sorts the names as strings, so two files made in the same second by one
    process (a run and its in-process resume, in the tests) come back counter ``10`` before counter ``9``.
    """
    parts = path.name.split(".")
    stamp = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else 0
    counter = int(parts[-1]) if parts[-1].isdigit() else 0
    return stamp, counter, path.name


class Events:
    """Every event file under a folder, each read on its own and merged in the order the files were written; the
    subset of ``EventAccumulator``'s interface the tests use (``Tags``, ``Scalars``, ``Tensors``, ``Images``)."""

    def __init__(self, files: list[Path]) -> None:
        self._accs = []
        for path in sorted(files, key=_written_order):
            acc = EventAccumulator(str(path), size_guidance=_SIZES)
            acc.Reload()
            self._accs.append(acc)

    def Tags(self) -> dict[str, list[str]]:  # noqa: N802 - EventAccumulator's name
        tags: dict[str, list[str]] = {}
        for acc in self._accs:
            for kind, names in acc.Tags().items():
                if isinstance(names, list):
                    tags.setdefault(kind, [])
                    tags[kind] += [n for n in names if n not in tags[kind]]
        return tags

    def _events(self, kind: str, method: str, tag: str) -> list[Any]:
        return [e for acc in self._accs if tag in acc.Tags().get(kind, []) for e in getattr(acc, method)(tag)]

    def Scalars(self, tag: str) -> list[Any]:  # noqa: N802
        return self._events("scalars", "Scalars", tag)

    def Tensors(self, tag: str) -> list[Any]:  # noqa: N802
        return self._events("tensors", "Tensors", tag)

    def Images(self, tag: str) -> list[Any]:  # noqa: N802
        return self._events("images", "Images", tag)


def read_events(log_dir: str | Path) -> Events:
    """Load the event files of the first folder under ``log_dir`` that holds any (``log_dir`` itself for a run
    folder) with no size limits, in the order the files were written."""
    files = sorted(Path(log_dir).rglob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"no TensorBoard event file under {log_dir}")
    return Events([f for f in files if f.parent == files[0].parent])


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
