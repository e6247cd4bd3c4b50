"""Rows carried from step to step once a device left the run (``fit(...,
recover=jaxstep.Recover())`` excluded it): a global batch of B rows no longer divides
by the devices left, and no row may be lost.

The rule: each step trains the largest multiple of ``unit`` (devices x micro-batches)
of the rows at hand, in the order they came; the rest is carried into the next step.
With 64-row batches on 7 devices the steps take 63 rows (9 a device), then, once 7
rows are carried, 70 (10 a device): two shapes, each compiled once. Rows still carried
when the data ends (fewer than ``unit``) are never trained: fit lists them in
``History.left_over``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxstep.core import validate
from jaxstep.loop._pending import Item


class Carry:
    """The rows carried into the next step, and where they came from.

    Args:
      unit: the rows a step's size must divide by (devices x micro-batches).
      skip: rows of the first batch already trained (a resume at a data position
        inside a batch): they are passed over.
    """

    def __init__(self, unit: int, skip: int = 0, presplit: bool = False):
        self.unit = unit
        self.skip = skip
        self.presplit = presplit  # batches come (n_devices, per_device, ...): joined here
        self.rows: Any = None  # the carried rows (host arrays), or None
        self.first = 0  # the seq of the batch the first carried row came from
        self.offset = 0  # rows of that batch trained before it

    def take(self, item: Item) -> Item | None:
        """The batch to train now from ``item`` and the rows carried (None: fewer than
        ``unit`` rows at hand, all carried on). The item's ``first``/``offset`` say
        where its first row came from (the data position of a checkpoint before it).

        An item that went through here before (a recovery queued it again: ``first``
        set) is joined rows already. Where the origin of carried rows is not known
        exactly (rows queued again), the earlier position is kept: a resume may train
        a few rows twice, never lose one."""
        batch = jax.tree.map(np.asarray, item.batch)
        joined = item.first is not None
        if self.presplit and not joined:
            batch = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batch)
        first, offset = item.seq, 0
        if item.first is not None:
            first, offset = item.first, item.offset
        if self.skip and not joined:  # a resume inside this batch
            offset, self.skip = self.skip, 0
            batch = jax.tree.map(lambda x: x[offset:], batch)
        own = validate.batch(batch, 1)  # the rows this item brings
        if self.rows is None:
            carried, self.first, self.offset = 0, first, offset
        else:
            carried = validate.batch(self.rows, 1)
            batch = jax.tree.map(lambda a, b: np.concatenate([a, b]), self.rows, batch)
        start = (self.first, self.offset)  # the data position of the first row at hand
        total = carried + own
        keep = total // self.unit * self.unit
        if keep < total:
            came = total - keep  # rows carried on
            self.rows = jax.tree.map(lambda x: x[keep:], batch)
            if keep < carried:  # some carried rows stay carried: their position stands
                pass
            elif not joined:  # the last `came` rows of this batch
                self.first, self.offset = item.seq, offset + own - came
            else:
                self.first, self.offset = first, offset
        else:
            self.rows = None
        if keep == 0:
            return None
        return item._replace(
            batch=jax.tree.map(lambda x: x[:keep], batch), first=start[0], offset=start[1]
        )

    def requeue(self) -> Item | None:
        """The carried rows as an item to queue again (a recovery resets the loop: they
        go after the steps it queues again, before the batches not pulled yet)."""
        left = self.left()
        self.rows = None
        if left is None:
            return None
        seq, offset, rows = left
        return Item(rows, seq, first=seq, offset=offset)

    def left(self) -> tuple[int, int, Any] | None:
        """The rows carried and not trained: ``(seq of their first batch, offset in it,
        rows)``, or None."""
        if self.rows is None:
            return None
        return self.first, self.offset, self.rows
