"""Where the rows not trained yet are in the data (:func:`untrained_at`): the data
position a checkpoint saves, and the one an early stop hands back. Rows carried of
several shapes (bucketed lengths) leave trained batches between untrained ones; the
position then names each batch that still holds rows not trained (``Cursor.then``)."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable

from jaxstep._src.checkpoint import Cursor
from jaxstep._src.loop._carry import Carry
from jaxstep._src.loop._pending import Item
from jaxstep._src.loop._resplit import Resplit


def starts(item: Item) -> list[tuple[int, int]]:
    """``(seq, first row)`` of each stretch of ``item``'s rows in the data."""
    if item.spans is not None:
        return [(seq, lo) for seq, lo, _ in item.spans]
    return [(item.seq if item.first is None else item.first, item.offset)]


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
    carry: Carry | Resplit | None,
    queue: Iterable[Item],
    pulled: int,
    hold: Callable[[int], None],
) -> Item:
    """``item`` (taken from the carry) with where the rows not trained are in the data
    before it runs (``Item.at``, a checkpoint's data position): its rows, the rows
    carried of every shape, the batches ``queue`` d and those not pulled yet (of the
    ``pulled`` batches pulled). ``hold(batch)``: the source keeps a checkpointable
    iterator's state from there on."""
    if carry is None:
        return item
    spans = [*starts(item), *((seq, lo) for seq, lo, _ in carry.left())]
    spans += [start for queued in queue for start in starts(queued)]
    at = untrained_at(spans, pulled)
    hold(at.batch)
    return item._replace(at=at)


def end_position(carry: Carry | Resplit | None, cut_short: bool, pulled: int) -> Cursor | None:
    """Where the data not trained begins at the end of a fit call: None (after every
    batch pulled) unless the call's count of batches cut it short (``cut_short``) while
    rows were carried, which a resume then trains (of every shape)."""
    left = None if carry is None or not cut_short else carry.left()
    if not left:
        return None
    return untrained_at([(seq, lo) for seq, lo, _ in left], pulled)
