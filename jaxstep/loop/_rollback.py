"""What a rollback of ``fit(..., recover=Recover(rollback_batches=k))`` goes back to: the
last verified checkpoint, and the batches of every step since it (held as references
until a newer checkpoint is verified), to train again."""

from __future__ import annotations

from jaxstep.checkpoint import FitCheckpoints
from jaxstep.checkpoint import restore
from jaxstep.core import HealthTable
from jaxstep.core import TrainingWorkerError
from jaxstep.core import TrainState
from jaxstep.loop._pending import Item
from jaxstep.loop._pending import Pending
from jaxstep.step import TrainStep


class Rollback:
    """The steps since the last verified checkpoint, for one fit call's recoveries.

    Args:
      step: the step (restored onto).
      checkpoints: the fit call's checkpoints.
      asked: a rollback may be taken (a loss spike's, ``rollback_batches``); a diverged
        replica rolls back only to steps kept for it.
    """

    def __init__(self, step: TrainStep, checkpoints: FitCheckpoints, asked: bool):
        self.step = step
        self.checkpoints = checkpoints
        # (step number, item) of each dispatched step since the last verified
        # checkpoint, oldest first: what a rollback trains again
        self.kept: list[tuple[int, Item]] = []
        # only when asked for, and with periodic checkpoints (without them no step is
        # ever let go): the batches since the newest checkpoint are held (references)
        self.keeps = asked and checkpoints.store is not None and checkpoints.every is not None

    def dispatched(self, pending: Pending) -> None:
        """A step was dispatched: kept until a newer checkpoint."""
        if self.keeps and pending.item is not None:
            self.kept.append((pending.number, pending.item))

    def settled(self, table: HealthTable) -> None:
        """Lets go of the steps before the checkpoint step before the newest one
        settled: by step number, the same on every process (only one process writes, so
        only it knows which writes finished); a rollback past a write that failed is
        refused."""
        every = self.checkpoints.every
        if self.kept and every:
            oldest = (table.step // every - 1) * every
            if self.kept[0][0] < oldest:
                self.kept = [(n, item) for n, item in self.kept if n >= oldest]

    def resumed(self, number: int) -> None:
        """The loop goes on from step ``number``: the steps from it on run again."""
        self.kept = [(n, item) for n, item in self.kept if n < number]

    def since(
        self, pending: Pending, error: TrainingWorkerError
    ) -> tuple[int, list[tuple[int, Item]]] | TrainingWorkerError:
        """The last verified checkpoint at or before the failing step, and the steps
        from it to the failing one (included), or the error to raise."""
        c = self.checkpoints.latest_verified()
        if c is None or c > pending.number:
            return error.with_note(
                "not recovered: no verified checkpoint to go back to "
                "(fit(checkpoint_dir=..., checkpoint_every=...))",
            )
        since = [(n, item) for n, item in self.kept if c <= n <= pending.number]
        if [n for n, _ in since] != list(range(c, pending.number + 1)):
            return error.with_note(
                f"not recovered: the batches since the checkpoint of step {c} are gone"
            )
        return c, since

    def restore(self, number: int) -> TrainState:
        """The checkpoint of step ``number``, placed for the step."""
        store = self.checkpoints.store
        assert store is not None
        return restore(self.step, store.directory, at=number)
