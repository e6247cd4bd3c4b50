"""Where the run is in the data, in one place: the rows carried from step to step once
a device left the run (:class:`Carry`), where each of them came from (spans), the
position a resume starts at (a :class:`~jaxstep._src.checkpoint.Cursor`: rows of the
first batch trained, later batches' rows trained), the data position of the rows not
trained yet (:func:`untrained_at`: what a checkpoint saves, what an early stop hands
back) and the rows left over when the data ends.

Rows are carried once a device left the run (``fit(...,
recover=jaxstep.Recover())`` excluded it): a global batch of B rows no longer divides
by the devices left, and no row may be lost.

The rule: each step trains the largest multiple of ``unit`` (devices x micro-batches)
of the rows at hand, in the order they came; the rest is carried into the next step.
With 64-row batches on 7 devices the steps take 63 rows (9 a device), then, once 7
rows are carried, 70 (10 a device): two batch sizes, each compiled once. Rows still carried
when the data ends (fewer than ``unit``) are never trained: fit lists them in
``History.left_over``.

Rows of different shapes are never joined (bucketed sequence lengths: a batch padded to
24 tokens, the next to 16): a step trains rows of one shape. So there is a carry per
shape (a shape: the batch's tree and each leaf's trailing axes and dtype): a batch
joins the rows carried of its own shape, and the rows of other shapes stay carried
until a batch of theirs comes. When the data ends, at most ``unit - 1`` rows of each
shape are left, listed in ``History.left_over``.

Each row's place in the data is kept (spans), and a batch's rows are trained in order.
With one shape carried, the rows not trained are those from the first carried row on,
and a data position (batch, row) says so. With several, batches trained since the
oldest carried row lie between rows not trained: the position then also names each
later batch that holds rows not trained (``Cursor.then``, ``Position.then``), and a
resume passes over the rest, so it trains exactly the rows the run had not.

With several processes the rows are first gathered from every process, then carried
the same way on each (:mod:`jaxstep._src.loop._resplit`).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import numpy as np

from jaxstep._src.checkpoint import Cursor
from jaxstep._src.core import validate
from jaxstep._src.core import warn
from jaxstep._src.core.names import keystrs
from jaxstep._src.loop._pending import Item
from jaxstep._src.step import Runtime
from jaxstep._src.step import join_presplit

Span = tuple[int, int, int]  # (seq of a batch, first row, stop): rows of the data
#: a fit call that starts at its first batch's first row, nothing trained after it
AT_START = Cursor(0)


def unit_of(runtime: Runtime) -> int:
    """The rows a step's batch must divide by: devices x micro-batches."""
    return len(runtime.devices) * (runtime.options.microbatches or 1)


class Held(NamedTuple):
    """The rows carried of one shape (host arrays), and where they are in the data
    (spans, in the order the rows came)."""

    rows: Any
    spans: list[Span]


class Carry:
    """The rows carried into the next step, and exactly where each came from, one carry
    per shape (:func:`shape_of`): the loop's own (:meth:`take` before each dispatch,
    :meth:`release` when the loop stops or goes back, :meth:`finish`).

    Args:
      unit: the rows a step's size must divide by (devices x micro-batches).
      presplit: batches come ``(n_devices, per_device, ...)``: joined here, ``n_devices``
        read from the batch (laid out for the devices before any left the run).
      start: the data's count of the first batch fit pulled (``History.left_over``
        counts batches from the data's first).
      resumed: where a resume starts, counted from the first batch pulled
        (``Source.resumed``): ``rows`` of the first batch trained already (a position
        inside a batch), and with rows of several shapes carried when it was saved
        (``Position.then``) the later batches that hold rows not trained, ``(seq,
        first row not trained)``; the rows before each, and the batches between two of
        them, were trained: they are passed over.
    """

    def __init__(
        self,
        unit: int,
        presplit: bool = False,
        *,
        start: int = 0,
        resumed: Cursor = AT_START,
    ):
        self.unit = unit
        self.presplit = presplit
        self.start = start
        self.resumed = resumed
        #: the rows carried of each shape that has some (:func:`shape_of`)
        self.held: dict[Shape, Held] = {}

    def take(self, item: Item) -> Item | None:
        """The batch to train now from ``item``'s rows and those carried of their shape
        (its item None: fewer than ``unit`` rows of that shape at hand, all carried
        on). Its ``spans`` say where each of its rows is in the data (``first``/``offset``:
        where the first is). An item that went through here before (a recovery queued it
        again: ``spans`` set) is joined rows with its spans already. Rows carried of
        other shapes stay carried, each until a batch of its own shape comes. Nothing
        changes when it raises: the loop hands ``item`` back."""
        batch = jax.tree.map(np.asarray, item.batch)
        if item.spans is None:
            if self.presplit:  # laid out for the devices before any left: its leading axis
                batch = join_presplit(batch, len(jax.tree.leaves(batch)[0]))
            size = validate.batch(batch, 1)
            skip = self.trained_before(item.seq, size)
            if skip >= size:  # a resume: trained whole before the checkpoint
                return None
            if skip:  # a resume inside this batch
                batch = jax.tree.map(lambda x: x[skip:], batch)
            spans: list[Span] = [(item.seq, skip, size)]
        else:
            spans = list(item.spans)
        shape = shape_of(batch)
        held = self.held.get(shape)
        if held is not None:
            batch = jax.tree.map(lambda a, b: np.concatenate([a, b]), held.rows, batch)
            spans = merge_spans(held.spans + spans)
        total = validate.batch(batch, 1)
        keep = total // self.unit * self.unit
        head, tail = _split(spans, keep)
        if keep < total:
            self.held[shape] = Held(jax.tree.map(lambda x: x[keep:], batch), tail)
        else:
            self.held.pop(shape, None)
        if keep == 0:
            return None
        return item._replace(batch=jax.tree.map(lambda x: x[:keep], batch), spans=tuple(head))

    def user_rows(self, rows: Any) -> Any:
        """The user's batch of rows held (what a warning describes)."""
        return rows

    def trained_before(self, seq: int, size: int) -> int:
        """The first rows of batch ``seq`` (of ``size`` rows) trained before this fit
        call (a resume), passed over: ``resumed.rows`` of the first batch, what
        ``resumed.then`` says of a later one, all of a batch between two it names."""
        marks = [(0, self.resumed.rows), *self.resumed.then]
        if seq > marks[-1][0]:
            return 0
        return next((rows for at, rows in marks if at == seq), size)

    def release(self) -> list[Item]:
        """The carried rows as items to queue again (a recovery resets the loop: they go
        after the steps it queues again, before the batches not pulled yet) or to hand
        back: one item a shape, in the order of their first rows in the data."""
        items = [
            Item(held.rows, held.spans[-1][0], spans=tuple(held.spans))
            for held in self.held.values()
        ]
        self.held.clear()
        return sorted(items, key=lambda item: (item.first, item.offset))

    def left(self) -> list[Span]:
        """Where the rows carried (of every shape) are in the data, in the data's order;
        empty: none."""
        return sorted(span for held in self.held.values() for span in held.spans)

    def finish(self, cut_short: bool = False) -> list[Span]:
        """The data ended, or the call's count of steps (``cut_short``: ``num_steps``,
        ``until_step``): the rows still carried (of each shape) let go, in a warning, as
        the spans to list in ``History.left_over`` (batches counted from the data's
        first), in the data's order. Cut short, the data has batches left: the warning
        says so, and that a resume from the call's final checkpoint trains them."""
        if not self.held:
            return []
        listed = [(self.start + seq, lo, hi) for seq, lo, hi in self.left()]
        helds = sorted(self.held.values(), key=lambda held: held.spans[0])  # data order
        self.held.clear()
        counts = [sum(hi - lo for _, lo, hi in held.spans) for held in helds]
        why = f"the data ended with fewer than the {self.unit} a step needs"
        if cut_short:
            why = (
                "the call's count of steps (num_steps, until_step) ran out while they "
                "were carried; a resume from its final checkpoint trains them"
            )
        if len(helds) > 1:  # each shape's rows waited for batches of their own shape
            kinds = describe([self.user_rows(held.rows) for held in helds])
            each = "; ".join(f"{n} with {kind}" for n, kind in zip(counts, kinds, strict=True))
            why += f" of each shape (rows of two shapes are never joined: {each})"
        warn(
            f"{sum(counts)} row(s) carried after a device left the run were not trained: "
            f"{why}; they are listed in history.left_over {listed}",
        )
        return listed


#: the shape of a batch's rows: its tree, and each leaf's trailing axes and dtype
Shape = tuple[Any, tuple[tuple[tuple[int, ...], Any], ...]]


def shape_of(batch: Any) -> Shape:
    """The shape of ``batch``'s rows (the batch less its leading axis). Rows of one
    shape join into one step's batch; rows of two never do (bucketed lengths: a batch
    padded to 24 tokens and one to 16)."""
    leaves, tree = jax.tree.flatten(batch)
    return tree, tuple((x.shape[1:], x.dtype) for x in leaves)


def describe(batches: Sequence[Any]) -> list[str]:
    """The shape of each of ``batches``' rows in words, by the leaves that tell them
    apart (``x (16, 3) float32``)."""
    words = [
        [f"{name} {x.shape[1:]} {x.dtype}" for name, x in zip(keystrs(b), leaves, strict=True)]
        for b in batches
        for leaves in [jax.tree.leaves(b)]
    ]
    common = set.intersection(*(set(w) for w in words))
    return [", ".join(w for w in ws if w not in common) for ws in words]


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


def starts(item: Item) -> list[tuple[int, int]]:
    """``(seq, first row)`` of each stretch of ``item``'s rows in the data."""
    if item.spans is not None:
        return [(seq, lo) for seq, lo, _ in item.spans]
    return [(item.seq, 0)]


def untrained_at(untrained: Iterable[tuple[int, int]], pulled: int) -> Cursor:
    """The data position of the rows not trained: ``untrained`` gives ``(seq, first
    row)`` of each stretch of them among the ``pulled`` batches pulled (a batch's rows
    are trained in order, so the rest of its rows are not trained either); the batches
    not pulled yet are whole. A batch pulled with no stretch listed was trained whole.

    The :class:`Cursor` names the first row not trained, then (``then``) each later
    batch that holds some, as long as a trained batch comes between: once every batch
    after one of them is untrained whole, it says nothing more."""
    first: dict[int, int] = {}
    for seq, row in untrained:
        if seq < pulled:
            first[seq] = min(row, first.get(seq, row))
    pairs = [*sorted(first.items()), (pulled, 0)]
    # a whole batch right after the last one named is implied: "every batch after it"
    while len(pairs) > 1 and pairs[-1][1] == 0 and pairs[-2][0] == pairs[-1][0] - 1:
        pairs.pop()
    (batch, rows), *then = pairs
    return Cursor(batch, rows, tuple(then))


def placed_in_data(
    item: Item,
    carried: Sequence[Span],
    queue: Iterable[Item],
    pulled: int,
    hold: Callable[[int], None],
) -> Item:
    """``item`` (taken from the carry) with where the rows not trained are in the data
    before it runs (``Item.at``, a checkpoint's data position): its rows, the rows
    ``carried`` of every shape (the carry's :meth:`Carry.left`), the batches ``queue`` d
    and those not pulled yet (of the ``pulled`` batches pulled). ``hold(batch)``: the
    source keeps a checkpointable iterator's state from there on."""
    spans = [*starts(item), *((seq, lo) for seq, lo, _ in carried)]
    spans += [start for queued in queue for start in starts(queued)]
    at = untrained_at(spans, pulled)
    hold(at.batch)
    return item._replace(at=at)


def end_position(carried: Sequence[Span], cut_short: bool, pulled: int) -> Cursor | None:
    """Where the data not trained begins at the end of a fit call: None (after every
    batch pulled) unless the call's count of batches cut it short (``cut_short``) while
    rows were ``carried`` (of every shape, :meth:`Carry.left`), which a resume then
    trains."""
    left = carried if cut_short else ()
    if not left:
        return None
    return untrained_at([(seq, lo) for seq, lo, _ in left], pulled)
