"""Rows carried from step to step once a device left the run (``fit(...,
recover=jaxstep.Recover())`` excluded it): a global batch of B rows no longer divides
by the devices left, and no row may be lost.

The rule: each step trains the largest multiple of ``unit`` (devices x micro-batches)
of the rows at hand, in the order they came; the rest is carried into the next step.
With 64-row batches on 7 devices the steps take 63 rows (9 a device), then, once 7
rows are carried, 70 (10 a device): two shapes, each compiled once. Rows still carried
when the data ends (fewer than ``unit``) are never trained: fit lists them in
``History.left_over``.

Rows of different shapes are never joined (bucketed sequence lengths: a batch padded to
24 tokens, the next to 16): a step trains rows of one shape. When the next batch's rows
have another shape (a leaf's trailing axes or dtype differ) than the rows carried, the
carried rows (fewer than ``unit``: no step of their own can take them) are listed in
``History.left_over`` as at the end of the data, and the new batch starts afresh. Rows
stay in the data's order, so the data position of a checkpoint (the first row not
trained) stays exact.

With several processes (:class:`Cut`) rows cannot be carried: each process passes its
own rows, the rows per device must be the same on every process, and no process can
hand rows to another. So each batch keeps its rows per device; the process that lost a
device trains the chunks of its remaining devices and lists the lost device's chunk of
every batch in ``History.left_over``. Every row is trained or listed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import numpy as np

from jaxstep import distributed
from jaxstep.core import validate
from jaxstep.core import warn
from jaxstep.loop._pending import Item
from jaxstep.step import Runtime
from jaxstep.step import join_presplit

Span = tuple[int, int, int]  # (seq of a batch, first row, stop): rows of the data


class Taken(NamedTuple):
    """What the carry makes of a batch: the item the step trains now (None: fewer rows
    than a step needs at hand, all carried on), and the rows it listed as never trained
    (``History.left_over``: carried rows of another shape, or a cut device's chunk)."""

    item: Item | None
    left_over: tuple[Span, ...] = ()


def carry_for(
    runtime: Runtime, start: int, skip: int, presplit: bool, carried: bool = False
) -> Carry | Cut | None:
    """The carry a fit call starts with (None: none needed): for a resume inside a batch
    (``skip`` rows of the first batch trained already) or from a checkpoint of a run
    that carried rows (``carried``), or for a step that lost devices in an earlier fit
    call. ``start``: the data's count of the first batch pulled."""
    if skip or (carried and not distributed.spans_processes(runtime.devices)):
        return Carry(_unit(runtime), skip, presplit, start=start)
    if runtime.origin is None:
        return None
    return after_leaving(None, runtime.origin, runtime, start=start, presplit=presplit)


def after_leaving(
    carry: Carry | Cut | None,
    before: Sequence[jax.Device],
    runtime: Runtime,
    *,
    start: int,
    presplit: bool,
) -> Carry | Cut:
    """``carry`` (made when None) once the devices of ``before`` that ``runtime`` no
    longer has left the run: on several processes each batch's rows of the devices
    gone are cut (:class:`Cut`); on one, the rows that do not divide by the devices left
    are carried (:class:`Carry`, its unit that of the devices left)."""
    if distributed.spans_processes(before):  # rows stay with their process
        if not isinstance(carry, Cut):
            here = [d.id for d in before if d.process_index == jax.process_index()]
            carry = Cut(here, start, presplit)
        kept = {d.id for d in runtime.devices}
        carry.exclude([d.id for d in before if d.id not in kept])
        return carry
    if not isinstance(carry, Carry):
        carry = Carry(_unit(runtime), presplit=presplit, start=start)
    carry.unit = _unit(runtime)
    return carry


def _unit(runtime: Runtime) -> int:
    """The rows a step's batch must divide by: devices x micro-batches."""
    return len(runtime.devices) * (runtime.options.microbatches or 1)


class Carry:
    """The rows carried into the next step, and exactly where each came from: the
    loop's own (:meth:`take` before each dispatch, :meth:`release` when the loop stops or
    goes back, :meth:`finish`).

    Args:
      unit: the rows a step's size must divide by (devices x micro-batches).
      skip: rows of the first batch already trained (a resume at a data position
        inside a batch): they are passed over.
      presplit: batches come ``(n_devices, per_device, ...)``: joined here, ``n_devices``
        read from the batch (laid out for the devices before any left the run).
      start: the data's count of the first batch fit pulled (``History.left_over``
        counts batches from the data's first).
    """

    def __init__(self, unit: int, skip: int = 0, presplit: bool = False, *, start: int = 0):
        self.unit = unit
        self.skip = skip
        self.presplit = presplit
        self.start = start
        self.listed: list[Span] = []  # the rows this carry listed as never trained
        self.rows: Any = None  # the carried rows (host arrays), or None
        self.spans: list[Span] = []  # where they are in the data, in order
        self.set_aside = 0  # rows listed because the next batch had another shape

    def take(self, item: Item) -> Taken:
        """The batch to train now from the rows carried and ``item``'s (its item None:
        fewer than ``unit`` rows at hand, all carried on). Its ``spans`` say where each
        of its rows is in the data, ``first``/``offset`` where the first is (the data
        position of a checkpoint before it). An item that went through here before (a
        recovery queued it again: ``spans`` set) is joined rows with its spans already.
        Carried rows of another shape than ``item``'s are listed, not joined
        (:meth:`_list_carried`). Nothing changes when it raises: the loop hands ``item``
        back."""
        batch = jax.tree.map(np.asarray, item.batch)
        skip = 0
        if item.spans is None:
            if self.presplit:  # laid out for the devices before any left: its leading axis
                batch = join_presplit(batch, len(jax.tree.leaves(batch)[0]))
            size, skip = validate.batch(batch, 1), self.skip
            if skip:  # a resume inside this batch
                batch = jax.tree.map(lambda x: x[skip:], batch)
            spans: list[Span] = [(item.seq, skip, size)]
        else:
            spans = list(item.spans)
        self.skip = 0
        listed: list[Span] = []
        if self.rows is not None and not joinable(self.rows, batch):
            listed = self._list_carried()
            self.set_aside += sum(hi - lo for _, lo, hi in listed)
        if self.rows is not None:
            batch = jax.tree.map(lambda a, b: np.concatenate([a, b]), self.rows, batch)
            spans = merge_spans(self.spans + spans)
        total = validate.batch(batch, 1)
        keep = total // self.unit * self.unit
        head, tail = _split(spans, keep)
        self.rows = jax.tree.map(lambda x: x[keep:], batch) if keep < total else None
        self.spans = tail
        if keep == 0:
            return Taken(None, tuple(listed))
        taken = item._replace(
            batch=jax.tree.map(lambda x: x[:keep], batch),
            first=head[0][0],
            offset=head[0][1],
            spans=tuple(head),
        )
        return Taken(taken, tuple(listed))

    def _list_carried(self) -> list[Span]:
        """The carried rows (fewer than ``unit``: no step of their own) let go, as the
        spans to list in ``History.left_over`` (batches counted from the data's first),
        in the data's order: the next batch has another shape, or the data ended."""
        left = self.left()
        if left is None:
            return []
        spans, _ = left
        listed = [(self.start + seq, lo, hi) for seq, lo, hi in spans]
        self.listed += listed
        self.rows, self.spans = None, []
        return listed

    def requeue(self) -> Item | None:
        """The carried rows as an item to queue again (a recovery resets the loop: they
        go after the steps it queues again, before the batches not pulled yet)."""
        rows, spans = self.rows, tuple(self.spans)
        self.rows, self.spans = None, []
        if rows is None:
            return None
        return Item(rows, spans[-1][0], first=spans[0][0], offset=spans[0][1], spans=spans)

    def release(self) -> list[Item]:
        """The carried rows as items to queue again or hand back (:meth:`requeue`)."""
        item = self.requeue()
        return [] if item is None else [item]

    def left(self) -> tuple[list[Span], Any] | None:
        """The rows carried and not trained, with their spans, or None."""
        if self.rows is None:
            return None
        return list(self.spans), self.rows

    def finish(self) -> list[Span]:
        """The data ended: the rows still carried (fewer than a step needs), to list in
        ``History.left_over``; a warning counts them with those listed when a batch of
        another shape came (:meth:`_list_carried`)."""
        listed = self._list_carried()
        at_end = sum(hi - lo for _, lo, hi in listed)
        if not (at_end or self.set_aside):
            return listed
        why = []
        if self.set_aside:
            why.append(
                f"{self.set_aside} when the next batch had rows of another shape (a step "
                "trains rows of one shape: bucketed lengths are never joined)"
            )
        if at_end:
            why.append(f"{at_end} when the data ended with fewer than the {self.unit} a step needs")
        warn(
            f"{self.set_aside + at_end} row(s) carried after a device left the run were not "
            f"trained: {'; '.join(why)}; they are listed in history.left_over {self.listed}",
        )
        return listed


def joinable(rows: Any, batch: Any) -> bool:
    """Whether ``rows`` and ``batch`` can be one step's batch: the same tree, each leaf
    the same trailing axes and dtype."""
    a, tree_a = jax.tree.flatten(rows)
    b, tree_b = jax.tree.flatten(batch)
    same: bool = tree_a == tree_b  # type: ignore[operator]  # PyTreeDef compares
    return same and all(
        x.shape[1:] == y.shape[1:] and x.dtype == y.dtype for x, y in zip(a, b, strict=True)
    )


def merge_spans(spans: list[Span]) -> list[Span]:
    """``spans`` with neighbours of one batch joined."""
    out: list[Span] = []
    for seq, lo, hi in spans:
        if out and out[-1][0] == seq and out[-1][2] == lo:
            out[-1] = (seq, out[-1][1], hi)
        elif hi > lo:
            out.append((seq, lo, hi))
    return out


def _split(spans: list[Span], rows: int) -> tuple[list[Span], list[Span]]:
    """The spans of the first ``rows`` rows, and of the rest."""
    head: list[Span] = []
    tail: list[Span] = []
    for seq, lo, hi in spans:
        take = max(0, min(hi - lo, rows))
        if take:
            head.append((seq, lo, lo + take))
        if lo + take < hi:
            tail.append((seq, lo + take, hi))
        rows -= take
    return head, tail


class Cut:
    """Several processes, a device gone: the chunks of each of this process's batches
    that no device is left to train, cut out and listed (``History.left_over``); an
    action of the loop like :class:`Carry`.

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
      presplit: batches come ``(n_devices, per_device, ...)``: joined here when cut.
    """

    rows = None  # the carry's protocol: nothing is ever carried

    def __init__(self, origin: Sequence[int], start: int, presplit: bool = False):
        self.origin = list(origin)
        self.here = set(self.origin)  # of them, the devices still in the step
        self.start = start
        self.listed: list[Span] = []  # the rows this cut listed as never trained
        self.presplit = presplit
        self.cut = 0  # rows listed by this fit call

    def exclude(self, device_ids: Sequence[int]) -> None:
        """Devices that left: their chunks are cut from now on."""
        self.here -= set(device_ids)

    def take(self, item: Item) -> Taken:
        """``item`` without the chunks of devices that left (as it is when it has none),
        and the rows cut. An item cut before (a recovery queued it again) loses only
        what left since."""
        chunks = tuple(range(len(self.origin))) if item.chunks is None else item.chunks
        keep = tuple(j for j in chunks if self.origin[j] in self.here)
        if keep == chunks:
            return Taken(item)
        batch = item.batch
        if self.presplit and item.first is None:
            batch = join_presplit(jax.tree.map(np.asarray, batch), len(self.origin))
        size = validate.batch(batch, len(chunks)) // len(chunks)
        at = {j: i for i, j in enumerate(chunks)}
        rows = np.concatenate([np.arange(at[j] * size, (at[j] + 1) * size) for j in keep])
        first = item.seq if item.first is None else item.first
        listed = []
        for j in chunks:
            if j not in keep:  # rows of the batch as passed: chunk j of its layout
                listed.append((self.start + first, j * size, (j + 1) * size))
                self.cut += size
        self.listed += listed
        taken = item._replace(
            batch=jax.tree.map(lambda x: np.asarray(x)[rows], batch),
            first=first,
            chunks=keep,
        )
        return Taken(taken, tuple(listed))

    def requeue(self) -> None:
        """Nothing carried to queue again."""
        return None

    def release(self) -> list[Item]:
        """Nothing carried to hand back."""
        return []

    def left(self) -> None:
        """No rows carried."""
        return None

    def finish(self) -> list[Span]:
        """The rows cut by this fit call, in a warning (they are in ``History.left_over``
        already: nothing more to list)."""
        if self.cut:
            warn(
                f"{self.cut} row(s) of this process's batches were not trained: they "
                "were the chunks of devices that left the run, and with several processes "
                "a process cannot hand its rows to another; they are listed in "
                f"history.left_over {self.listed}",
            )
        return []
