"""The loop's actions: the parts of one fit call that are there only when asked for (a
run without checkpoints, a watchdog or ``recover`` has fewer), each an object with the
hooks it needs (CLU's periodic actions and ``MultiWriter`` are the model). An action
is called with the step's values and returns what the loop should do; it never
reaches into the loop. The loop calls each hook on every action that has it, in the
order of :func:`actions`; the hooks, in the order of a run:

======================================  =============================================
``on_fit_start(step, history)``         once, before the first batch
``feed(batches, interrupted)``          the batches to train, ``(batch, placed,
-> iterator``                           wait)`` each: the first action with it
                                        (the prefetch), else the loop pulls them
``pulled(batch)``                       a batch was pulled from the data
``take(item) -> Item | None``           before a dispatch: what the step trains
                                        (None: nothing yet)
``before(state, item) -> bool``         before a dispatch: must it check replicas?
``run(state, item, number, check,       the dispatch itself: the first action with
presplit) -> (state, out)``             it (the watchdog), else the step's own
``dispatched(pending)``                 after a dispatch
``read(table)``                         a step's table was read (also when fit stops
                                        early: then nothing else hears of it)
``on_step_end(table)``                  after the history has the step
``settled(pending, table)``             the step settled
``failed(pending, error)``              a step failed: returns the error amended, or
                                        a recovery's ``Resume`` for the loop to go on
``resumed(resume, number)``             the loop went on from step ``number``
``held() -> list[Item]``                rows pulled and held (not trained): when the
                                        loop goes back or stops
``untaken() -> list[Item]``             batches pulled and never handed to the loop:
                                        when fit stops (the prefetch's thread
                                        stopped first)
``report(error, first) -> error``       a failure leaves fit (``error.batches`` set)
``on_failure(error)``                   then the callbacks hear of it
``hung(error)``                         it was a hang or a lost peer
``stopped(state, untrained, first)``    another exception leaves fit: the state saved
``close()``                             on every way out of fit
``finish()``                            the data ended and every step settled
``on_fit_end(history)``                 then the callbacks hear of it
======================================  =============================================

A new action is a module with its class and one line in :func:`actions`.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

from jaxstep.checkpoint import FitCheckpoints
from jaxstep.core import StepOutput
from jaxstep.core import TrainingWorkerError
from jaxstep.core import TrainState
from jaxstep.loop._callbacks import Callbacks
from jaxstep.loop._carry import Carry
from jaxstep.loop._carry import Cut
from jaxstep.loop._carry import carry_for
from jaxstep.loop._checkpoints import Checkpoints
from jaxstep.loop._diagnose import Replay
from jaxstep.loop._history import History
from jaxstep.loop._options import FitOptions
from jaxstep.loop._outcome import Resume
from jaxstep.loop._pending import Item
from jaxstep.loop._pending import Pending
from jaxstep.loop._prefetch import Prefetch
from jaxstep.loop._prefetch import in_turn
from jaxstep.loop._recover import Recovery
from jaxstep.loop._watchdog import StepWatchdog
from jaxstep.step import TrainStep
from jaxstep.step import driving


def actions(
    step: TrainStep, options: FitOptions, checkpoints: FitCheckpoints, history: History
) -> list[Any]:
    """The actions of one fit call, in the order their hooks run: the carry decides
    what a step trains, the prefetch stops placing when a step fails (before a recovery
    takes a device out), the checkpoints see the state before the step and its table
    first, the callbacks hear of a step before a recovery acts on it, and a recovery
    acts on a failure before its replay is asked for."""
    callbacks = Callbacks(options.callbacks)
    source = checkpoints.source
    carry = carry_for(step, source.start, source.skip_rows, history.left_over, options.presplit)
    prefetch = None
    if options.prefetch:  # placing ahead: a step placing batches itself, rows not carried
        place = carry is None and options.step_timeout is None and not driving.stacked(step)
        prefetch = Prefetch(step, source, options.prefetch, presplit=options.presplit, place=place)
    found = (
        carry,
        prefetch,
        None if checkpoints.store is None else Checkpoints(checkpoints),
        None if options.step_timeout is None else StepWatchdog(step, options.step_timeout),
        callbacks if callbacks.hooked else None,
        None
        if options.recover is None
        else Recovery(
            options.recover,
            step,
            history=history,
            callbacks=callbacks,
            checkpoints=checkpoints,
            carry=carry,
            presplit=options.presplit,
            step_timeout=options.step_timeout,
        ),
        None
        if options.diagnose is False
        else Replay(step, options.diagnose, options.presplit, options.step_timeout),
    )
    return [part for part in found if part is not None]


class Direct:
    """The dispatch without the watchdog: the step, on the calling thread (its table is
    read a step later)."""

    __slots__ = ("step",)
    settles_at_once = False

    def __init__(self, step: TrainStep):
        self.step = step

    def run(
        self, state: TrainState, item: Item, number: int, check: bool, presplit: bool
    ) -> tuple[TrainState, StepOutput]:
        if item.drop:  # a data recovery: the failing chunks left out of the mean
            return driving.rerun_dropping(self.step, state, item.batch, presplit=presplit)
        placed = item.placed  # prefetched: on the devices already, joined
        if placed is not None and placed.key is driving.placement(self.step):
            return driving.dispatch(self.step, state, placed.batch, check_replicas=check)
        return driving.dispatch(
            self.step, state, item.batch, check_replicas=check, presplit=presplit
        )


Hooks = tuple[Callable[..., Any], ...]


class Actions:
    """The hooks of ``parts`` (:func:`actions`), bound once, in order. The hooks of
    every step (``pulled``, ``take``, ``before``, ``dispatched``, ``read``,
    ``on_step_end``, ``settled``) are tuples the loop runs itself: no call at all when
    no part has the hook. The others are methods that call the hook on every part that
    has it. ``run`` and ``settles_at_once``: the dispatch."""

    __slots__ = (
        "_close",
        "_failed",
        "_finish",
        "_held",
        "_hung",
        "_on_failure",
        "_on_fit_end",
        "_on_fit_start",
        "_report",
        "_resumed",
        "_stopped",
        "_untaken",
        "before",
        "dispatched",
        "feed",
        "on_step_end",
        "parts",
        "pulled",
        "read",
        "run",
        "settled",
        "settles_at_once",
        "tables",
        "take",
    )

    def __init__(self, parts: list[Any], step: TrainStep):
        self.parts = parts
        runner = next((p for p in parts if hasattr(p, "run")), None) or Direct(step)
        self.run: Callable[..., tuple[TrainState, StepOutput]] = runner.run
        self.settles_at_once: bool = runner.settles_at_once
        feeder = next((p for p in parts if hasattr(p, "feed")), None)
        self.feed: Callable[..., Iterator[Any]] = in_turn if feeder is None else feeder.feed

        def bind(hook: str) -> Hooks:
            return tuple(getattr(p, hook) for p in parts if hasattr(p, hook))

        self._on_fit_start = bind("on_fit_start")
        self.pulled = bind("pulled")
        self.take = bind("take")
        self.before = bind("before")
        self.dispatched = bind("dispatched")
        self.read = bind("read")
        self.on_step_end = bind("on_step_end")
        self.settled = bind("settled")
        #: whether a hook takes a step's decoded table (without, the loop reads it raw)
        self.tables = bool(self.read or self.on_step_end or self.settled)
        self._failed = bind("failed")
        self._resumed = bind("resumed")
        self._held = bind("held")
        self._untaken = bind("untaken")
        self._report = bind("report")
        self._on_failure = bind("on_failure")
        self._hung = bind("hung")
        self._stopped = bind("stopped")
        self._close = bind("close")
        self._finish = bind("finish")
        self._on_fit_end = bind("on_fit_end")

    def with_carry(self, carry: Carry | Cut, step: TrainStep) -> Actions:
        """These actions with ``carry`` as the carry (first: it decides what a step
        trains), in place of the one there (a device left the run)."""
        rest = [p for p in self.parts if not isinstance(p, (Carry, Cut))]
        return Actions([carry, *rest], step)

    def on_fit_start(self, step: TrainStep, history: History) -> None:
        for hook in self._on_fit_start:
            hook(step, history)

    def failed(self, pending: Pending, error: TrainingWorkerError) -> TrainingWorkerError | Resume:
        """The error amended by each part, or the first ``Resume`` one returns."""
        for hook in self._failed:
            outcome = hook(pending, error)
            if not isinstance(outcome, TrainingWorkerError):
                return outcome
            error = outcome
        return error

    def resumed(self, resume: Resume, number: int) -> None:
        for hook in self._resumed:
            hook(resume, number)

    def held(self) -> list[Item]:
        return [item for hook in self._held for item in hook()]

    def untaken(self) -> list[Item]:
        return [item for hook in self._untaken for item in hook()]

    def report(
        self, error: TrainingWorkerError, first: tuple[int, int] | None
    ) -> TrainingWorkerError:
        for hook in self._report:
            error = hook(error, first)
        return error

    def on_failure(self, error: TrainingWorkerError) -> None:
        for hook in self._on_failure:
            hook(error)

    def hung(self, error: TrainingWorkerError) -> None:
        for hook in self._hung:
            hook(error)

    def stopped(
        self, state: TrainState, untrained: int, first: tuple[int, int] | None
    ) -> str | None:
        """Where the state was saved (the first part that saved it), or None."""
        saved = None
        for hook in self._stopped:
            saved = hook(state, untrained, first) or saved
        return saved

    def close(self) -> None:
        for hook in self._close:
            hook()

    def finish(self) -> None:
        for hook in self._finish:
            hook()

    def on_fit_end(self, history: History) -> None:
        for hook in self._on_fit_end:
            hook(history)
