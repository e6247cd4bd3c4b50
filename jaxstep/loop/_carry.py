"""Rows carried from step to step once a device left the run (``fit(...,
recover=jaxstep.Recover())`` excluded it): a global batch of B rows no longer divides
by the devices left, and no row may be lost.

The rule: each step trains the largest multiple of ``unit`` (devices x micro-batches)
of the rows at hand, in the order they came; the rest is carried into the next step.
With 64-row batches on 7 devices the steps take 63 rows (9 a device), then, once 7
rows are carried, 70 (10 a device): two shapes, each compiled once. Rows still carried
when the data ends (fewer than ``unit``) are never trained: fit lists them in
``History.left_over``.

With several processes (:class:`Cut`) rows cannot be carried: each process passes its
own rows, the rows per device must be the same on every process, and no process can
hand rows to another. So each batch keeps its rows per device; the process that lost a
device trains the chunks of its remaining devices and lists the lost device's chunk of
every batch in ``History.left_over``. Every row is trained or listed.
"""

from __future__ import annotations

from collections.abc import Sequence
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


class Cut:
    """Several processes, a device gone: the chunks of each of this process's batches
    that no device is left to train, cut out and listed (``History.left_over``).

    Batches keep the layout of the devices this process held when the first device
    left (``origin``): chunk ``j`` of each is ``origin[j]``'s. A batch keeps its rows per
    device; the chunks of the devices still there are trained, in order, and the others
    are listed as ``(batch, first row, stop)``, rows of the batch as this process passed
    it. Nothing is carried, so a checkpoint's data position is the next batch's start,
    as without a device gone.

    Args:
      origin: the ids of this process's devices, in the step's order, before any left.
      start: the data's count of the first batch fit pulled (``History.left_over``
        counts batches from the data's first).
      left_over: where the cut rows are listed (``History.left_over``).
      presplit: batches come ``(n_devices, per_device, ...)``: joined here when cut.
    """

    rows = None  # the carry's protocol: nothing is ever carried

    def __init__(
        self,
        origin: Sequence[int],
        start: int,
        left_over: list[tuple[int, int, int]],
        presplit: bool = False,
    ):
        self.origin = list(origin)
        self.here = set(self.origin)  # of them, the devices still in the step
        self.start = start
        self.left_over = left_over
        self.presplit = presplit
        self.cut = 0  # rows listed by this fit call

    def exclude(self, device_ids: Sequence[int]) -> None:
        """Devices that left: their chunks are cut from now on."""
        self.here -= set(device_ids)

    def take(self, item: Item) -> Item:
        """``item`` without the chunks of devices that left (as it is when it has none).
        An item cut before (a recovery queued it again) loses only what left since."""
        chunks = tuple(range(len(self.origin))) if item.chunks is None else item.chunks
        keep = tuple(j for j in chunks if self.origin[j] in self.here)
        if keep == chunks:
            return item
        batch = item.batch
        if self.presplit and item.first is None:
            batch = jax.tree.map(lambda x: np.asarray(x).reshape(-1, *x.shape[2:]), batch)
        size = validate.batch(batch, len(chunks)) // len(chunks)
        at = {j: i for i, j in enumerate(chunks)}
        rows = np.concatenate([np.arange(at[j] * size, (at[j] + 1) * size) for j in keep])
        first = item.seq if item.first is None else item.first
        for j in chunks:
            if j not in keep:  # rows of the batch as passed: chunk j of its layout
                self.left_over.append((self.start + first, j * size, (j + 1) * size))
                self.cut += size
        return item._replace(
            batch=jax.tree.map(lambda x: np.asarray(x)[rows], batch),
            first=first,
            chunks=keep,
        )

    def requeue(self) -> None:
        """Nothing carried to queue again."""
        return None

    def left(self) -> None:
        """No rows carried."""
        return None
