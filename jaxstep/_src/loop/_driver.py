"""One fit call's state and its steps by name: :meth:`Loop.start`, :meth:`Loop.advance`
(dispatch a batch, then settle the step before it, already finished),
:meth:`Loop.settle` (read a step's health table), :meth:`Loop.drain`,
:meth:`Loop.abandon` (an exception leaves: the state and the untrained batches go on
it; the ways out are the loop's :class:`~jaxstep._src.loop._exits.Exits`) and
:meth:`Loop.finish`. What is there only when asked for (checkpoints, the watchdog,
recovery, the callbacks, the replay, the prefetch) are the loop's actions
(:mod:`jaxstep._src.loop._actions`), each with the hooks it needs; the loop alone
writes the :class:`History` and holds the step the run trains on (a value it swaps
with the state when a recovery left a device out, and hands to what uses it).
Settling a step returns what the loop does next (:class:`Settled`); a recovery's
decision is a value (:class:`Resume`); exceptions are only the ways out of fit."""

from __future__ import annotations

import itertools
import time
from typing import Any
from typing import NoReturn

from jaxstep._src.core import COL
from jaxstep._src.core import HealthTable
from jaxstep._src.core import Status
from jaxstep._src.core import StepOutput
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.core import processes
from jaxstep._src.loop._actions import actions
from jaxstep._src.loop._carry import Carry
from jaxstep._src.loop._carry import end_position
from jaxstep._src.loop._carry import placed_in_data
from jaxstep._src.loop._checkpoints import FitCheckpoints
from jaxstep._src.loop._exits import Exits
from jaxstep._src.loop._failure import failure_error
from jaxstep._src.loop._flight import InFlight
from jaxstep._src.loop._history import History
from jaxstep._src.loop._ledger import open_record
from jaxstep._src.loop._options import FitOptions
from jaxstep._src.loop._options import limit
from jaxstep._src.loop._outcome import Resume
from jaxstep._src.loop._outcome import Settled
from jaxstep._src.loop._peers import Peers
from jaxstep._src.loop._pending import Item
from jaxstep._src.loop._pending import Pending
from jaxstep._src.loop._pending import Placed
from jaxstep._src.loop._recorder import Recorder
from jaxstep._src.loop._records import Recovery
from jaxstep._src.loop._resplit import Resplit
from jaxstep._src.loop._resplit import Whole
from jaxstep._src.loop._resplit import after_leaving
from jaxstep._src.loop._resplit import carry_for
from jaxstep._src.step import TrainStep
from jaxstep._src.step import adopt
from jaxstep._src.step import runtime_of

_FAILED, _HALTED = COL["failed"], COL["halted"]  # step-wide columns of the raw table


class Loop:
    """What one :func:`jaxstep.fit` call holds between its steps: the newest state, the
    step it trains on (:attr:`step`, swapped with the state), the batches in flight
    (:class:`~jaxstep._src.loop._flight.InFlight`), the rows carried once a device
    left, the history's recorder and the actions (``options``: the fit call's, or
    ``keywords`` of :class:`FitOptions`).

    ``state`` is always the newest state dispatched (or the one fit started from):
    a batch that is rejected or an exception that leaves fit does not change it. Once
    a step failed it is the error's last good state, which took over the halted
    state's buffers (:func:`~jaxstep._src.loop._failure.failure_error`). Its step
    number, ``state.step``, is the one step counter (:attr:`number`).
    """

    def __init__(
        self,
        step: TrainStep,
        state: TrainState,
        checkpoints: FitCheckpoints,
        options: FitOptions | None = None,
        *,
        began: float | None = None,
        **keywords: Any,
    ):
        options = FitOptions(**keywords) if options is None else options
        history = History() if options.history is None else options.history
        #: where the call's time goes (``history.goodput()``); ``began``: when fit was
        #: called (the restore and the checks before the loop are its startup)
        self.ledger = ledger = history.ledger
        ledger.begin(time.perf_counter() if began is None else began)
        open_record(ledger, checkpoints)
        #: the next dispatch is the call's first (its compiling ends the startup)
        self.compiling = True
        #: the step fit was given: moved onto the run's step when a device leaves
        #: (``step.devices`` shrinks, as documented); the loop never reads it
        self.given = step
        #: the step the run trains on, and its runtime (set together: :meth:`_swap`)
        self.step = step
        self.runtime = runtime = runtime_of(step)
        self.state = state
        self.source = checkpoints.source
        self.options = options
        self.presplit = options.presplit
        self.record = Recorder(history)
        source = checkpoints.source
        origin = runtime.origin or runtime.devices  # the devices batches are laid out for
        #: every process reads each batch whole (``global_batches``, several processes)
        self.whole = None
        if options.global_batches and processes.spans_processes(origin):
            self.whole = Whole(origin, options.presplit)
        self.carry: Carry | Resplit | None = carry_for(
            runtime,
            source.start,
            source.resumed,
            options.presplit,
            source.carrying,
            ready=self._ready,
            everyone=self.whole is not None,
        )
        self.actions = actions(
            runtime,
            options,
            checkpoints,
            carried=self.carry is not None,
            ledger=ledger,
            cut=None if self.whole is None else self.whole.local,
        )
        self.flight = InFlight()
        self.peers = Peers()  # how it waits on devices shared with other processes
        self.exits = Exits(self.flight, self.actions, self.peers, self.record)
        self.last: StepOutput | None = None  # the newest dispatched step
        #: the batches this call may train (num_steps, until_step), None: all
        self.limit = limit(options, checkpoints.first)
        self.waited = 0.0  # seconds waited for data since the last dispatch
        self.interrupted = False  # a first Ctrl-C: stop after the step in flight
        self.pulled = 0  # batches pulled from the source (advance's calls)
        #: the call's count of batches ran out before the data did
        self.cut_short = False

    @property
    def number(self) -> int:
        """The number of the next step dispatched: ``state.step`` (the runtime's count
        of the state it returned last, kept equal to it: no device read in a run)."""
        return self.runtime.step_number(self.state)

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
        runtime = self.runtime
        if bool(runtime.read_first(self.state.halted)):  # (the step number is known)
            raise ValueError(
                "the state is halted by an earlier failure; resume from error.state (or "
                "step.clear_halt(state)) once the cause is fixed"
            )
        origin = runtime.origin  # the devices it was built with, before some left
        self.record.start(
            [d.id for d in runtime.devices], None if origin is None else [d.id for d in origin]
        )
        runtime.heartbeats.clear()
        self.actions.on_fit_start(self.step, self.history)
        self.record.since = time.perf_counter()  # the first step's rate includes compiling
        self.peers.start(runtime.devices)

    def train(self) -> None:
        """Advances on each batch of the data, in order, up to ``num_steps``: handed over
        by the feeder (pulled here in turn, or by the prefetch thread ahead), the wait
        for each timed (``History.data_wait``)."""
        count = self.limit
        while True:
            before = self.pulled
            batches = itertools.islice(self.source, count)
            for batch, placed, wait in self.actions.feeder.feed(batches, lambda: self.interrupted):
                self.advance(batch, placed, wait)
            self.cut_short = count is not None and self.pulled - before >= count
            count = self._short() if self.cut_short else 0
            if not count:
                return

    def _short(self) -> int:
        """The batches still to pull once the call's count ran out: ``until_step``
        counts steps, and while rows are carried a batch may train none (its rows, fewer
        than a step needs, carried on: a resume inside a batch), so the steps short of
        it (within ``num_steps``, which counts batches)."""
        options = self.options
        if options.until_step is None or self.carry is None:
            return 0
        short = options.until_step - self.number
        if options.num_steps is not None:
            short = min(short, options.num_steps - self.pulled)
        return max(short, 0)

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
        self.ledger.data += wait
        item = Item(batch, self.pulled, placed=placed)
        self.flight.queue.append(item)
        self.pulled += 1
        if self.whole is None:  # (a whole batch is heard as this process's rows: _advance)
            for pulled in self.actions.pulled:
                pulled(batch)
        self._run_queue()

    def _run_queue(self) -> None:
        queue = self.flight.queue
        while queue:  # a recovery queues what it trains again at the front
            self._advance(queue.popleft())

    def _advance(self, item: Item) -> None:
        """:meth:`advance` for one queued batch."""
        actions, flight = self.actions, self.flight
        flight.in_hand = item  # a take that raises leaves it untouched: handed back
        if self.whole is not None and item.shared is None:
            cut = self._cut(item)
            if cut is None:  # refused, the step before it failed and was recovered
                return
            item = cut
        if self.carry is not None:
            taken = self._take(self.carry, item)
            if taken is None:  # all carried on, or a recovery queued it again
                flight.in_hand = None
                return
            queue, pulled = self.flight.queue, self.pulled
            item = placed_in_data(taken, self.carry.left(), queue, pulled, self.source.hold)
            flight.in_hand = item
        presplit = self.presplit and item.first is None  # carried rows come joined
        number = self.number
        check = False
        for before in actions.before:  # a checkpoint step: check replicas
            check = before(self.state, item, number) or check
        try:
            self.state, out = actions.runner.run(
                self.runtime, self.state, item, number, check, presplit
            )
            self.last = out
            if self.compiling:
                self._compiled()
        except (ValueError, TypeError) as err:
            if self._refused(err, item) is Settled.RECOVERED:
                return  # the step before it failed and was recovered: it is queued again
            raise
        except TrainingWorkerError as err:  # a hung step
            flight.in_hand = None
            raise self._hung(err, [item]) from None
        flight.in_hand = None
        if item.placed is not None:  # what stays behind holds no device copy of a batch
            item = item._replace(placed=None)
        wait, self.waited = self.waited, 0.0
        rows = self.runtime.rows_per_device
        new = Pending(out, item.batch, number, rows, item, wait, self.step)
        for dispatched in actions.dispatched:
            dispatched(new)
        previous = flight.dispatched(new)
        if previous is not None and self.settle(previous, item) is Settled.RECOVERED:
            return
        if actions.runner.settles_at_once:  # the watchdog: the step has finished
            flight.pending = None
            if self.settle(new) is Settled.RECOVERED:
                return
        if self.interrupted:  # a first Ctrl-C, deferred to here: nothing is half done
            raise KeyboardInterrupt("fit stopped by Ctrl-C after the step in flight")

    def _compiled(self) -> None:
        """The fit call's first dispatch returned (it compiled): its startup ends."""
        self.ledger.mark("startup", time.perf_counter())
        self.compiling = False

    # -- the ways out (the loop's Exits, handed what changes during the run) ----------

    def abandon(self, err: BaseException) -> None:
        """An exception (``err``) leaves fit: :meth:`Exits.abandon` (``err.state``,
        ``err.batches``, the save; the actions closed)."""
        try:
            self.exits.abandon(err, self.runtime, self.state, self.last, self.carry, self.pulled)
        finally:
            self.ledger.close(time.perf_counter())
            # a step's failure leaves fit on every process alike (the table is global):
            # one report there too; a hang or a lost peer is not waited for
            alike = isinstance(err, TrainingWorkerError) and not err.status & Status.HUNG
            if alike and processes.spans_processes(self.runtime.devices):
                self.ledger.agree(self.runtime.devices, timeout_s=10.0)

    def _lost(self, err: Exception, number: int, untrained: list[Any]) -> NoReturn:
        """:meth:`Exits.lost`: ``err`` raised while waiting for step ``number``."""
        self.exits.lost(err, number, self.runtime, untrained, self.carry, self.pulled)

    def _report(self, error: TrainingWorkerError, untrained: list[Any]) -> TrainingWorkerError:
        """:meth:`Exits.report`: a failure leaves fit with ``untrained``."""
        return self.exits.report(error, untrained, self.carry, self.pulled)

    def _hung(self, error: TrainingWorkerError, untrained: list[Any]) -> TrainingWorkerError:
        """:meth:`Exits.hung`: a hang or a lost peer leaves fit with ``untrained``."""
        return self.exits.hung(error, untrained, self.carry, self.pulled)

    def _cut(self, item: Item) -> Item | None:
        """A whole batch every process read (``global_batches``) as this process's rows
        with the batch beside them (:class:`Whole`), heard by the actions as pulled;
        refused as at its dispatch when it does not divide (None: the step before it
        failed and was recovered, ``item`` queued again)."""
        assert self.whole is not None
        try:
            item = self.whole.item(item.batch, item.seq, item.placed)
            self.flight.in_hand = item  # handed back as given (Shared.as_given)
            for pulled in self.actions.pulled:
                pulled(item.batch)
        except (ValueError, TypeError) as err:
            if self._refused(err, item) is Settled.RECOVERED:
                self.flight.in_hand = None
                return None
            raise
        return item

    def _take(self, carry: Carry | Resplit, item: Item) -> Item | None:
        """``carry.take(item)``; on several processes its rows travel through the
        devices (a collective, :mod:`jaxstep._src.loop._resplit`), watched as a step is.
        None: nothing to dispatch now (fewer rows than devices at hand, or the step
        before it failed and a recovery queued it again)."""
        try:
            return carry.take(item)
        except (ValueError, TypeError) as err:  # a batch refused: as at its dispatch
            if self._refused(err, item) is Settled.RECOVERED:
                return None
            raise
        except Exception as err:
            self._lost(err, self.number, [self.flight.pending, item])

    def _refused(self, err: ValueError | TypeError, item: Item) -> Settled:
        """``item`` was refused before it ran (``err``): a failure of the step before it
        comes first (recovered: ``item`` is queued again and ``err`` dropped), and the
        error holds the state before it (``err.state``)."""
        pending, self.flight.pending = self.flight.pending, None
        if pending is not None and self.settle(pending, item) is Settled.RECOVERED:
            return Settled.RECOVERED
        err.state = self.state  # type: ignore[union-attr]
        return Settled.GO_ON

    def _ready(self, array: Any) -> None:
        """Waits for ``array``, of the step about to run (:meth:`Peers.ready`)."""
        self.peers.ready(array, self.number, self.runtime.devices)

    def settle(self, pending: Pending, after: Item | None = None) -> Settled:
        """Reads ``pending``'s health table and appends it to the history; the actions
        see it. ``after``: the batch pulled after it, which its failure must hand back
        untrained. Under ``recover`` a failure may be recovered instead: then the loop
        is reset and :attr:`Settled.RECOVERED` returned (the caller goes on with the
        queue).

        Raises:
          TrainingWorkerError: the step failed (``error.state``: the last good state,
            from :attr:`state`), or a peer process was lost while waiting for it.
        """
        runtime = self.runtime
        try:  # never blocks where a lost peer would leave this process stuck
            self.peers.ready(pending.out.health, pending.number, runtime.devices)
            raw = runtime.raw_table(pending.out)
        except Exception as err:
            self._lost(err, pending.number, [pending, after])
        self.record.settled(pending, raw)
        self.flight.reading = pending  # recorded; until its settling completes
        actions = self.actions
        table = None
        if actions.tables:  # an action or a callback takes the decoded table
            table = HealthTable.from_array(raw)
            for read in actions.read:
                read(table)
            for step_end in actions.on_step_end:
                step_end(table)
            for settled in actions.settled:
                made = settled(pending, table)
                if made is not None:  # a replica the step repaired itself
                    self._recovered(made)
        if raw.item(0, _FAILED) and raw.item(0, _HALTED):
            return self._failed(pending, after, table or HealthTable.from_array(raw))
        self.flight.confirmed(pending)
        return Settled.GO_ON

    def _failed(self, pending: Pending, after: Item | None, table: HealthTable) -> Settled:
        """``pending`` failed: recovered (the loop reset to go on with the recovery's
        ``Resume``) or raised (fit stops)."""
        ledger = self.ledger
        ledger.failed.add(len(self.history) - 1)  # settled just now: its update lost
        attribute = ledger.timed("diagnosis", failure_error)  # who failed, and the state
        error = attribute(self.runtime, table, pending.rows, self.state, self.history)
        assert error.state is not None
        self.state = error.state  # the halted state was donated to it
        try:
            outcome = self.actions.failed(pending, error)
        except TrainingWorkerError as hang:  # a replay of the failure hung, or a peer left
            hang = hang.with_note(f"while diagnosing: {str(error).splitlines()[0]}")
            raise self._hung(hang, [pending, after]) from None
        if isinstance(outcome, Resume):
            self._resume(pending, outcome)
            return Settled.RECOVERED
        # Nothing pulled is lost: the failing batch and those after it, untrained.
        raise self._report(outcome, [pending, after])

    def _resume(self, pending: Pending, resume: Resume) -> None:
        """Goes on from a recovery of ``pending``'s failure: ``resume.items`` first, then
        the batches in flight after ``pending``, then the rows carried, from
        ``resume.state``; a device left: on ``resume.step`` (:meth:`_swap`). Records the
        recovery."""
        if resume.step is not None:  # a device left the run
            self._swap(resume.step)
            self.ledger.compiles_to = "recovery"  # compiling the smaller step
        carried = [] if self.carry is None else self.carry.release()
        self.flight.restart(resume.items, pending.number, carried)
        self.state = resume.state
        self.record.now_on([d.id for d in self.runtime.devices])
        self.actions.resumed(resume, self.number)
        self._recovered(resume.record)
        self.ledger.mark("recovery", time.perf_counter())  # since the failing step settled

    def _swap(self, step: TrainStep) -> None:
        """The run trains on ``step`` from now on (a step on fewer devices): the loop
        holds it, hands it to each action with the values it passes (the runner's
        ``run``, a failed step's :class:`Pending`), and carries the rows that no longer
        divide; the step fit was given is moved onto it (:func:`adopt`)."""
        before = self.runtime.devices
        self.step, self.runtime = step, runtime_of(step)
        adopt(self.given, step)  # step.devices as documented
        self.carry = after_leaving(
            self.carry,
            before,
            self.runtime,
            start=self.source.start,
            presplit=self.presplit,
            ready=self._ready,
            everyone=self.whole is not None,
        )

    def _recovered(self, record: Recovery) -> None:
        """A recovery made: recorded (and logged), then heard by the actions (the
        callbacks' ``on_recovery``)."""
        self.record.recovery(record, shown=self.actions.shows_recoveries)
        self.actions.on_recovery(record)

    def drain(self) -> None:
        """Settles the step still in flight, if any (after the last batch), and, when
        that recovers a failure, trains the batches it queued again."""
        flight = self.flight
        while True:
            pending, flight.pending = flight.pending, None
            if pending is None:
                return
            if self.settle(pending) is Settled.RECOVERED:
                self._run_queue()

    def finish(self) -> TrainState:
        """After the last step settled: lists the rows still carried, lets the actions
        finish (the final state saved with checkpoints on, the recoveries made), waits
        for the writes, calls the callbacks' ``on_fit_end`` and returns the final
        state."""
        carried = [] if self.carry is None else self.carry.left()
        first = end_position(carried, self.cut_short, self.pulled)
        if self.carry is not None:
            self.record.left_over(self.carry.finish(self.cut_short))
        self.actions.finish(self.state, first)
        self.actions.close()
        self.ledger.close(time.perf_counter())  # before on_fit_end: the writers report it
        if processes.spans_processes(self.runtime.devices):  # one report on every process
            self.ledger.agree(self.runtime.devices)
        self.actions.on_fit_end(self.history)
        return self.state
