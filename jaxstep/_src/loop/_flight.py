"""What one fit call has pulled and not yet seen trained (:class:`InFlight`): the batches
queued for dispatch, the one in hand, the step dispatched and not read, and every step
whose settling has not completed. What a recovery queues again, and what an early stop
hands back untrained, is read from here."""

from __future__ import annotations

import collections
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

from jaxstep._src.checkpoint import Cursor
from jaxstep._src.core import HealthTable
from jaxstep._src.loop._action import Feeder
from jaxstep._src.loop._pending import Item
from jaxstep._src.loop._pending import Pending
from jaxstep._src.loop._recorder import Recorder
from jaxstep._src.loop._stopping import Untrained
from jaxstep._src.loop._stopping import untrained_batches
from jaxstep._src.step import Runtime


class InFlight:
    """The batches between the data and a settled step, oldest first."""

    __slots__ = ("in_hand", "pending", "queue", "reading", "unconfirmed")

    def __init__(self) -> None:
        #: to dispatch, in order (a recovery queues its batches again at the front)
        self.queue: collections.deque[Item] = collections.deque()
        #: taken from the queue and not dispatched yet (a rejected batch is handed back)
        self.in_hand: Item | None = None
        #: dispatched, its table not read yet (at most one)
        self.pending: Pending | None = None
        #: dispatched steps whose settling has not completed, oldest first
        self.unconfirmed: list[Pending] = []
        #: of them, the one being settled and already recorded in the history
        self.reading: Pending | None = None

    def dispatched(self, pending: Pending) -> Pending | None:
        """``pending`` was dispatched; returns the step before it, to settle now."""
        before, self.pending = self.pending, pending
        self.unconfirmed.append(pending)
        return before

    def confirmed(self, pending: Pending) -> None:
        """``pending`` settled and nothing came of it (no failure)."""
        self.reading = None
        if self.unconfirmed and self.unconfirmed[0] is pending:
            self.unconfirmed.pop(0)

    def restart(self, first: Iterable[Item], number: int, carried: Iterable[Item]) -> None:
        """A recovery of step ``number``: ``first`` (what the recovery trains again),
        then the batches in flight after that step (they ran on a halted state: nothing
        of them trained), the one in hand and the rows ``carried`` (newer than any) go
        to the front of the queue; nothing is in flight any more."""
        later = [p.item for p in self.unconfirmed if p.number > number]
        later += [self.in_hand, *carried]
        queued = [*first, *(item for item in later if item is not None)]
        self.queue.extendleft(reversed(queued))
        self.unconfirmed.clear()
        self.reading = self.pending = self.in_hand = None

    def untrained(
        self, left: Sequence[Pending | Item | None], feeder: Feeder, pulled: int
    ) -> tuple[Untrained, Cursor | None]:
        """Fit stops: the batches of ``left`` (steps in flight, the batch in hand, the
        rows carried), of the queue and those ``feeder`` pulled and never handed over
        (it is stopped first), untrained, in the order they were pulled (with a batch
        still on its way from the data: :class:`Untrained`), and where they are in the
        data (``pulled``: the batches the loop was handed); the queue is emptied."""
        queued = list(self.queue)
        self.queue.clear()
        untaken = feeder.untaken()
        batches, first = untrained_batches([*left, *queued, *untaken], pulled)
        return Untrained(batches, feeder.late()), first

    def read_unconfirmed(
        self, runtime: Runtime, record: Recorder, read: Sequence[Callable[[HealthTable], Any]]
    ) -> tuple[list[Pending], str | None]:
        """Fit stops: reads the tables of the steps whose settling did not complete
        (``read``: the actions' hooks that must see each step, no callbacks: one of them
        may be what raised), records those not recorded yet, and returns the steps from
        the first failed one on (untrained: a halted state changed nothing after it)
        and that failure in words. Nothing is in flight any more."""
        untrained: list[Pending] = []
        failed: str | None = None
        for pending in self.unconfirmed:
            raw = runtime.raw_table(pending.out)
            table = HealthTable.from_array(raw)
            if pending is not self.reading:  # not recorded yet
                record.add(pending, raw)
                self.reading = pending
                for hook in read:
                    hook(table)
            if failed is None and table.failed and table.halted:
                first = runtime.failures(table, pending.rows)[0]
                failed = f"step {table.step} failed too (device {first.device_id}: {first.reason})"
            if failed is not None:
                untrained.append(pending)
        self.unconfirmed.clear()
        self.pending = None
        return untrained, failed
