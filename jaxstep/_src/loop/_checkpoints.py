"""The loop's checkpoint action (``fit(checkpoint_dir=...)``): the loop's hooks on
:class:`jaxstep._src.checkpoint.FitCheckpoints`, which copies the state at checkpoint steps,
writes it once verified, saves a failure's state and batch, and an early stop's state."""

from __future__ import annotations

from jaxstep._src.checkpoint import Cursor
from jaxstep._src.checkpoint import FitCheckpoints
from jaxstep._src.core import HealthTable
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.loop._action import Action
from jaxstep._src.loop._outcome import Resume
from jaxstep._src.loop._pending import Item


class Checkpoints(Action):
    """``saver``'s hooks as an action (only with a checkpoint directory: without one
    there is nothing to save)."""

    def __init__(self, saver: FitCheckpoints):
        self.saver = saver

    def before(self, state: TrainState, item: Item) -> bool:
        """Before ``state`` is dispatched (and donated) on ``item``: whether the step
        must check replicas (a checkpoint step, whose copy is taken here). The data
        position a checkpoint of ``state`` resumes from is ``item``'s first row (rows
        carried: where the rows not trained are, ``item.at``)."""
        if item.at is not None:
            return self.saver.before(state, item.at)
        batch = item.seq if item.first is None else item.first
        return self.saver.before(state, Cursor(batch, item.offset))

    def read(self, table: HealthTable) -> None:
        """A step's table was read: a copy whose replica check passed is written."""
        if self.saver.waiting:
            self.saver.settled(table)

    def resumed(self, resume: Resume, number: int) -> None:
        """A recovery went back, or runs a step again: the next step is ``number`` (a
        device left: the step's runtime from now on)."""
        if resume.runtime is not None:
            self.saver.resumed_on(resume.runtime)
        self.saver.rewind(number)

    def report(self, error: TrainingWorkerError, first: Cursor | None) -> TrainingWorkerError:
        """A failure leaves fit: the emergency save, and the latest checkpoint named."""
        return self.saver.failed(error, first)

    def stopped(self, state: TrainState, untrained: int, first: Cursor | None) -> str | None:
        """An early stop: ``state`` saved (where, or None)."""
        return self.saver.stopped(state, untrained, first)

    def finish(self, state: TrainState, first: Cursor | None) -> None:
        """The run ended: the final state saved (verified), unless its step is already,
        with the data position ``first`` (None: after the last batch pulled)."""
        self.saver.finished(state, first)

    def close(self) -> None:
        """On every way out of fit: the writes waited for, the writer released."""
        self.saver.close()
