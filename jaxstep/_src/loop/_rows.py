"""Where a recovery finds the rows of a step in the data: the data's batch of each row
(a step of rows carried after a device left holds rows of several batches), counted from
the data's first batch, the rows of a whole batch, every process's together, and the
ids of examples (``Recover(example_id=...)``), which name them in shuffled data too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxstep._src.core import processes
from jaxstep._src.core.names import leaf_name
from jaxstep._src.loop._pending import Item
from jaxstep._src.loop._pending import rows_as_given
from jaxstep._src.step import Runtime


class Rows:
    """The data positions of the items of one fit call.

    Args:
      runtime: the runtime of the step fit starts on: the devices the batches are laid
        out for (those it was built with, before any left), this process's share of a
        batch's rows.
      start: the data's count of the first batch the fit call pulled.
      presplit: batches come ``(n_devices, per_device, ...)``.
      example_id: the batch leaf holding each example's id (``Recover(example_id=...)``),
        or None.
    """

    def __init__(self, runtime: Runtime, start: int, presplit: bool, example_id: str | None = None):
        #: the devices the batches are laid out for (the same once some left)
        self.laid = runtime.origin or runtime.devices
        self.start = start
        self.presplit = presplit
        self.example_id = example_id
        # rows of the data's first batch, every process's together (None: not seen yet)
        self.batch_rows: int | None = None

    def pulled(self, batch: Any) -> None:
        """A batch was pulled: the first gives the rows of a batch in the data, and its
        ``example_id`` leaf is checked (a ValueError or TypeError naming it)."""
        if self.batch_rows is not None:
            return
        if self.example_id is not None:
            id_leaf(batch, self.example_id, self.presplit)
        rows = rows_as_given(batch, self.presplit)  # this process's rows: its devices' chunks
        if rows is not None:  # (of the devices the batches are laid out for)
            laid = self.laid
            mine = len(processes.local_positions(laid))
            self.batch_rows = rows * len(laid) // max(mine, 1)

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
        for batch, row in self.where(item, examples):
            found.setdefault(batch, []).append(row)
        return found

    def where(self, item: Item, examples: Sequence[int]) -> list[tuple[int, int]]:
        """``(batch, row)`` in the data of each of ``examples`` (indices into ``item``'s
        batch), in their order."""
        found = []
        spans = self.spans(item)
        for e in examples:
            at = int(e)
            for batch, lo, hi in spans:
                if at < hi - lo:
                    found.append((batch, lo + at))
                    break
                at -= hi - lo
        return found

    def ids(
        self, item: Item, examples: Sequence[int], devices: Sequence[jax.Device]
    ) -> tuple[int, ...]:
        """The ``example_id`` leaf's values of ``examples`` (indices into ``item``'s
        global batch, run on ``devices``), in their order; ``()`` without
        ``example_id``. With several processes each reads those of the rows it holds and
        they are shared, so every process returns them all."""
        if self.example_id is None or not examples:
            return ()
        ids = id_leaf(item.batch, self.example_id, self.presplit and item.first is None)
        local = processes.local_positions(devices)
        size = len(ids) // max(len(local), 1)  # this process passes its devices' chunks
        at = {p: j for j, p in enumerate(local)}
        mine = {}
        for e in examples:
            position, row = divmod(int(e), size)
            if position in at:
                mine[str(int(e))] = int(ids[at[position] * size + row])
        found: dict[str, int] = {}
        for seen in processes.share("quarantine/ids", mine, devices).values():
            found.update(seen)
        return tuple(found[str(int(e))] for e in examples)


def id_leaf(batch: Any, name: str, presplit: bool = False) -> np.ndarray:
    """The leaf ``name`` of ``batch`` (``"id"`` for ``batch["id"]``, or a path as
    ``jax.tree_util.keystr`` writes it) as one id per row, flat.

    Raises:
      ValueError: the batch has no such leaf, or it holds other than one value per row.
      TypeError: its values are not integers.
    """
    want = name if name.startswith(("[", ".")) else f"[{name!r}]"
    paths = jax.tree_util.tree_leaves_with_path(batch)
    found = [x for path, x in paths if leaf_name(path) == want]
    if not found:
        names = [leaf_name(path) for path, _ in paths]
        raise ValueError(
            f"Recover(example_id={name!r}) names no leaf of the batch (looked for {want}); "
            f"its leaves are {names}: name the leaf that holds each example's id"
        )
    ids = np.asarray(found[0])
    rows = rows_as_given(batch, presplit)
    flat = ids.reshape(-1) if ids.ndim == 1 + presplit else None
    if flat is None or len(flat) != rows:
        layout = "(n_devices, per_device)" if presplit else "(rows,)"
        raise ValueError(
            f"Recover(example_id={name!r}): leaf {want} has shape {ids.shape}; it must hold "
            f"one id per example, shape {layout} (the batch has {rows} rows)"
        )
    if not np.issubdtype(flat.dtype, np.integer):
        raise TypeError(
            f"Recover(example_id={name!r}): leaf {want} has dtype {flat.dtype}; example ids "
            "must be integers (an index into the data set, a record number)"
        )
    return flat


def in_words(spans: Sequence[tuple[int, int, int]]) -> tuple[tuple[int, ...], str]:
    """The batches ``spans`` (``(batch, first row, stop)``) touch, and the rows in words."""
    text = ", ".join(f"batch {b} rows {lo}..{hi - 1}" for b, lo, hi in spans)
    return tuple(sorted({b for b, _, _ in spans})), text
