"""The tests' TensorBoard reader (tests/tb.py) merges a run's event files in the order they were written."""

from __future__ import annotations

from pathlib import Path

from tb import scalars
from torch.utils.tensorboard import SummaryWriter


def test_files_of_one_second_and_process_are_read_in_the_order_written(tmp_path: Path) -> None:
    """A run and its in-process resume write two files in the same second: counter 10 is later than counter 9,
    although TensorBoard's directory reader, sorting names as strings, takes it first."""
    for counter, steps in ((9, range(0, 3)), (10, range(3, 6))):
        writer = SummaryWriter(str(tmp_path / f"w{counter}"))
        for step in steps:
            writer.add_scalar("train/loss", float(step), step)
        writer.close()
        (written,) = (tmp_path / f"w{counter}").glob("events.out.tfevents.*")
        written.rename(tmp_path / f"events.out.tfevents.1795835883.host.12805.{counter}")
    assert scalars(tmp_path)["train/loss"] == [(s, float(s)) for s in range(6)]
