"""The listeners of one fit call, the loop's actions and the user's callbacks in one
ordered list (:func:`actions`), and their hooks bound once (:class:`Actions`): the loop
calls a hook on the listeners that override it, in the order of :func:`actions`, and
never on one that keeps the no-op of :class:`~jaxstep._src.loop._action.Action` (or of
:class:`~jaxstep.Callback`). What each hook is for, and the order where it matters:
:class:`~jaxstep._src.loop._action.Action`.

A new action is a module with its class (an :class:`~jaxstep._src.loop._action.Action` that
overrides the hooks it needs) and one line in :func:`actions`: docs/internals.md says
how, with the hook table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxstep._src.checkpoint import Cursor
from jaxstep._src.core import StepOutput
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.loop._action import Action
from jaxstep._src.loop._action import Feeder
from jaxstep._src.loop._action import Runner
from jaxstep._src.loop._callbacks import HOOKS
from jaxstep._src.loop._callbacks import Callback
from jaxstep._src.loop._callbacks import listener
from jaxstep._src.loop._callbacks import overrides
from jaxstep._src.loop._checkpoints import FitCheckpoints
from jaxstep._src.loop._diagnose import Replay
from jaxstep._src.loop._history import History
from jaxstep._src.loop._ledger import Ledger
from jaxstep._src.loop._options import FitOptions
from jaxstep._src.loop._outcome import Resume
from jaxstep._src.loop._pending import Item
from jaxstep._src.loop._pending import Pending
from jaxstep._src.loop._prefetch import InTurn
from jaxstep._src.loop._prefetch import Prefetch
from jaxstep._src.loop._records import Recovery
from jaxstep._src.loop._recover import SelfHealing
from jaxstep._src.loop._watchdog import StepWatchdog
from jaxstep._src.step import Runtime
from jaxstep._src.step import TrainStep


class Direct(Runner):
    """The dispatch without the watchdog: the step, on the calling thread (its table is
    read a step later)."""

    def run(
        self,
        runtime: Runtime,
        state: TrainState,
        item: Item,
        number: int,
        check: bool,
        presplit: bool,
    ) -> tuple[TrainState, StepOutput]:
        if item.drop:  # a data recovery: the failing chunks left out of the mean
            return runtime.rerun_dropping(state, item.batch, presplit=presplit)
        placed = item.placed  # prefetched: on the devices already, joined
        if placed is not None and placed.key is runtime:
            return runtime.dispatch(state, placed.batch, check_replicas=check)
        return runtime.dispatch(state, item.batch, check_replicas=check, presplit=presplit)


def actions(
    runtime: Runtime,
    options: FitOptions,
    checkpoints: FitCheckpoints,
    carried: bool,
    ledger: Ledger | None = None,
    cut: Callable[[Any], Any] | None = None,
) -> Actions:
    """The listeners of one fit call, in the order their hooks run: the feeder stops
    placing when a step fails (before a recovery takes a device out), the checkpoints
    see the state before the step and its table first, the user's callbacks (in the
    order given; a plain object adapted here, once) hear of a step before a recovery
    acts on it, and a recovery acts on a failure before its replay is asked for.
    ``carried``: the fit call starts with rows carried (the step places its batches
    itself); ``ledger``: where the actions' time goes (the run's goodput); ``cut``:
    this process's rows of a batch as the data gives it (``global_batches``), what the
    prefetch places."""
    callbacks = [listener(callback) for callback in options.callbacks]
    # a callback shows each recovery: the loop then logs them at INFO, not WARNING
    shown = any(overrides(c, "on_recovery", Callback.on_recovery) for c in callbacks)
    runner: Runner = Direct()
    if options.step_timeout is not None:
        runner = StepWatchdog(options.step_timeout)
    feeder: Feeder = InTurn()
    if options.prefetch:  # placing ahead: a step placing batches itself, rows not carried
        place = not carried and options.step_timeout is None
        feeder = Prefetch(
            runtime, options.prefetch, presplit=options.presplit, place=place, cut=cut
        )
    healing = None
    if options.recover is not None:
        healing = SelfHealing(
            options.recover,
            runtime,
            checkpoints=checkpoints,
            presplit=options.presplit,
            step_timeout=options.step_timeout,
            shown=shown,
            ledger=ledger,
        )
    replay = None
    if options.diagnose is not False:
        replay = Replay(options.diagnose, options.presplit, options.step_timeout)
    found = (
        feeder,
        None if checkpoints.store is None else checkpoints,
        runner,
        *callbacks,
        healing,
        replay,
    )
    parts: list[Callback] = [part for part in found if part is not None]
    return Actions(parts, runner, feeder, shows_recoveries=shown, ledger=ledger)


Hooks = tuple[Callable[..., Any], ...]


class Actions:
    """The hooks of ``parts`` (the listeners: actions and callbacks), bound once, in
    order: for each hook the bound methods of the parts that override it (no call at
    all for a hook no part overrides; a plain callback comes adapted). The hooks
    of every step (``pulled``, ``before``, ``dispatched``, ``read``, ``on_step_end``,
    ``settled``) are tuples the loop runs itself; the others are methods here.
    ``runner`` and ``feeder``: the explicit dispatch and data (each also one of
    ``parts``, for its other hooks); ``shows_recoveries``: a callback shows each
    recovery (the loop then logs them at INFO, not WARNING); ``ledger``: where the
    time of an action with a :attr:`~Action.bucket` goes (its hooks timed)."""

    def __init__(
        self,
        parts: list[Callback],
        runner: Runner,
        feeder: Feeder,
        *,
        shows_recoveries: bool,
        ledger: Ledger | None = None,
    ):
        self.parts = parts
        self.runner = runner
        self.feeder = feeder
        self.shows_recoveries = shows_recoveries

        def bind(hook: str) -> Hooks:
            default = getattr(Action, hook)
            return tuple(timed(p, hook) for p in parts if has(p, hook, default))

        def has(part: Callback, hook: str, default: object) -> bool:
            # a Callback that is not an Action listens to the five Callback hooks only:
            # its own methods of the loop's hook names (a writer's close) are its own
            own = hook in HOOKS or isinstance(part, Action)
            return own and overrides(part, hook, default)

        def timed(part: Callback, hook: str) -> Callable[..., Any]:
            bucket = getattr(part, "bucket", None)  # (a user's Callback is the step's)
            fn = getattr(part, hook)
            return fn if bucket is None or ledger is None else ledger.timed(bucket, fn)

        self._on_fit_start = bind("on_fit_start")
        self.pulled = bind("pulled")
        self.before = bind("before")
        self.dispatched = bind("dispatched")
        self.read = bind("read")
        self.on_step_end = bind("on_step_end")
        self.settled = bind("settled")
        #: whether a hook takes a step's decoded table (without, the loop reads it raw)
        self.tables = bool(self.read or self.on_step_end or self.settled)
        self._failed = bind("failed")
        self._resumed = bind("resumed")
        self._on_recovery = bind("on_recovery")
        self._report = bind("report")
        self._on_failure = bind("on_failure")
        self._hung = bind("hung")
        self._stopped = bind("stopped")
        self._close = bind("close")
        self._finish = bind("finish")
        self._on_fit_end = bind("on_fit_end")

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

    def on_recovery(self, record: Recovery) -> None:
        for hook in self._on_recovery:
            hook(record)

    def report(self, error: TrainingWorkerError, first: Cursor | None) -> TrainingWorkerError:
        for hook in self._report:
            error = hook(error, first)
        return error

    def on_failure(self, error: TrainingWorkerError) -> None:
        for hook in self._on_failure:
            hook(error)

    def hung(self, error: TrainingWorkerError) -> None:
        for hook in self._hung:
            hook(error)

    def stopped(self, state: TrainState, untrained: int, first: Cursor | None) -> str | None:
        """Where the state was saved (the first part that saved it), or None."""
        saved = None
        for hook in self._stopped:
            where = hook(state, untrained, first)
            saved = saved or where
        return saved

    def close(self) -> None:
        for hook in self._close:
            hook()

    def finish(self, state: TrainState, first: Cursor | None) -> None:
        for hook in self._finish:
            hook(state, first)

    def on_fit_end(self, history: History) -> None:
        for hook in self._on_fit_end:
            hook(history)
