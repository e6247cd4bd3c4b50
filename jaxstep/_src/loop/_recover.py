"""``fit(..., recover=jaxstep.Recover(...))``: act on each failure's verdict and go on.

A failed step under ``recover`` is diagnosed (the replay of :mod:`jaxstep._src.loop._diagnose`)
and acted on, within a budget:

- ``transient`` -> the step again from the last good state with the same batch;
- ``data`` -> the step again with the chunks holding the offending examples left out of
  the mean (``on_failure="drop"``'s mechanism); the examples are quarantined;
- ``device`` -> training goes on without the device (``step.devices`` shrinks);
- a loss spike -> back to the last verified checkpoint, the spike's batches skipped;
- a diverged replica -> repaired from the majority, or rolled back;
- a hang -> the emergency save, then the process exits for ``launch --restarts`` (under
  a launcher that restarts it; elsewhere, a notebook say, the error is raised); so does
  a ``device`` verdict whose exclusion would leave a process none of its devices.

Each action is a :class:`~jaxstep.Recovery` in ``History.recoveries``. The
recovery is one of the loop's actions: it returns what the loop should do (a
:class:`~jaxstep._src.loop._outcome.Resume`, with a new step when a device left) and what
it should record, and never touches the loop, the history or another action. It holds
no step: it acts on the step the failing one ran on (``Pending.step``).

With several processes every process takes the same action at the same step: the
failure and the replays are read from global health tables, the offending examples are
shared (:mod:`jaxstep._src.loop._diagnose`), so every process appends the same records. A
device gone: every process's rows are gathered and re-split over the devices left
(:mod:`jaxstep._src.loop._resplit`; the loop makes the carry once a device left).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from jaxstep._src.checkpoint import Cursor
from jaxstep._src.checkpoint import append_quarantine
from jaxstep._src.core import HealthTable
from jaxstep._src.core import Status
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.core import log
from jaxstep._src.core import processes
from jaxstep._src.core import under_restarting_launcher
from jaxstep._src.loop._action import Action
from jaxstep._src.loop._checkpoints import FitCheckpoints
from jaxstep._src.loop._diagnose import Diagnosis
from jaxstep._src.loop._diagnose import diagnose_on
from jaxstep._src.loop._failure import majority_position
from jaxstep._src.loop._history import History
from jaxstep._src.loop._ledger import Ledger
from jaxstep._src.loop._options import Recover
from jaxstep._src.loop._outcome import Resume
from jaxstep._src.loop._outcome import ids_of
from jaxstep._src.loop._outcome import item_of
from jaxstep._src.loop._outcome import state_of
from jaxstep._src.loop._outcome import step_of
from jaxstep._src.loop._pending import Pending
from jaxstep._src.loop._records import Recovery as RecoveryRecord
from jaxstep._src.loop._restart import exit_for_restart
from jaxstep._src.loop._restart import is_hang
from jaxstep._src.loop._restart import not_restarted
from jaxstep._src.loop._rollback import Rollback
from jaxstep._src.loop._rows import Rows
from jaxstep._src.loop._rows import in_words
from jaxstep._src.step import Runtime
from jaxstep._src.step import runtime_of


class SelfHealing(Action):
    """The listener that heals a run (``fit(..., recover=...)``): what one fit call's
    recoveries hold between failures (the budget spent, the retries of each batch, the
    steps since the last verified checkpoint: a rollback trains them again).

    :meth:`failed` acts on a failed step's verdict: it returns a :class:`Resume` for the
    loop to go on with, or the error to raise, with a note saying why it was not
    recovered. A hang or a lost peer under ``recover`` exits for a restart (:meth:`hung`)
    when a launcher will restart the process, and is raised otherwise.

    Args:
      options: ``fit(recover=...)``.
      runtime: the runtime of the step fit starts on (the devices its batches are laid
        out for).
      checkpoints: the fit call's checkpoints (a rollback restores from them).
      presplit: batches come pre-split.
      step_timeout: the replays are watched as the steps are.
      shown: a callback shows the recoveries (the summary is then logged at INFO).
      ledger: where the replays' time goes (``"diagnosis"``; the rest of this
        action's is ``"recovery"``), or None.
    """

    bucket = "recovery"

    def __init__(
        self,
        options: Recover,
        runtime: Runtime,
        *,
        checkpoints: FitCheckpoints,
        presplit: bool,
        step_timeout: float | None = None,
        shown: bool = False,
        ledger: Ledger | None = None,
    ):
        self.options = options
        self.diagnose = diagnose_on if ledger is None else ledger.timed("diagnosis", diagnose_on)
        self.checkpoints = checkpoints
        self.presplit = presplit
        self.step_timeout = step_timeout
        self.shown = shown
        self.rows = Rows(runtime, checkpoints.source.start, presplit, options.example_id)
        self.fit_start = checkpoints.first  # state.step as this fit call starts
        self.rollback = Rollback(checkpoints, self.rows, options.rollback_batches)
        # retries by batch (its Item.seq); a rollback's training again starts afresh
        self.retried: dict[int, int] = {}
        #: this fit call's records, as the loop recorded them (:meth:`on_recovery`)
        self.records: list[RecoveryRecord] = []
        #: an exclusion would leave a process no device: the job restarts instead
        #: (:meth:`on_failure`), from the checkpoint this note names
        self.restart: str | None = None

    # -- the hooks, in the order of a run --------------------------------------------

    def pulled(self, batch: Any) -> None:
        """A batch was pulled: the first gives the rows of a batch in the data."""
        self.rows.pulled(batch)

    def dispatched(self, pending: Pending) -> None:
        """A step was dispatched: kept for a rollback until a newer checkpoint."""
        self.rollback.dispatched(pending)

    def settled(self, pending: Pending, table: HealthTable) -> RecoveryRecord | None:
        """A step's table was read: the steps a newer checkpoint holds are let go, and a
        replica the step repaired (``drop``) is returned for the loop to record."""
        self.rollback.settled(table)
        if not table.repaired.any():
            return None
        devices = step_of(pending).devices
        ids = tuple(devices[i].id for i in np.flatnonzero(table.repaired))
        return RecoveryRecord(
            table.step,
            "diverged",
            "repaired",
            ids,
            batch=self.rows.batch(pending.item),
            detail="copied from a majority replica inside the step (on_failure='drop')",
        )

    def failed(self, pending: Pending, error: TrainingWorkerError) -> TrainingWorkerError | Resume:
        """Acts on the failure of ``pending`` (``error``): the :class:`Resume` to go on
        with, or the error to raise."""
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
            return self._fresh(self.rollback.spike(pending, error))
        found = self._verdict(pending, error)
        error = error.with_diagnosis(found)
        if found.verdict == "transient":
            return self._retry(pending, error)
        if found.verdict == "data":
            return self._quarantine(pending, error, found)
        if found.verdict == "device":
            return self._exclude(pending, error, found)
        return error.with_note(f"not recovered: the replay's verdict is {found.verdict!r}")

    def resumed(self, resume: Resume, number: int) -> None:
        """The loop went on from step ``number``: the steps kept from it on will run
        again (kept anew)."""
        self.rollback.resumed(number)

    def on_recovery(self, record: RecoveryRecord) -> None:
        """The loop recorded a recovery of this fit call (the budget counts it)."""
        self.records.append(record)

    def report(
        self, error: TrainingWorkerError, first: Cursor | None = None
    ) -> TrainingWorkerError:
        """``error`` (about to leave fit) with the recoveries made before it listed, and
        for a hang that no launcher restarts, why the process does not exit."""
        if is_hang(error) and not under_restarting_launcher():
            error = not_restarted(error)
        if not self.records:
            return error
        lines = [
            f"fit recovered {len(self.records)} failure(s) before this one "
            f"(max_recoveries={self.options.max_recoveries}):"
        ]
        lines += [f"  {record}" for record in self.records]
        return error.with_note("\n".join(lines))

    def on_failure(self, error: TrainingWorkerError) -> None:
        """The failure leaving fit, reported (its emergency save written). When it is a
        device an exclusion could not leave out, since a process would keep none of its
        devices (with ``replicas``, a host's group), the job can only go on restarted:
        under a launcher that restarts it the process exits for it, as after a hang
        (:func:`exit_for_restart`), and the restarted job resumes from the latest
        verified checkpoint. Elsewhere the error is raised, its note saying so."""
        if self.restart is not None and under_restarting_launcher():
            exit_for_restart(error.with_note(self.restart) if self.restart else error)

    def hung(self, error: TrainingWorkerError) -> None:
        """A hang or a lost peer, reported: nothing of this process can go on, so under a
        launcher that restarts the job it exits for the launcher to restart it from the
        last verified checkpoint (:func:`exit_for_restart`). Elsewhere (a notebook, a
        plain script) exiting would lose what the process holds: the loop raises
        ``error``, whose note says so (:meth:`report`)."""
        if under_restarting_launcher():
            exit_for_restart(error)

    def finish(self, state: TrainState, first: Cursor | None) -> None:
        """At the end of fit: the recoveries made, logged (at WARNING level unless a
        callback showed them)."""
        text = History(recoveries=self.records).recovery_summary()
        if text:
            log.log(logging.INFO if self.shown else logging.WARNING, "%s", text)

    # -- the verdicts --------------------------------------------------------------

    def _verdict(self, pending: Pending, error: TrainingWorkerError) -> Diagnosis:
        runtime = runtime_of(step_of(pending))
        batch = pending.batch
        if self.presplit and item_of(pending).first is None:
            batch = runtime.join(batch)  # the replay takes the global batch
        return self.diagnose(runtime, error, batch, step_timeout=self.step_timeout)

    def _retry(self, pending: Pending, error: TrainingWorkerError) -> TrainingWorkerError | Resume:
        item = item_of(pending)
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
            ids_of(error),
            batch=self.rows.batch(item),
            detail="the same batch again from the last good state",
        )
        return Resume(state_of(error), [item], record)

    def _quarantine(
        self, pending: Pending, error: TrainingWorkerError, found: Diagnosis
    ) -> TrainingWorkerError | Resume:
        item = item_of(pending)
        if not self.options.quarantine:
            return error.with_note("not recovered: Recover(quarantine=False)")
        if item.drop:
            return error.with_note(
                "not recovered: the step failed again with the failing chunks left out"
            )
        devices = found.devices or ids_of(error)
        sources = self.rows.sources(item, found.examples)
        step = step_of(pending)
        ids = self.rows.ids(item, found.examples, step.devices)  # Recover(example_id=...)
        # Every device failed: a collective in the model (cross-device BatchNorm)
        # carried the bad rows into every chunk, so the rerun leaving the failing
        # chunks out of the mean is skipped whole (state.step counts it): say so.
        spread = len(ids_of(error)) >= len(step.devices)
        skipped: tuple[int, ...] = ()
        if spread:
            skipped, lost = in_words(self.rows.spans(item))
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
            batch=self.rows.batch(item),
            detail=detail,
            example_ids=ids,
        )
        store = self.checkpoints.store
        if store is not None:
            of_batch = [b for b, _ in self.rows.where(item, found.examples)]
            for batch, rows in sources.items():  # process 0 writes it
                append_quarantine(
                    store.directory,
                    step=error.step,
                    batch=batch,
                    examples=rows,
                    batch_size=self.rows.size(item),
                    device_ids=devices,
                    fit_start=self.fit_start,
                    example_id=self.options.example_id,
                    ids=[i for i, b in zip(ids, of_batch, strict=False) if b == batch],
                )
        return Resume(state_of(error), [item._replace(drop=True)], record)

    def _exclude(
        self, pending: Pending, error: TrainingWorkerError, found: Diagnosis
    ) -> TrainingWorkerError | Resume:
        if not self.options.exclude_devices:
            return error.with_note("not recovered: Recover(exclude_devices=False)")
        # the devices the replay blamed: not those a collective in the model infected
        ids = found.devices or ids_of(error)
        step = step_of(pending)
        if len(ids) >= len(step.devices):
            return error.with_note("not recovered: every device failed")
        many = processes.spans_processes(step.devices)
        try:  # a new step: the one the failing step ran on stays as it is
            smaller, state = step.without_devices(ids, state_of(error))
        except ValueError as err:  # a process would keep none of its devices
            if many:  # every process took this verdict: they restart together
                self.restart = self._restart_point()
            return error.with_note(f"not recovered: {err}")
        detail = f"training goes on on the other {len(smaller.devices)} device(s)"
        if step.options.model_parallel > 1:  # a model group goes whole
            left = {d.id for d in smaller.options.mesh_devices}  # (replicas: groups whole)
            gone = ", ".join(str(d.id) for d in step.options.mesh_devices if d.id not in left)
            detail = (
                f"model group(s) of devices {gone} excluded; training goes on on the other "
                f"{len(smaller.devices)} model group(s)"
            )
        if many:  # a process's rows may go to another's devices
            detail += (
                "; each batch's rows, every process's, are re-split over them (the rows "
                "that do not divide are carried into the next step)"
            )
        item = item_of(pending)
        record = RecoveryRecord(
            error.step, "device", "excluded", ids, batch=self.rows.batch(item), detail=detail
        )
        return Resume(state, [item], record, smaller)

    def _restart_point(self) -> str:
        """Where a restarted job resumes, in words ("": without a checkpoint directory
        it starts over, as :func:`exit_for_restart` says). Every process asks alike."""
        store = self.checkpoints.store
        if store is None:
            return ""
        latest = self.checkpoints.latest_verified()
        if latest is None:
            return f"no verified checkpoint in {str(store.directory)!r} yet"
        return (
            f"the latest verified checkpoint is step {latest} "
            f"({store.directory / str(latest)}): the restarted job resumes from it"
        )

    def _diverged(
        self, pending: Pending, error: TrainingWorkerError
    ) -> TrainingWorkerError | Resume:
        back = self._fresh(self.rollback.diverged(pending, error))
        if isinstance(back, Resume):
            return back
        runtime = runtime_of(step_of(pending))
        if not error.state_is_good or majority_position(runtime, error.failures) is None:
            return back
        record = RecoveryRecord(
            error.step,
            "diverged",
            "repaired",
            ids_of(error),
            batch=self.rows.batch(item_of(pending)),
            detail="the state rebuilt from a replica that agrees with the majority, "
            "the step run again",
        )
        return Resume(state_of(error), [item_of(pending)], record)

    # -- shared --------------------------------------------------------------------

    def _fresh(self, outcome: TrainingWorkerError | Resume) -> TrainingWorkerError | Resume:
        """A rollback's outcome: each batch trained again is a fresh attempt, its
        retries counted from zero again (the budget, ``max_recoveries``, still bounds
        them all)."""
        if isinstance(outcome, Resume):
            for item in outcome.items:
                self.retried.pop(item.seq, None)
        return outcome
