"""One fit call's state and its steps by name: :meth:`Loop.start`, :meth:`Loop.advance`
(dispatch a batch, then settle the step before it, already finished),
:meth:`Loop.settle` (read a step's health table), :meth:`Loop.drain`,
:meth:`Loop.abandon` (an exception leaves: the state and the untrained batches go on
it, :mod:`jaxstep.loop._stopping`) and :meth:`Loop.finish`. What is there only when
asked for (checkpoints, the watchdog, recovery, the carry, the callbacks, the replay)
are the loop's actions (:mod:`jaxstep.loop._actions`), each with the hooks it needs."""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Sequence
from typing import Any
from typing import NoReturn

import numpy as np

from jaxstep import distributed
from jaxstep.checkpoint import FitCheckpoints
from jaxstep.core import COL
from jaxstep.core import HealthTable
from jaxstep.core import StepOutput
from jaxstep.core import TrainingWorkerError
from jaxstep.core import TrainState
from jaxstep.core import validate
from jaxstep.loop._actions import Actions
from jaxstep.loop._actions import actions
from jaxstep.loop._failure import failure_error
from jaxstep.loop._history import History
from jaxstep.loop._options import FitOptions
from jaxstep.loop._outcome import Resume
from jaxstep.loop._pending import Item
from jaxstep.loop._pending import Pending
from jaxstep.loop._pending import Placed
from jaxstep.loop._pending import Recovered
from jaxstep.loop._recorder import Recorder
from jaxstep.loop._stopping import attach
from jaxstep.loop._stopping import untrained_batches
from jaxstep.step import TrainStep
from jaxstep.step import driving

_FAILED, _HALTED = COL["failed"], COL["halted"]  # step-wide columns of the raw table


class Loop:
    """What one :func:`jaxstep.fit` call holds between its steps: the newest state,
    the step in flight (:class:`Pending`, at most one), the batches on their way, the
    history's recorder and the actions (``options``: the fit call's, or ``keywords``
    of :class:`FitOptions`).

    ``state`` is always the newest state dispatched (or the one fit started from):
    a batch that is rejected or an exception that leaves fit does not change it.
    """

    __slots__ = (
        "actions",
        "held",
        "interrupted",
        "last",
        "number",
        "options",
        "pending",
        "presplit",
        "pulled",
        "queue",
        "reading",
        "record",
        "source",
        "state",
        "step",
        "unconfirmed",
        "waited",
        "watch_peers",
    )

    def __init__(
        self,
        step: TrainStep,
        state: TrainState,
        checkpoints: FitCheckpoints,
        options: FitOptions | None = None,
        **keywords: Any,
    ):
        options = FitOptions(**keywords) if options is None else options
        history = History() if options.history is None else options.history
        self.step = step
        self.state = state
        self.source = checkpoints.source
        self.options = options
        self.presplit = options.presplit
        self.record = Recorder(history)
        self.actions = Actions(actions(step, options, checkpoints, history), step)
        self.watch_peers = False  # set by start: several processes, peer heartbeats on
        self.pending: Pending | None = None  # dispatched, its table not read yet
        self.last: StepOutput | None = None  # the newest dispatched step
        self.number = checkpoints.number  # the number of the next step dispatched
        self.held: Item | None = None  # a batch pulled and not yet dispatched (or rejected)
        # dispatched steps whose settling has not completed, oldest first, and the one
        # of them recorded already: what an early stop must still account for
        self.unconfirmed: list[Pending] = []
        self.reading: Pending | None = None
        self.waited = 0.0  # seconds waited for data since the last dispatch
        self.interrupted = False  # a first Ctrl-C: stop after the step in flight
        self.queue: collections.deque[Item] = collections.deque()  # to dispatch, in order
        self.pulled = 0  # batches pulled from the source (advance's calls)

    @property
    def history(self) -> History:
        """The history the steps go to."""
        return self.record.history

    def interrupt(self) -> None:
        """A first Ctrl-C: :meth:`advance` stops once the step in flight is dispatched."""
        self.interrupted = True

    def start(self) -> None:
        """Checks that the state is not halted, then starts the run: the history's
        device ids, the callbacks' ``on_fit_start``, the peer heartbeats."""
        step = self.step
        if bool(driving.first_copy(step, self.state.halted)):  # (the step number is known)
            raise ValueError(
                "the state is halted by an earlier failure; resume from error.state (or "
                "step.clear_halt(state)) once the cause is fixed"
            )
        origin = driving.origin(step)  # the devices it was built with, before some left
        self.record.start(
            [d.id for d in step.devices], None if origin is None else [d.id for d in origin]
        )
        driving.heartbeats(step).clear()
        self.actions.on_fit_start(step, self.history)
        self.record.since = time.perf_counter()  # the first step's rate includes compiling
        many = distributed.spans_processes(step.devices)
        self.watch_peers = many and distributed.watch() is not None

    def train(self) -> None:
        """Advances on each batch of the data, in order, up to ``num_steps``: pulled
        here in turn, or taken from those an action pulled ahead (``fit(prefetch=...)``:
        its ``feed``), the wait for each timed (``History.data_wait``)."""
        batches = itertools.islice(self.source, self.options.num_steps)
        for batch, placed, wait in self.actions.feed(batches, lambda: self.interrupted):
            self.advance(batch, placed, wait)

    def advance(self, batch: Any, placed: Placed | None = None, wait: float = 0.0) -> None:
        """Dispatches ``batch``, then settles the step before it (finished by now: the
        host never waits on the step it just dispatched). With the step watchdog the
        step has finished when its dispatch returns: it is settled at once. Under
        ``recover`` a failure that is recovered queues its batches again: they are
        dispatched here, before this call returns. ``placed``: the batch already on
        the devices (prefetched); ``wait``: seconds the loop waited for it.

        Raises:
          ValueError, TypeError: ``batch`` was rejected before it ran (after any failure
            of the step before it); ``error.state`` holds the state before it.
          TrainingWorkerError: a step failed, hung, or lost a peer.
        """
        # queued first: a batch an action refuses (Recover(example_id=...) names no
        # leaf of it) is handed back on the error with the others (err.batches)
        self.waited += wait
        item = (
            Item(batch, self.pulled) if placed is None else Item(batch, self.pulled, placed=placed)
        )
        self.queue.append(item)
        self.pulled += 1
        for pulled in self.actions.pulled:
            pulled(batch)
        self._run_queue()

    def _run_queue(self) -> None:
        while self.queue:
            item = self.queue.popleft()
            try:
                self._advance(item)
            except Recovered:
                continue

    def _advance(self, item: Item) -> None:
        """:meth:`advance` for one queued batch."""
        actions, pending = self.actions, self.pending
        self.held = item  # a take that raises leaves it untouched: handed back
        for take in actions.take:
            taken = take(item)
            if taken is None:  # fewer rows than devices at hand: all carried on
                self.held = None
                return
            item = taken
        self.held = item
        presplit = self.presplit and item.first is None  # carried rows come joined
        check = False
        for before in actions.before:  # a checkpoint step: check replicas
            check = before(self.state, item) or check
        try:
            self.state, out = actions.run(self.state, item, self.number, check, presplit)
            self.last = out
        except (ValueError, TypeError) as err:
            self.pending = None
            if pending is not None:  # a failure of the previous step comes first
                self.settle(pending, item)
            err.state = self.state  # type: ignore[union-attr]
            raise
        except TrainingWorkerError as err:  # a hung step
            self.held = None
            raise self._hung(err, [item]) from None
        self.held = None
        number = self.number
        self.number = number + 1
        rows = driving.rows_per_device(self.step)
        if item.placed is not None:  # what stays behind holds no device copy of a batch
            item = item._replace(placed=None)
        wait, self.waited = self.waited, 0.0
        new = self.pending = Pending(out, item.batch, number, rows, item, wait)
        for dispatched in actions.dispatched:
            dispatched(new)
        self.unconfirmed.append(new)
        if pending is not None:
            self.settle(pending, item)
        if actions.settles_at_once:  # the watchdog: the step has finished
            self.pending = None
            self.settle(new)
        if self.interrupted:  # a first Ctrl-C, deferred to here: nothing is half done
            raise KeyboardInterrupt("fit stopped by Ctrl-C after the step in flight")

    def settle(self, pending: Pending, after: Item | None = None) -> None:
        """Reads ``pending``'s health table and appends it to the history; the actions
        see it. ``after``: the batch pulled after it, which its failure must hand back
        untrained. Under ``recover`` a failure may be recovered instead (:class:`Recovered`
        is raised once the loop is reset).

        Raises:
          TrainingWorkerError: the step failed (``error.state``: the last good state,
            from :attr:`state`), or a peer process was lost while waiting for it.
        """
        step = self.step
        try:
            if self.watch_peers:  # never block where a lost peer would leave this process stuck
                distributed.wait_ready(pending.out.health, pending.number, step.devices)
            raw = driving.raw_table(step, pending.out)
        except TrainingWorkerError as err:  # a lost peer: nothing pulled is lost either
            raise self._hung(err, [pending, after]) from None
        except Exception as err:  # a collective failed: a lost peer is the likely cause
            if not self.watch_peers:
                raise
            lost = distributed.lost_after(err, pending.number, step.devices)
            if isinstance(lost, TrainingWorkerError):
                raise self._hung(lost, [pending, after]) from err
            raise lost from err
        self.record.settled(pending, raw)
        self.reading = pending  # recorded; until its settling completes
        actions = self.actions
        table = None
        if actions.tables:  # an action or a callback takes the decoded table
            table = HealthTable.from_array(raw)
            for read in actions.read:
                read(table)
            for step_end in actions.on_step_end:
                step_end(table)
            for settled in actions.settled:
                settled(pending, table)
        if raw.item(0, _FAILED) and raw.item(0, _HALTED):
            table = HealthTable.from_array(raw) if table is None else table
            error = failure_error(step, table, pending.rows, self.state, self.history)
            try:
                outcome = self.actions.failed(pending, error)
            except TrainingWorkerError as hang:  # a replay of the failure hung, or a peer left
                hang = hang.with_note(f"while diagnosing: {str(error).splitlines()[0]}")
                raise self._hung(hang, [pending, after]) from None
            if isinstance(outcome, Resume):
                self._resume(pending, outcome)
            # Nothing pulled is lost: the failing batch and those after it, untrained.
            raise self._report(outcome, [pending, after])
        self.reading = None
        if self.unconfirmed and self.unconfirmed[0] is pending:
            self.unconfirmed.pop(0)

    def _resume(self, pending: Pending, resume: Resume) -> NoReturn:
        """Goes on from a recovery of ``pending``'s failure: ``resume.items`` first, then
        the batches in flight after ``pending`` (they ran on a halted state: nothing of
        them trained), then the rows an action holds; raises :class:`Recovered`."""
        if resume.carry is not None:  # a device left the run
            self.actions = self.actions.with_carry(resume.carry, self.step)
        later = [p.item for p in self.unconfirmed if p.number > pending.number]
        later += [self.held, *self.actions.held()]  # the carried rows: newer than any
        self.queue.extendleft(reversed([*resume.items, *(i for i in later if i is not None)]))
        self.unconfirmed.clear()
        self.reading = self.pending = self.held = None
        self.state = resume.state
        self.number = int(np.asarray(driving.first_copy(self.step, resume.state.step)))
        self.record.now_on([d.id for d in self.step.devices])
        self.actions.resumed(resume, self.number)
        raise Recovered

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
        is saved first, so ``resume=True`` goes on from it. The actions are closed on
        every path."""
        if self.watch_peers and self.last is not None:
            distributed.finish_in_flight(self.last.health, err)
        if isinstance(err, TrainingWorkerError):
            self.actions.close()
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
                saved = self.actions.stopped(state, len(untrained), first)
            except Exception as why:
                err.add_note(f"jaxstep: saving the state on the way out failed: {why!r}")
        self.actions.close()
        attach(err, state, untrained, failed, saved)

    def _untrained(self, *left: Pending | Item | None) -> tuple[list[Any], tuple[int, int] | None]:
        """The batches of ``left``, of the queue and those the actions hold, untrained,
        in the order they were pulled, and the data position of the first
        (:func:`untrained_batches`); empties the queue and the carry."""
        held = [*left, *self.queue, *self.actions.held(), *self.actions.untaken()]
        batches = untrained_batches(held)
        self.queue.clear()
        return batches

    def _settle_unconfirmed(self) -> tuple[list[Pending], str | None]:
        """Reads the tables of the steps whose settling did not complete (no callbacks:
        one of them may be what raised); returns the steps from the first failed one
        on (untrained: a halted state changed nothing after it) and that failure."""
        untrained: list[Pending] = []
        failed: str | None = None
        for pending in self.unconfirmed:
            raw = driving.raw_table(self.step, pending.out)
            table = HealthTable.from_array(raw)
            if pending is not self.reading:  # not recorded yet
                self.record.add(pending, raw)
                self.reading = pending
                for read in self.actions.read:
                    read(table)
            if failed is None and table.failed and table.halted:
                first = self.step.failures(table, pending.rows)[0]
                failed = f"step {table.step} failed too (device {first.device_id}: {first.reason})"
            if failed is not None:
                untrained.append(pending)
        self.unconfirmed.clear()
        self.pending = None
        return untrained, failed

    def finish(self) -> TrainState:
        """After the last step settled: waits for the last checkpoint write, lets the
        actions finish (rows carried and never trained, the recoveries made), calls the
        callbacks' ``on_fit_end`` and returns the final state."""
        self.actions.close()
        self.actions.finish()
        self.actions.on_fit_end(self.history)
        return self.state

    def _report(
        self, error: TrainingWorkerError, untrained: Sequence[Pending | Item | None]
    ) -> TrainingWorkerError:
        """A failure, a hang or a lost peer: the ``untrained`` batches (failing batch
        first, then those pulled after it and those a recovery queued) go on the error,
        the actions report it (the emergency save) and the callbacks hear of it."""
        batches, first = self._untrained(*untrained)
        error = self.actions.report(error.replace(batches=list(batches)), first)
        self.actions.on_failure(error)
        return error

    def _hung(
        self, error: TrainingWorkerError, batches: Sequence[Pending | Item | None]
    ) -> TrainingWorkerError:
        """A hung step or a lost peer, reported (:meth:`_report`). Nothing of this
        process can go on: under ``recover`` it exits for a restart (``hung``)."""
        error = self._report(error, batches)
        self.actions.hung(error)
        return error
