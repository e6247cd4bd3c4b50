"""Where a recovery finds the rows of a step in the data: the data's batch of each row
(a step of rows carried after a device left holds rows of several batches), counted from
the data's first batch, and the rows of a whole batch, every process's together."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxstep import distributed
from jaxstep.loop._pending import Item
from jaxstep.loop._pending import rows_as_given
from jaxstep.step import TrainStep


class Rows:
    """The data positions of the items of one fit call.

    Args:
      step: the step (its devices: this process's share of a batch's rows).
      start: the data's count of the first batch the fit call pulled.
      presplit: batches come ``(n_devices, per_device, ...)``.
    """

    def __init__(self, step: TrainStep, start: int, presplit: bool):
        self.step = step
        self.start = start
        self.presplit = presplit
        # rows of the data's first batch, every process's together (None: not seen yet)
        self.batch_rows: int | None = None

    def pulled(self, batch: Any) -> None:
        """A batch was pulled: the first gives the rows of a batch in the data."""
        if self.batch_rows is not None:
            return
        rows = rows_as_given(batch, self.presplit)  # this process's rows: its devices' chunks
        if rows is not None:
            mine = len(distributed.local_positions(self.step.devices))
            self.batch_rows = rows * len(self.step.devices) // max(mine, 1)

    def size(self, item: Item) -> int:
        """The rows of a batch in the data (every process's), else of ``item``'s."""
        return (
            self.batch_rows or rows_as_given(item.batch, self.presplit and item.first is None) or 0
        )

    def batch(self, item: Item | None) -> int | None:
        """The batch's number in the data (counting its first batch as 0)."""
        if item is None:
            return None
        return self.start + item.seq

    def spans(self, item: Item) -> list[tuple[int, int, int]]:
        """The rows of ``item``'s batch in the data: ``(batch, first row, stop)`` of
        each stretch, the batches counted from the data's first."""
        if item.spans is None:  # a whole batch, every process's rows
            return [(self.start + item.seq, 0, self.size(item))]
        return [(self.start + seq, lo, hi) for seq, lo, hi in item.spans]

    def sources(self, item: Item, examples: Sequence[int]) -> dict[int, list[int]]:
        """Where ``examples`` (indices into ``item``'s batch) are in the data: ``{batch:
        rows}``, the batches counted from the data's first (rows carried after a device
        left the run come from several batches: ``item.spans``)."""
        found: dict[int, list[int]] = {}
        spans = self.spans(item)
        for e in examples:
            at = int(e)
            for batch, lo, hi in spans:
                if at < hi - lo:
                    found.setdefault(batch, []).append(lo + at)
                    break
                at -= hi - lo
        return found


def in_words(spans: Sequence[tuple[int, int, int]]) -> tuple[tuple[int, ...], str]:
    """The batches ``spans`` (``(batch, first row, stop)``) touch, and the rows in words."""
    text = ", ".join(f"batch {b} rows {lo}..{hi - 1}" for b, lo, hi in spans)
    return tuple(sorted({b for b, _, _ in spans})), text
