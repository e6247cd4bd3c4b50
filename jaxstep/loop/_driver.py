"""One fit call's state and its steps by name: :meth:`Loop.start`, :meth:`Loop.advance`
(dispatch a batch, then settle the step before it, already finished),
:meth:`Loop.settle` (read a step's health table), :meth:`Loop.drain`,
:meth:`Loop.abandon` (an exception leaves: the state and the untrained batches go on
it, :mod:`jaxstep.loop._stopping`) and :meth:`Loop.finish`."""

from __future__ import annotations

import collections
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
import numpy as np

from jaxstep import distributed
from jaxstep.core import HealthTable
from jaxstep.core import StepOutput
from jaxstep.core import TrainingWorkerError
from jaxstep.core import TrainState
from jaxstep.core import validate
from jaxstep.loop._callbacks import Callbacks
from jaxstep.loop._carry import Carry
from jaxstep.loop._carry import Cut
from jaxstep.loop._failure import failure_error
from jaxstep.loop._history import History
from jaxstep.loop._history import scalar_aux
from jaxstep.loop._pending import Item
from jaxstep.loop._pending import Pending
from jaxstep.loop._pending import Recovered
from jaxstep.loop._pending import rows_as_given
from jaxstep.loop._recover import Recover
from jaxstep.loop._recover import Recovery
from jaxstep.loop._restart import exit_for_restart
from jaxstep.loop._stopping import attach
from jaxstep.loop._stopping import untrained_batches
from jaxstep.loop._watchdog import StepWatchdog
from jaxstep.step import driving

if TYPE_CHECKING:
    from jaxstep.checkpoint import FitCheckpoints
    from jaxstep.step import TrainStep


class Loop:
    """What one :func:`jaxstep.fit` call holds between its steps: the newest state,
    the step in flight (:class:`Pending`, at most one), the history, the checkpoints,
    the callbacks and, when asked for, the step watchdog.

    ``state`` is always the newest state dispatched (or the one fit started from):
    a batch that is rejected or an exception that leaves fit does not change it.
    """

    __slots__ = (
        "batch_rows",
        "callbacks",
        "carry",
        "checkpoints",
        "columns",
        "device_count",
        "diagnose",
        "held",
        "history",
        "interrupted",
        "last",
        "last_time",
        "next_step",
        "number",
        "pending",
        "presplit",
        "pulled",
        "queue",
        "read",
        "recovery",
        "state",
        "step",
        "unconfirmed",
        "watch_peers",
        "watchdog",
    )

    def __init__(
        self,
        step: TrainStep,
        state: TrainState,
        checkpoints: FitCheckpoints,
        *,
        history: History | None = None,
        callbacks: Callbacks | Sequence[Any] = (),
        diagnose: bool = False,
        step_timeout: float | None = None,
        presplit: bool = False,
        recover: Recover | None = None,
    ):
        self.step = step
        self.state = state
        self.checkpoints = checkpoints
        self.history = History() if history is None else history
        self.callbacks = callbacks if isinstance(callbacks, Callbacks) else Callbacks(callbacks)
        self.diagnose = diagnose
        self.presplit = presplit  # batches come as (n_devices, per_device, ...)
        self.device_count = len(step.devices)
        self.watchdog = None if step_timeout is None else StepWatchdog(step, step_timeout)
        self.watch_peers = False  # set by start: several processes, peer heartbeats on
        self.pending: Pending | None = None  # dispatched, its table not read yet
        self.last: StepOutput | None = None  # the newest dispatched step
        self.number = 0  # the number of the next step dispatched
        self.next_step = 0  # the step after the newest one settled (the watchdog's)
        self.last_time = 0.0  # when the previous step was settled
        self.held: Any = None  # a batch pulled and not yet dispatched (or rejected)
        # dispatched steps whose settling has not completed, oldest first, and the
        # tables already read of them: what an early stop must still account for
        self.unconfirmed: list[Pending] = []
        self.read: dict[int, HealthTable] = {}
        self.interrupted = False  # a first Ctrl-C: stop after the step in flight
        self.queue: collections.deque[Item] = collections.deque()  # to dispatch, in order
        self.pulled = 0  # batches pulled from the source (advance's calls)
        self.recovery = None if recover is None else Recovery(recover, self)
        # rows carried from step to step once a device left the run (or on a resume
        # inside a batch): see loop._carry
        self.carry: Carry | Cut | None = None
        # rows of the data's first batch, every process's together (under recover)
        self.batch_rows: int | None = None
        self.columns: Any = None  # once a device left: its devices' columns in the history
        if checkpoints.source.skip_rows:
            self.carry = Carry(self.unit, checkpoints.source.skip_rows, presplit)

    def start(self) -> None:
        """Checks that the state is not halted, then starts the run: the history's
        device ids, the callbacks' ``on_fit_start``, the peer heartbeats."""
        step = self.step
        halted, number = driving.first_copy(step, (self.state.halted, self.state.step))  # two reads
        if bool(halted):
            raise ValueError(
                "the state is halted by an earlier failure; resume from error.state (or "
                "step.clear_halt(state)) once the cause is fixed"
            )
        self._columns()
        self.number = self.next_step = int(number)
        driving.heartbeats(step).clear()
        self.callbacks.on_fit_start(step, self.history)
        self.last_time = time.perf_counter()
        many = distributed.spans_processes(step.devices)
        self.watch_peers = many and distributed.watch() is not None

    def _columns(self) -> None:
        """The history's device ids, and, for a step that lost devices in an earlier fit
        call, the columns its devices fill and the rows of batches laid out for the
        devices it was built with (carried, or cut on several processes)."""
        step, history = self.step, self.history
        ids = [d.id for d in step.devices]
        origin = driving.origin(step)
        if history.device_ids and set(ids) < set(history.device_ids):
            pass  # a history shared with the fit calls before: its columns stay
        else:
            history.device_ids = ids if origin is None else [d.id for d in origin]
        if history.device_ids != ids:
            where = {d: i for i, d in enumerate(history.device_ids)}
            self.columns = np.asarray([where[d] for d in ids])
        if origin is None or self.carry is not None:
            return
        if distributed.spans_processes(origin):
            here = [d.id for d in origin if d.process_index == jax.process_index()]
            start = self.checkpoints.source.start
            self.carry = Cut(here, start, history.left_over, self.presplit)
            self.carry.exclude([d.id for d in origin if d.id not in set(ids)])
        else:
            self.carry = Carry(self.unit, presplit=self.presplit)

    def advance(self, batch: Any) -> None:
        """Dispatches ``batch``, then settles the step before it (finished by now: the
        host never waits on the step it just dispatched). With the step watchdog the
        step has finished when its dispatch returns: it is settled at once. Under
        ``recover`` a failure that is recovered queues its batches again: they are
        dispatched here, before this call returns.

        Raises:
          ValueError, TypeError: ``batch`` was rejected before it ran (after any failure
            of the step before it); ``error.state`` holds the state before it.
          TrainingWorkerError: a step failed, hung, or lost a peer.
        """
        if self.batch_rows is None and self.recovery is not None:
            rows = rows_as_given(batch, self.presplit)  # this process's rows: its devices' chunks
            if rows is not None:
                mine = len(distributed.local_positions(self.step.devices))
                self.batch_rows = rows * len(self.step.devices) // max(mine, 1)
        self.queue.append(Item(batch, self.pulled))
        self.pulled += 1
        self._run_queue()

    def _run_queue(self) -> None:
        while self.queue:
            item = self.queue.popleft()
            try:
                self._advance(item)
            except Recovered:
                continue

    @property
    def unit(self) -> int:
        """The rows a step's batch must divide by: devices x micro-batches."""
        return len(self.step.devices) * (self.step.options.microbatches or 1)

    def _advance(self, item: Item) -> None:
        """:meth:`advance` for one queued batch."""
        watchdog, pending = self.watchdog, self.pending
        if self.carry is not None:
            taken = self.carry.take(item)
            if taken is None:  # fewer rows than devices at hand: all carried on
                return
            item = taken
        self.held = item
        batch = item.batch
        presplit = self.presplit and item.first is None  # carried rows come joined
        # a checkpoint step: check replicas
        first = item.seq if item.first is None else item.first
        check = self.checkpoints.before(self.state, first, item.offset)
        try:
            if watchdog is not None:  # item.drop: a quarantine's rerun, watched alike
                self.state, out = watchdog.run(
                    self.state, batch, self.next_step, check, presplit=presplit, drop=item.drop
                )
            elif item.drop:  # a data recovery: the failing chunks left out of the mean
                self.state, out = driving.rerun_dropping(
                    self.step, self.state, batch, presplit=presplit
                )
            else:
                self.state, out = driving.dispatch(
                    self.step, self.state, batch, check_replicas=check, presplit=presplit
                )
            self.last = out
        except (ValueError, TypeError) as err:
            self.pending = None
            if pending is not None:  # a failure of the previous step comes first
                self.settle(pending, [item])
            err.state = self.state  # type: ignore[union-attr]
            raise
        except TrainingWorkerError as err:  # a hung step
            self.held = None
            raise self._hung(err, [item]) from None
        self.held = None
        number = self.number
        self.number = number + 1
        rows = driving.rows_per_device(self.step)
        new = self.pending = Pending(out, batch, number, rows, item)
        if self.recovery is not None:
            self.recovery.dispatched(new)
        self.unconfirmed.append(new)
        if pending is not None:
            self.settle(pending, [item])
        if watchdog is not None:
            self.pending = None
            self.settle(new)
        if self.interrupted:  # a first Ctrl-C, deferred to here: nothing is half done
            raise KeyboardInterrupt("fit stopped by Ctrl-C after the step in flight")

    def settle(self, pending: Pending, pulled: Sequence[Item] = ()) -> None:
        """Reads ``pending``'s health table and appends it to the history; the
        checkpoints and the callbacks see it. ``pulled``: the batches pulled after it,
        which its failure must hand back untrained. Under ``recover`` a failure may be
        recovered instead (:class:`Recovered` is raised once the loop is reset).

        Raises:
          TrainingWorkerError: the step failed (``error.state``: the last good state,
            from :attr:`state`), or a peer process was lost while waiting for it.
        """
        step = self.step
        try:
            if self.watch_peers:  # never block where a lost peer would leave this process stuck
                distributed.wait_ready(pending.out.health, pending.number, step.devices)
            table = step.table(pending.out)
        except TrainingWorkerError as err:  # a lost peer: nothing pulled is lost either
            raise self._hung(err, [pending, *pulled]) from None
        except Exception as err:  # a collective failed: a lost peer is the likely cause
            if not self.watch_peers:
                raise
            lost = distributed.lost_after(err, pending.number, step.devices)
            if isinstance(lost, TrainingWorkerError):
                raise self._hung(lost, [pending, *pulled]) from err
            raise lost from err
        now = time.perf_counter()
        examples = self.device_count * pending.rows / max(now - self.last_time, 1e-9)
        self._record(pending, table, examples)
        self.last_time = now
        self.next_step = table.step + 1
        self.callbacks.on_step_end(table)
        if self.recovery is not None:
            self.recovery.settled(pending, table)
        if table.failed and table.halted:
            error = failure_error(step, table, pending.rows, self.state, self.history)
            if self.recovery is not None:  # raises Recovered, or says why it did not
                error = self.recovery.attempt(pending, table, error)
            if self.diagnose and error.diagnosis is None:
                from jaxstep.loop._diagnose import diagnose as replay

                error = error.with_diagnosis(replay(step, error, pending.batch))
            # Nothing pulled is lost: the failing batch and those after it, untrained.
            raise self._report(error, [pending, *pulled])
        self.read.pop(pending.number, None)
        if self.unconfirmed and self.unconfirmed[0] is pending:
            self.unconfirmed.pop(0)

    def drain(self) -> None:
        """Settles the step still in flight, if any (after the last batch), and, when
        that recovers a failure, trains the batches it queued again."""
        while True:
            pending, self.pending = self.pending, None
            if pending is None:
                return
            try:
                self.settle(pending)
            except Recovered:
                self._run_queue()

    def abandon(self, err: BaseException) -> None:
        """An exception (``err``) leaves fit. With peer processes, first lets the newest
        dispatched step finish, so no collective is left half done (a peer still in it
        would abort). A :class:`TrainingWorkerError` already carries what it must;
        anything else (Ctrl-C, a callback's or the data source's exception,
        ``SystemExit``, a rejected batch) gets ``err.state``, the last good state
        (usable: nothing of it donated), and ``err.batches``, every batch pulled and not
        trained, in order, with a note saying so; with a checkpoint directory the state
        is saved first, so ``resume=True`` goes on from it. The checkpoint writer is
        closed on every path."""
        if self.watch_peers and self.last is not None:
            distributed.finish_in_flight(self.last.health, err)
        if isinstance(err, TrainingWorkerError):
            self.checkpoints.close()
            return
        try:
            left, failed = self._settle_unconfirmed()
        except Exception as why:  # the steps in flight cannot be read: say so, lose nothing
            left, failed = list(self.unconfirmed), f"(unread: {why!r})"
        untrained, first = self._untrained(*left, self.held)
        state: TrainState | None = self.state
        try:
            validate.alive(state)
            if failed is not None:
                state = self.step.clear_halt(self.state)
        except ValueError:
            state = None  # a second Ctrl-C inside a dispatch: the state was donated
        saved = None
        if state is not None and self.last is not None:  # something trained: keep it
            try:
                saved = self.checkpoints.stopped(state, len(untrained), first)
            except Exception as why:
                err.add_note(f"jaxstep: saving the state on the way out failed: {why!r}")
        self.checkpoints.close()
        attach(err, state, untrained, failed, saved)

    def _record(
        self, pending: Pending, table: HealthTable, examples_per_sec: float = float("nan")
    ) -> None:
        """A read table into the history and the checkpoints (once per step: kept in
        :attr:`read` until the step's settling completes)."""
        self.read[pending.number] = table
        aux = pending.out.aux
        metrics = {} if aux is None else scalar_aux(aux, self.device_count)
        self.history.append(table, metrics, examples_per_sec, pending.rows, self.columns)
        if self.checkpoints.waiting:
            self.checkpoints.settled(table)

    def _untrained(self, *left: Pending | Item | None) -> tuple[list[Any], tuple[int, int] | None]:
        """The batches of ``left`` and of the queue, untrained, in the order they were
        pulled, and the data position of the first (:func:`untrained_batches`);
        empties the queue and the carry."""
        batches = untrained_batches([*left, *self.queue], self.carry)
        self.queue.clear()
        return batches

    def _settle_unconfirmed(self) -> tuple[list[Pending], str | None]:
        """Reads the tables of the steps whose settling did not complete (no callbacks:
        one of them may be what raised); returns the steps from the first failed one
        on (untrained: a halted state changed nothing after it) and that failure."""
        untrained: list[Pending] = []
        failed: str | None = None
        for pending in self.unconfirmed:
            table = self.read.get(pending.number)
            if table is None:
                table = self.step.table(pending.out)
                self._record(pending, table)
            if failed is None and table.failed and table.halted:
                first = self.step.failures(table, pending.rows)[0]
                failed = f"step {table.step} failed too (device {first.device_id}: {first.reason})"
            if failed is not None:
                untrained.append(pending)
        self.unconfirmed.clear()
        self.pending = None
        return untrained, failed

    def finish(self) -> TrainState:
        """After the last step settled: waits for the last checkpoint write, calls the
        callbacks' ``on_fit_end`` and returns the final state."""
        self.checkpoints.close()
        left = None if self.carry is None else self.carry.left()
        if left is not None:  # fewer rows than devices when the data ended
            spans, rows = left
            start = self.checkpoints.source.start
            self.history.left_over.extend((start + seq, lo, hi) for seq, lo, hi in spans)
            warnings.warn(
                f"{validate.batch(rows, 1)} row(s) carried after a device left the run were "
                f"not trained: the data ended with fewer rows than the {self.unit} a step "
                f"needs; they are listed in history.left_over {self.history.left_over}",
                stacklevel=3,
            )
        if isinstance(self.carry, Cut) and self.carry.cut:
            warnings.warn(
                f"{self.carry.cut} row(s) of this process's batches were not trained: they "
                "were the chunks of devices that left the run, and with several processes "
                "a process cannot hand its rows to another; they are listed in "
                f"history.left_over {self.history.left_over}",
                stacklevel=3,
            )
        if self.recovery is not None:
            self.recovery.summary()
        self.callbacks.on_fit_end(self.history)
        return self.state

    def _report(
        self, error: TrainingWorkerError, untrained: Sequence[Pending | Item]
    ) -> TrainingWorkerError:
        """A failure, a hang or a lost peer: the ``untrained`` batches (failing batch
        first, then those pulled after it and those a recovery queued) and the emergency
        save go on the error, and the callbacks hear of it."""
        batches, first = self._untrained(*untrained)
        error = self.checkpoints.failed(error, batches, first)
        if self.recovery is not None:
            error = self.recovery.noted(error)
        self.callbacks.on_failure(error)
        return error

    def _hung(
        self, error: TrainingWorkerError, batches: Sequence[Pending | Item]
    ) -> TrainingWorkerError:
        """A hung step or a lost peer, reported (:meth:`_report`: the emergency save).
        Nothing of this process can go on; under ``recover`` it exits for its launcher
        to restart the job from the last verified checkpoint (:func:`exit_for_restart`)."""
        error = self._report(error, batches)
        if self.recovery is not None:
            exit_for_restart(error)
        return error
