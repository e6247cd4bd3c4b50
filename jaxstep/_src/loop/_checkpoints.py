"""Fit's checkpoints (``fit(checkpoint_dir=...)``), a listener of the run's events: when
a checkpoint is taken (every ``checkpoint_every`` steps: a copy of the state before the
step, written once the step's table shows the replicas agree) and from which data
position, and the saves of a run's end, a failure and an early stop. How each is
written (the writer thread, several processes, the emergency save) is the checkpoint
layer's :class:`~jaxstep._src.checkpoint.Saver`, which knows nothing of fit's events."""

from __future__ import annotations

from jaxstep._src.checkpoint import Cursor
from jaxstep._src.checkpoint import Saver
from jaxstep._src.core import HealthTable
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.core import log
from jaxstep._src.loop._action import Action
from jaxstep._src.loop._outcome import Resume
from jaxstep._src.loop._pending import Item


class FitCheckpoints(Action):
    """One fit call's checkpoints, written by ``saver``
    (:func:`jaxstep._src.checkpoint.begin_fit` builds it). A listener only with a
    checkpoint directory (``store`` not None: without one there is nothing to save);
    the loop's other parts read the run here: ``store``, ``every``, ``source`` (the
    data), ``first`` (the step the fit call starts at) and :meth:`latest_verified`.
    The step number of a state is the loop's one counter (``state.step``), handed to
    :meth:`before` and :meth:`resumed`: nothing here counts steps."""

    bucket = "checkpoint"

    def __init__(self, saver: Saver):
        self.saver = saver
        self.store = saver.store
        self.every = saver.every
        self.source = saver.source
        self.first = saver.first

    def latest_verified(self) -> int | None:
        """The step of the newest verified checkpoint written, or None
        (:meth:`~jaxstep._src.checkpoint.Saver.latest_verified`)."""
        return self.saver.latest_verified()

    def before(self, state: TrainState, item: Item, number: int) -> bool:
        """Before ``state``, the state of step ``number``, is dispatched (and donated) on
        ``item``: whether the step
        must check replicas, at a checkpoint step on every process alike (the same
        program everywhere), so the checkpoint is verified; its copy is taken here,
        unless that step is written already. The data position a checkpoint of
        ``state`` resumes from is ``item``'s first row (rows carried: where the rows not
        trained are, ``item.at``)."""
        check = self.every is not None and self.store is not None and number % self.every == 0
        if not check or self.saver.holds(number):
            return check
        at = item.start if item.at is None else item.at
        self.saver.take(number, state, self.source.position(at))
        return True

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
        """A failure leaves fit: the emergency save (its batch at ``first`` in the data,
        by default the first of ``error.batches``, the last ones pulled), and the latest
        verified checkpoint named."""
        if first is None:
            first = Cursor(self.source.count - len(error.batches))
        return self.saver.emergency(error, first)

    def stopped(self, state: TrainState, untrained: int, first: Cursor | None) -> str | None:
        """``fit`` stops early (Ctrl-C, an exception): saves ``state`` as the checkpoint
        of its step, verified when its replicas agree, with the data position before the
        ``untrained`` batches pulled last (or at ``first``), so ``resume=True`` goes on
        from it. Returns where, or None (several processes, whose positions would need
        every peer, and which do not stop together: their latest periodic checkpoint
        stands)."""
        if len(self.saver.processes) > 1:
            log.warning("fit stopped early: with several processes no state is saved")
            return None
        at = Cursor(self.source.count - untrained) if first is None else first
        return self.saver.save_now(state, self.source.position(at), "when fit stopped early")

    def finish(self, state: TrainState, first: Cursor | None) -> None:
        """The data ended (or ``num_steps``): ``state`` saved as the checkpoint of its
        step (unless it is already), verified when every device holds the same copy,
        with the data position ``first`` (the first row carried and not trained, when
        the call's count of batches cut it short) or after the last batch pulled (every
        batch pulled was trained), so a restarted job's ``resume=True`` trains nothing
        twice and misses nothing. Every process calls it (they end together)."""
        position = self.source.position(Cursor(self.source.count) if first is None else first)
        self.saver.save_now(state, position, "at the end of fit")

    def close(self) -> None:
        """On every way out of fit: the writes waited for, the writer released."""
        self.saver.close()
