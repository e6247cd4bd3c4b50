"""A rollback of ``fit(..., recover=...)``: back to the last verified checkpoint, the
batches of every step since it trained again (held as references until a newer
checkpoint is verified, under ``Recover(rollback_batches=k)``; the failing step's own is
always at hand); for a loss spike (the spike's batch and the ``k - 1`` before it
skipped) and a diverged replica (also without ``k``, to a checkpoint of the failing
step itself: one a previous fit call ended on)."""

from __future__ import annotations

from jaxstep._src.checkpoint import restore_on
from jaxstep._src.core import HealthTable
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.loop._carry import merge_spans
from jaxstep._src.loop._checkpoints import FitCheckpoints
from jaxstep._src.loop._outcome import Resume
from jaxstep._src.loop._outcome import ids_of
from jaxstep._src.loop._outcome import item_of
from jaxstep._src.loop._outcome import step_of
from jaxstep._src.loop._pending import Item
from jaxstep._src.loop._pending import Pending
from jaxstep._src.loop._records import Recovery
from jaxstep._src.loop._rows import Rows
from jaxstep._src.loop._rows import in_words
from jaxstep._src.step import runtime_of


class Rollback:
    """The steps since the last verified checkpoint, for one fit call's recoveries.

    Args:
      checkpoints: the fit call's checkpoints.
      rows: where the rows of a step are in the data (the batches skipped).
      k: ``Recover.rollback_batches`` (None: a loss spike is not rolled back, and no
        batch is kept: a diverged replica rolls back only to a checkpoint of the failing
        step itself, whose batch is at hand).
    """

    def __init__(self, checkpoints: FitCheckpoints, rows: Rows, k: int | None):
        self.checkpoints = checkpoints
        self.rows = rows
        self.k = k
        # (step number, item) of each dispatched step since the last verified
        # checkpoint, oldest first: what a rollback trains again
        self.kept: list[tuple[int, Item]] = []
        # only when asked for, and with periodic checkpoints (without them no step is
        # ever let go): the batches since the newest checkpoint are held (references)
        self.keeps = (
            k is not None and checkpoints.store is not None and checkpoints.every is not None
        )

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

    def spike(self, pending: Pending, error: TrainingWorkerError) -> TrainingWorkerError | Resume:
        """Back to the checkpoint before a loss spike, its batch and the ``k - 1``
        before it skipped; or the error to raise."""
        k = self.k
        if k is None:
            return error.with_note("not recovered: a loss spike needs Recover(rollback_batches=k)")
        back = self._since(pending, error)
        if isinstance(back, TrainingWorkerError):
            return back
        c, since = back
        skip = [item for n, item in since if n > pending.number - k]
        again = [item for n, item in since if n <= pending.number - k]
        detail = (
            f"restored the checkpoint of step {c}; {len(again)} batch(es) since it trained again"
        )
        if any(item.spans is not None for item in skip):  # steps of rows carried
            skipped, rows = in_words(
                merge_spans([span for item in skip for span in self.rows.spans(item)])
            )
            detail += f"; a device gone, the steps skipped held rows of several batches: {rows}"
        else:
            skipped = tuple(b for item in skip if (b := self.rows.batch(item)) is not None)
        record = Recovery(
            error.step,
            "spike",
            "rolled back",
            ids_of(error),
            skipped_batches=skipped,
            batch=self.rows.batch(item_of(pending)),
            detail=detail,
        )
        return Resume(self._restore(pending, c), again, record)

    def diverged(
        self, pending: Pending, error: TrainingWorkerError
    ) -> TrainingWorkerError | Resume:
        """Back to the checkpoint before a replica diverged, every batch since trained
        again; or the error to raise (a note says why)."""
        back = self._since(pending, error)
        if isinstance(back, TrainingWorkerError):
            return back
        c, since = back
        record = Recovery(
            error.step,
            "diverged",
            "rolled back",
            ids_of(error),
            batch=self.rows.batch(item_of(pending)),
            detail=f"restored the checkpoint of step {c}; {len(since)} batch(es) since it "
            "trained again",
        )
        return Resume(self._restore(pending, c), [item for _, item in since], record)

    def _since(
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
        # the failing step's own batch is at hand (pending): a checkpoint of the step
        # it started from (one a previous fit call ended on, say) loses nothing
        since = [(n, item) for n, item in self.kept if c <= n < pending.number]
        since.append((pending.number, item_of(pending)))
        lost = sorted(set(range(c, pending.number)) - {n for n, _ in since})
        if lost:
            steps = f"step {lost[0]}" if len(lost) == 1 else f"steps {lost[0]}..{lost[-1]}"
            return error.with_note(
                f"not recovered: going back to the checkpoint of step {c} would lose "
                f"{len(lost)} batch(es) (of {steps}), not held: "
                "Recover(rollback_batches=1) holds them (references, each until a newer "
                "checkpoint is written) for a rollback to train them again"
            )
        return c, since

    def _restore(self, pending: Pending, number: int) -> TrainState:
        """The checkpoint of step ``number``, placed for the step ``pending`` ran on."""
        store = self.checkpoints.store
        assert store is not None
        return restore_on(runtime_of(step_of(pending)), store.directory, at=number)
