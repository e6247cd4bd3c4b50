"""What fit's loop moves between its steps: a batch on its way (:class:`Item`) and a
dispatched step not read yet (:class:`Pending`, with the step it ran on)."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import numpy as np

from jaxstep._src.checkpoint import Cursor
from jaxstep._src.core import StepOutput
from jaxstep._src.step import TrainStep


class Item(NamedTuple):
    """A batch on its way to a step: pulled from the source, or queued again by a
    recovery (:mod:`jaxstep._src.loop._recover`)."""

    batch: Any
    seq: int  # batches pulled by this fit before it (its data position, less the start)
    drop: bool = False  # run with the failing chunks left out of the mean (a data recovery)
    # rows carried (loop._carry): where each stretch of its rows is in the data,
    # ``(seq, start, stop)`` in order (None: the whole batch ``seq``, as pulled)
    spans: tuple[tuple[int, int, int], ...] | None = None
    # several processes, rows re-split (loop._resplit) or read whole by every process
    # (fit(global_batches=True)): every process's rows of the step, of which ``batch``
    # holds this process's devices' chunks (None: neither)
    shared: Shared | None = None
    # fit(prefetch=...): the batch already on the devices (None: the step places it)
    placed: Placed | None = None
    # rows carried: where the rows not trained by the state it is dispatched on are in
    # the data (that state's checkpoint position; None: from this batch's first row)
    at: Cursor | None = None

    @property
    def first(self) -> int | None:
        """Rows carried: the seq of the batch its first row came from (None: the whole
        batch ``seq``, as pulled)."""
        return None if self.spans is None else self.spans[0][0]

    @property
    def offset(self) -> int:
        """Rows carried: the rows of batch :attr:`first` trained before its first row."""
        return 0 if self.spans is None else self.spans[0][1]

    @property
    def start(self) -> Cursor:
        """Where its first row is in the data (the data position of a checkpoint of the
        state before it, when no rows are carried)."""
        return Cursor(self.seq if self.spans is None else self.spans[0][0], self.offset)


class Shared(NamedTuple):
    """A step's rows on several processes once they were re-split over the devices
    (:mod:`jaxstep._src.loop._resplit`), or a global batch every process read whole: all
    of them, every process's (host arrays, in the order ``Item.spans`` gives), and the
    process whose devices they were laid out for (its index)."""

    rows: Any
    owner: np.ndarray
    #: every process read these rows whole (``fit(global_batches=True)``): nothing was
    #: gathered, and what is handed back untrained is all of them
    everyone: bool = False
    #: a whole batch so read, not split yet: as the data gave it (handed back so:
    #: pre-split, its own arrays), else None
    as_given: Any = None

    def own(self) -> Any:
        """The rows this process passed (its devices' chunks, as laid out first)."""
        mine = np.flatnonzero(self.owner == jax.process_index())
        return jax.tree.map(lambda x: x[mine], self.rows)

    def given(self) -> Any:
        """What this process hands back untrained: the rows as it was given them (all of
        them when it read every batch whole, else those it passed)."""
        if self.as_given is not None:
            return self.as_given
        return self.rows if self.everyone else self.own()


class Placed(NamedTuple):
    """A batch placed on the step's devices ahead of its step (``fit(prefetch=...)``):
    the step takes it as placed while its placement is still the step's (``key is
    step's runtime``: a device leaving makes a new step)."""

    key: object
    batch: Any


class Pending(NamedTuple):
    """A dispatched step whose health table has not been read yet."""

    out: StepOutput
    batch: Any
    number: int  # the step it runs (as counted from the state fit started with)
    rows: int  # rows per device of its batch, as this process passed it
    item: Item | None = None  # how it came (None: dispatched outside the queue)
    wait: float = 0.0  # seconds the loop waited for its batch from the data
    #: the step it ran on (a recovery of its failure acts on that step's devices)
    step: TrainStep | None = None


def rows_as_given(batch: Any, presplit: bool) -> int | None:
    """The rows of a batch as the data gives it (None: not an array batch)."""
    shape: tuple[int, ...] = tuple(getattr((jax.tree.leaves(batch) or [None])[0], "shape", ()))
    if len(shape) < 1 + presplit:
        return None
    return shape[0] * shape[1] if presplit else shape[0]
