"""``fit(..., recover=jaxstep.Recover(...))``: act on each failure's verdict and go on.

A failed step under ``recover`` is diagnosed (the replay of :mod:`jaxstep.loop._diagnose`)
and acted on, within a budget:

- ``transient`` -> the step again from the last good state with the same batch;
- ``data`` -> the step again with the chunks holding the offending examples left out of
  the mean (``on_failure="drop"``'s mechanism); the examples are quarantined;
- ``device`` -> training goes on without the device (``step.devices`` shrinks);
- a loss spike -> back to the last verified checkpoint, the spike's batches skipped;
- a diverged replica -> repaired from the majority, or rolled back;
- a hang -> the emergency save, then the process exits for ``launch --restarts``.

Each action is a :class:`~jaxstep.loop.Recovery` in ``History.recoveries``.

With several processes every process takes the same action at the same step: the
failure and the replays are read from global health tables, the offending examples are
shared (:mod:`jaxstep.loop._diagnose`), so every process appends the same records. A
device gone leaves its process's rows with it: see :class:`jaxstep.loop._carry.Cut`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import NoReturn

import jax
import numpy as np

from jaxstep import distributed
from jaxstep.checkpoint import append_quarantine
from jaxstep.checkpoint import restore
from jaxstep.core import HealthTable
from jaxstep.core import Status
from jaxstep.core import TrainingWorkerError
from jaxstep.loop._carry import Carry
from jaxstep.loop._carry import Cut
from jaxstep.loop._carry import merge_spans
from jaxstep.loop._diagnose import Diagnosis
from jaxstep.loop._diagnose import diagnose
from jaxstep.loop._failure import majority_position
from jaxstep.loop._history import History
from jaxstep.loop._history import Recovery as RecoveryRecord
from jaxstep.loop._pending import Item
from jaxstep.loop._pending import Pending
from jaxstep.loop._pending import Recovered
from jaxstep.loop._pending import rows_as_given
from jaxstep.step import driving

if TYPE_CHECKING:
    from jaxstep.loop._driver import Loop

log = logging.getLogger("jaxstep")


@dataclasses.dataclass(frozen=True)
class Recover:
    """How :func:`jaxstep.fit` recovers from failures instead of raising.

    Attributes:
      retries: how many times a step whose failure does not come back on replay
        (a transient fault) is run again with the same batch, from the last good state;
        counted per batch, afresh when a rollback trains the batch again.
      quarantine: act on a ``data`` verdict: the step again with the chunks holding the
        offending examples left out of the mean, the examples recorded (and, with
        ``checkpoint_dir``, appended to its quarantine file: :func:`read_quarantine`).
      exclude_devices: act on a ``device`` verdict: go on without the device.
      rollback_batches: act on a loss spike (``make_train_step(loss_spike=...)`` and
        ``fit(checkpoint_dir=...)``): restore the last verified checkpoint before it,
        skip the spike's batch and the ``rollback_batches - 1`` before it, and train the
        other batches since the checkpoint again. None: a spike is not recovered.
      max_recoveries: the most actions one fit call takes; the next failure raises
        :class:`~jaxstep.TrainingWorkerError` as without ``recover``, listing them.
    """

    retries: int = 1
    quarantine: bool = True
    exclude_devices: bool = True
    rollback_batches: int | None = None
    max_recoveries: int = 10

    def __post_init__(self) -> None:
        for name in ("retries", "max_recoveries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Recover({name}=...) must be an int >= 0, got {value!r}")
        for name in ("quarantine", "exclude_devices"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"Recover({name}=...) must be True or False, got {getattr(self, name)!r}"
                )
        k = self.rollback_batches
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(
                f"Recover(rollback_batches=...) must be None or an int >= 1 (the spike's "
                f"batch and the k - 1 before it are skipped), got {k!r}"
            )


class Recovery:
    """What one fit call's recoveries hold between failures (the :class:`Loop` has
    one when ``fit(..., recover=...)``): the budget spent, the retries of each batch,
    and the steps since the last verified checkpoint (a rollback trains them again).

    :meth:`attempt` acts on a failed step's verdict: it resets the loop (the new state,
    the batches to train queued again) and raises :class:`Recovered`, or returns the
    error to raise, with a note saying why it was not recovered.
    """

    def __init__(self, options: Recover, loop: Loop):
        self.options = options
        self.loop = loop
        # retries by batch (its Item.seq); a rollback's training again starts afresh
        self.retried: dict[int, int] = {}
        # (step number, item) of each dispatched step since the last verified
        # checkpoint, oldest first: what a rollback trains again
        self.kept: list[tuple[int, Item]] = []
        # only when asked for, and with periodic checkpoints (without them no step is
        # ever let go): the batches since the newest checkpoint are held (references)
        self.since = len(loop.history.recoveries)  # records of earlier fit calls
        self.rolls_back = (
            options.rollback_batches is not None
            and loop.checkpoints.store is not None
            and loop.checkpoints.every is not None
        )

    @property
    def records(self) -> list[RecoveryRecord]:
        """This fit call's records (a history passed to several fits holds theirs too)."""
        return self.loop.history.recoveries[self.since :]

    def dispatched(self, pending: Pending) -> None:
        """A step was dispatched: kept for a rollback until a newer checkpoint."""
        if self.rolls_back and pending.item is not None:
            self.kept.append((pending.number, pending.item))

    def settled(self, pending: Pending, table: HealthTable) -> None:
        """A step's table was read: a replica the step repaired (``drop``) is recorded,
        and the steps a newer checkpoint holds are let go."""
        if table.repaired.any():
            ids = tuple(self.loop.step.devices[i].id for i in np.flatnonzero(table.repaired))
            self._record(
                RecoveryRecord(
                    table.step,
                    "diverged",
                    "repaired",
                    ids,
                    batch=self._batch(pending.item),
                    detail="copied from a majority replica inside the step (on_failure='drop')",
                )
            )
        # Let go of the steps before the checkpoint step before the newest one settled:
        # by step number, the same on every process (only one process writes, so only it
        # knows which writes finished); a rollback past a write that failed is refused.
        every = self.loop.checkpoints.every
        if self.kept and every:
            oldest = (table.step // every - 1) * every
            if self.kept[0][0] < oldest:
                self.kept = [(n, item) for n, item in self.kept if n >= oldest]

    def attempt(
        self, pending: Pending, table: HealthTable, error: TrainingWorkerError
    ) -> TrainingWorkerError:
        """Acts on the failure of ``pending`` (``error``, from its ``table``): raises
        :class:`Recovered` once the loop goes on, or returns the error to raise."""
        if len(self.records) >= self.options.max_recoveries:
            return error.with_note(
                f"not recovered: the budget of max_recoveries={self.options.max_recoveries} "
                "recoveries is spent",
            )
        status = Status(0)
        for failure in error.failures:
            status |= failure.status
        if status & Status.DIVERGED:
            return self._diverged(pending, error)
        if status & Status.LOSS_SPIKE:
            return self._spike(pending, error)
        found = self._verdict(pending, error)
        error = error.with_diagnosis(found)
        if found.verdict == "transient":
            return self._retry(pending, error)
        if found.verdict == "data":
            return self._quarantine(pending, error, found)
        if found.verdict == "device":
            return self._exclude(pending, error, found)
        return error.with_note(f"not recovered: the replay's verdict is {found.verdict!r}")

    def summary(self) -> None:
        """At the end of fit: the recoveries made, logged (at WARNING level unless a
        callback showed them)."""
        text = History(recoveries=self.records).recovery_summary()
        if text:
            level = logging.INFO if self.loop.callbacks.show_recoveries else logging.WARNING
            log.log(level, "%s", text)

    def noted(self, error: TrainingWorkerError) -> TrainingWorkerError:
        """``error`` (about to leave fit) with the recoveries made before it listed."""
        if not self.records:
            return error
        lines = [
            f"fit recovered {len(self.records)} failure(s) before this one "
            f"(max_recoveries={self.options.max_recoveries}):"
        ]
        lines += [f"  {record}" for record in self.records]
        return error.with_note("\n".join(lines))

    # -- the verdicts --------------------------------------------------------------

    def _verdict(self, pending: Pending, error: TrainingWorkerError) -> Diagnosis:
        batch = pending.batch
        if self.loop.presplit and _item(pending).first is None:
            batch = driving.join(self.loop.step, batch)  # the replay takes the global batch
        return diagnose(self.loop.step, error, batch)

    def _retry(self, pending: Pending, error: TrainingWorkerError) -> TrainingWorkerError:
        item = _item(pending)
        done = self.retried.get(item.seq, 0)
        if done >= self.options.retries:
            return error.with_note(
                f"not recovered: the step was retried {done} time(s) already "
                f"(Recover(retries={self.options.retries}))",
            )
        self.retried[item.seq] = done + 1
        record = RecoveryRecord(
            error.step,
            "transient",
            "retried",
            _ids(error),
            batch=self._batch(item),
            detail="the same batch again from the last good state",
        )
        self._resume(pending, error.state, [item], record)

    def _quarantine(
        self, pending: Pending, error: TrainingWorkerError, found: Diagnosis
    ) -> TrainingWorkerError:
        item = _item(pending)
        if not self.options.quarantine:
            return error.with_note("not recovered: Recover(quarantine=False)")
        if item.drop:
            return error.with_note(
                "not recovered: the step failed again with the failing chunks left out"
            )
        devices = found.devices or _ids(error)
        sources = self._sources(item, found.examples)
        # Every device failed: a collective in the model (cross-device BatchNorm)
        # carried the bad rows into every chunk, so the rerun leaving the failing
        # chunks out of the mean is skipped whole (state.step counts it): say so.
        spread = len(_ids(error)) >= len(self.loop.step.devices)
        skipped: tuple[int, ...] = ()
        if spread:
            skipped, lost = _in_words(self._spans(item))
            detail = (
                f"every device failed (a collective in the model carries the bad rows to "
                f"every chunk), so the step is skipped: {lost} not trained"
            )
        else:
            where = "; ".join(f"batch {b} rows {rows}" for b, rows in sources.items())
            detail = "the step again with the chunks holding them left out of the mean" + (
                f" (in the data: {where})" if item.spans is not None else ""
            )
        record = RecoveryRecord(
            error.step,
            "data",
            "quarantined",
            devices,
            examples=found.examples,
            skipped_batches=skipped,
            batch=self._batch(item),
            detail=detail,
        )
        store = self.loop.checkpoints.store
        if store is not None:
            for batch, rows in sources.items():  # process 0 writes it
                append_quarantine(
                    store.directory,
                    step=error.step,
                    batch=batch,
                    examples=rows,
                    batch_size=self.loop.batch_rows or self._rows_of(item),
                    device_ids=devices,
                )
        self._resume(pending, error.state, [item._replace(drop=True)], record)

    def _exclude(
        self, pending: Pending, error: TrainingWorkerError, found: Diagnosis
    ) -> TrainingWorkerError:
        if not self.options.exclude_devices:
            return error.with_note("not recovered: Recover(exclude_devices=False)")
        step = self.loop.step
        # the devices the replay blamed: not those a collective in the model infected
        ids = found.devices or _ids(error)
        if len(ids) >= len(step.devices):
            return error.with_note("not recovered: every device failed")
        many = distributed.spans_processes(step.devices)
        here = [d.id for d in step.devices if d.process_index == jax.process_index()]
        gone = sorted({d.process_index for d in step.devices if d.id in ids})
        try:
            state = step.exclude_devices(ids, error.state)
        except ValueError as err:  # a process would keep none of its devices
            return error.with_note(f"not recovered: {err}")
        loop = self.loop
        loop.device_count = len(step.devices)
        where = {d: i for i, d in enumerate(loop.history.device_ids)}
        loop.columns = np.asarray([where[d.id] for d in step.devices])
        detail = f"training goes on on the other {len(step.devices)} device(s)"
        if many:  # rows stay with their process: the lost devices' chunks are listed
            if not isinstance(loop.carry, Cut):
                start = loop.checkpoints.source.start
                loop.carry = Cut(here, start, loop.history.left_over, loop.presplit)
            loop.carry.exclude(ids)
            detail += (
                f"; process(es) {gone} no longer train their chunk(s) of each batch "
                "(a process cannot hand its rows to another): listed in history.left_over"
            )
        else:  # the rows that do not divide by the devices left are carried
            carry = loop.carry if isinstance(loop.carry, Carry) else None
            loop.carry = carry or Carry(loop.unit, presplit=loop.presplit)
            loop.carry.unit = loop.unit
        item = _item(pending)
        record = RecoveryRecord(
            error.step, "device", "excluded", ids, batch=self._batch(item), detail=detail
        )
        self._resume(pending, state, [item], record)

    def _spike(self, pending: Pending, error: TrainingWorkerError) -> TrainingWorkerError:
        k = self.options.rollback_batches
        if k is None:
            return error.with_note("not recovered: a loss spike needs Recover(rollback_batches=k)")
        back = self._since_checkpoint(pending, error)
        if isinstance(back, TrainingWorkerError):
            return back
        c, since = back
        skip = [item for n, item in since if n > pending.number - k]
        again = [item for n, item in since if n <= pending.number - k]
        detail = (
            f"restored the checkpoint of step {c}; {len(again)} batch(es) since it trained again"
        )
        if any(item.spans is not None for item in skip):  # steps of rows carried
            skipped, rows = _in_words(
                merge_spans([span for item in skip for span in self._spans(item)])
            )
            detail += f"; a device gone, the steps skipped held rows of several batches: {rows}"
        else:
            skipped = tuple(b for item in skip if (b := self._batch(item)) is not None)
        record = RecoveryRecord(
            error.step,
            "spike",
            "rolled back",
            _ids(error),
            skipped_batches=skipped,
            batch=self._batch(_item(pending)),
            detail=detail,
        )
        self._roll_back(pending, c, again, record)

    def _diverged(self, pending: Pending, error: TrainingWorkerError) -> TrainingWorkerError:
        back = self._since_checkpoint(pending, error)
        if not isinstance(back, TrainingWorkerError):
            c, since = back
            record = RecoveryRecord(
                error.step,
                "diverged",
                "rolled back",
                _ids(error),
                batch=self._batch(_item(pending)),
                detail=f"restored the checkpoint of step {c}; {len(since)} batch(es) since it "
                "trained again",
            )
            self._roll_back(pending, c, [item for _, item in since], record)
        if not error.state_is_good or majority_position(self.loop.step, error.failures) is None:
            return back
        record = RecoveryRecord(
            error.step,
            "diverged",
            "repaired",
            _ids(error),
            batch=self._batch(_item(pending)),
            detail="the state rebuilt from a replica that agrees with the majority, "
            "the step run again",
        )
        self._resume(pending, error.state, [_item(pending)], record)

    # -- shared --------------------------------------------------------------------

    def _since_checkpoint(
        self, pending: Pending, error: TrainingWorkerError
    ) -> tuple[int, list[tuple[int, Item]]] | TrainingWorkerError:
        """The last verified checkpoint at or before the failing step, and the steps
        from it to the failing one (included), or the error to raise."""
        c = self.loop.checkpoints.latest_verified()
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

    def _roll_back(
        self, pending: Pending, number: int, items: list[Item], record: RecoveryRecord
    ) -> NoReturn:
        """Goes on from the checkpoint of step ``number`` with ``items``: each batch
        trained again is a fresh attempt, its retries counted from zero again (the
        budget, ``max_recoveries``, still bounds them all)."""
        store = self.loop.checkpoints.store
        assert store is not None
        state = restore(self.loop.step, store.directory, at=number)
        for item in items:
            self.retried.pop(item.seq, None)
        self._resume(pending, state, items, record)

    def _resume(
        self, pending: Pending, state: Any, items: list[Item], record: RecoveryRecord
    ) -> NoReturn:
        """Resets the loop to go on from ``state`` with ``items``, then the batches in
        flight after ``pending`` (they ran on a halted state: nothing of them trained),
        records ``record`` and raises :class:`Recovered`."""
        loop = self.loop
        later = [p.item for p in loop.unconfirmed if p.number > pending.number]
        if loop.held is not None:
            later.append(loop.held)
        if loop.carry is not None:  # newer than any step queued again
            later.append(loop.carry.requeue())
        loop.queue.extendleft(reversed([*items, *(i for i in later if i is not None)]))
        loop.unconfirmed.clear()
        loop.read.clear()
        loop.pending = loop.held = None
        loop.state = state
        number = int(np.asarray(driving.first_copy(loop.step, state.step)))
        loop.number = loop.next_step = number
        loop.checkpoints.rewind(number)
        self.kept = [(n, item) for n, item in self.kept if n < number]
        self._record(record)
        raise Recovered

    def _record(self, record: RecoveryRecord) -> None:
        self.loop.history.recoveries.append(record)
        level = logging.INFO if self.loop.callbacks.show_recoveries else logging.WARNING
        log.log(level, "jaxstep recovered a failure: %s", record)
        self.loop.callbacks.on_recovery(record)

    def _rows_of(self, item: Item) -> int:
        """The rows of a batch as the data gives them (presplit ones joined)."""
        return rows_as_given(item.batch, self.loop.presplit and item.first is None) or 0

    def _spans(self, item: Item) -> list[tuple[int, int, int]]:
        """The rows of ``item``'s batch in the data: ``(batch, first row, stop)`` of
        each stretch, the batches counted from the data's first."""
        start = self.loop.checkpoints.source.start
        if item.spans is None:  # a whole batch, every process's rows
            return [(start + item.seq, 0, self.loop.batch_rows or self._rows_of(item))]
        return [(start + seq, lo, hi) for seq, lo, hi in item.spans]

    def _sources(self, item: Item, examples: Sequence[int]) -> dict[int, list[int]]:
        """Where ``examples`` (indices into ``item``'s batch) are in the data: ``{batch:
        rows}``, the batches counted from the data's first (rows carried after a device
        left the run come from several batches: ``item.spans``)."""
        found: dict[int, list[int]] = {}
        spans = self._spans(item)
        for e in examples:
            at = int(e)
            for batch, lo, hi in spans:
                if at < hi - lo:
                    found.setdefault(batch, []).append(lo + at)
                    break
                at -= hi - lo
        return found

    def _batch(self, item: Item | None) -> int | None:
        """The batch's number in the data (counting its first batch as 0)."""
        if item is None:
            return None
        return self.loop.checkpoints.source.start + item.seq


def _item(pending: Pending) -> Item:
    assert pending.item is not None  # every step fit dispatches comes from its queue
    return pending.item


def _in_words(spans: Sequence[tuple[int, int, int]]) -> tuple[tuple[int, ...], str]:
    """The batches ``spans`` (``(batch, first row, stop)``) touch, and the rows in words."""
    text = ", ".join(f"batch {b} rows {lo}..{hi - 1}" for b, lo, hi in spans)
    return tuple(sorted({b for b, _, _ in spans})), text


def _ids(error: TrainingWorkerError) -> tuple[int, ...]:
    return tuple(dict.fromkeys(f.device_id for f in error.failures))
