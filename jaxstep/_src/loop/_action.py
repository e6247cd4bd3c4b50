"""The typed face of the loop's actions (CLU's ``PeriodicAction``, one base class): the
parts of one fit call that are there only when asked for (checkpoints, the watchdog,
recovery, the replay diagnosis, the prefetch). An :class:`Action` is a
:class:`~jaxstep.Callback` with the loop's own hooks beside the five users have: the
callbacks a user passes are listeners in the same ordered list. Each overrides the
hooks it needs; every hook here is a no-op. An action is called with the step's values
and returns what the loop should do or record: it never writes the loop's fields nor
the :class:`~jaxstep.History` (the loop alone does), and never calls another action.

Two roles are chosen explicitly, one part each (:func:`jaxstep._src.loop._actions.actions`):
the :class:`Runner` dispatches a step (the step watchdog, else the direct call) and the
:class:`Feeder` hands the loop its batches (the prefetch thread, else pulled in turn).
The carry (rows carried after a device left, :mod:`jaxstep._src.loop._carry`) is the loop's
own, not an action.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

from jaxstep._src.checkpoint import Cursor
from jaxstep._src.core import HealthTable
from jaxstep._src.core import StepOutput
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.loop._callbacks import Callback
from jaxstep._src.loop._outcome import Resume
from jaxstep._src.loop._pending import Item
from jaxstep._src.loop._pending import Pending
from jaxstep._src.loop._pending import Placed
from jaxstep._src.loop._records import Recovery
from jaxstep._src.loop._stopping import LateBatch
from jaxstep._src.step import Runtime


class Action(Callback):
    """A part of one fit call: a :class:`~jaxstep.Callback` (the five hooks users have,
    marked *) with the loop's own hooks. The hooks, in the order of a run (the loop
    calls a hook only on the listeners that override it, found once when fit starts):

    ======================  =======================================  ==================
    hook                    when                                     returns (who uses)
    ======================  =======================================  ==================
    ``on_fit_start`` *      once, before the first batch             -
    ``pulled``              a batch was pulled from the data         -
    ``before``              before a dispatch (the state about to    check replicas at
                            be donated)                              this step? (loop)
    ``dispatched``          after a dispatch                         -
    ``read``                a step's table was read (also when fit   -
                            stops early: then nothing else hears)
    ``on_step_end`` *       the history has the step                 -
    ``settled``             the step settled                         a record (loop)
    ``failed``              a step failed                            the error amended,
                                                                     or a ``Resume``
                                                                     (loop)
    ``resumed``             the loop went on from a ``Resume``       -
    ``on_recovery`` *       the history has a recovery's record      -
    ``report``              a failure leaves fit                     the error (loop)
    ``on_failure`` *        then                                     -
    ``hung``                it was a hang or a lost peer             -
    ``stopped``             another exception leaves fit             where the state
                                                                     was saved (loop)
    ``finish``              the data ended, every step settled       -
    ``close``               every way out of fit                     -
    ``on_fit_end`` *        then                                     -
    ======================  =======================================  ==================

    The order between listeners, where it matters (the list:
    :func:`jaxstep._src.loop._actions.actions`): a hook runs on the listeners in their
    order in the list (the feeder, the checkpoints, the runner, the user's callbacks in
    the order given, the recovery, the replay), and one hook after the other as the
    table says. So the checkpoints take a step's copy (``before``) and hand it to the
    writer (``read``) before any callback's ``on_step_end``; the callbacks hear
    ``on_recovery`` before the recovery counts the record against its budget; the
    emergency save (``report``) is done before ``on_failure``, and the final state is
    saved and the writes waited for (``finish``, ``close``) before ``on_fit_end``.
    """

    #: where the time spent in this action's hooks goes in the run's goodput (a
    #: bucket of :attr:`jaxstep.Goodput.badput`; None: the step's own time)
    bucket: str | None = None

    def pulled(self, batch: Any) -> None:
        """A batch was pulled from the data, before the step takes it."""

    def before(self, state: TrainState, item: Item, number: int) -> bool:
        """Before ``state`` (the state of step ``number``, ``state.step``) is dispatched
        (and donated) on ``item``: whether this step must run the replica check (the
        loop ORs every action's answer)."""
        return False

    def dispatched(self, pending: Pending) -> None:
        """A step was dispatched (not finished yet)."""

    def read(self, table: HealthTable) -> None:
        """A step's table was read. Also when fit stops early, where nothing else hears
        of that step."""

    def settled(self, pending: Pending, table: HealthTable) -> Recovery | None:
        """The step settled; a :class:`~jaxstep.Recovery` the step made itself (a replica
        repaired inside it) for the loop to record, or None."""
        return None

    def failed(self, pending: Pending, error: TrainingWorkerError) -> TrainingWorkerError | Resume:
        """A step failed: the error amended (the loop passes it to the next action), or
        a :class:`~jaxstep._src.loop._outcome.Resume` for the loop to go on with (the first
        one ends the round)."""
        return error

    def resumed(self, resume: Resume, number: int) -> None:
        """The loop went on from ``resume`` at step ``number`` (``resume.step``: the
        step from now on, when a device left; the loop hands it on with the values it
        passes, so no action holds it)."""

    def report(self, error: TrainingWorkerError, first: Cursor | None) -> TrainingWorkerError:
        """A failure leaves fit (``error.batches`` set; ``first``: where the first of them
        is in the data): the error amended (the loop passes it on, then raises it)."""
        return error

    def hung(self, error: TrainingWorkerError) -> None:
        """The failure leaving fit was a hang or a lost peer."""

    def stopped(self, state: TrainState, untrained: int, first: Cursor | None) -> str | None:
        """Another exception leaves fit: where ``state`` was saved (the first action's
        answer is named on the exception), or None."""
        return None

    def finish(self, state: TrainState, first: Cursor | None) -> None:
        """The data ended (or the call's count of batches) and every step settled:
        ``state`` is the final state (the checkpoints save it); ``first``: where the
        rows still carried begin in the data (None: after every batch pulled)."""

    def close(self) -> None:
        """On every way out of fit (threads joined, writes waited for)."""


class Runner(Action):
    """The action that dispatches a step: the step watchdog, else the step called
    directly (:class:`jaxstep._src.loop._actions.Direct`)."""

    #: whether a step has finished when :meth:`run` returns (the loop settles it at once)
    settles_at_once = False

    def run(
        self,
        runtime: Runtime,
        state: TrainState,
        item: Item,
        number: int,
        check: bool,
        presplit: bool,
    ) -> tuple[TrainState, StepOutput]:
        """Dispatches step ``number`` on ``item`` on ``runtime``, the step's the loop
        trains on now (``check``: run the replica check; ``presplit``: the batch comes
        pre-split)."""
        raise NotImplementedError


#: what a feeder yields: a batch as the data gave it, the batch placed ahead (or None),
#: and the seconds the loop waited for it
Fed = tuple[Any, Placed | None, float]


class Feeder(Action):
    """The action that hands the loop its batches: the prefetch thread, else pulled on
    the loop's thread in turn (:class:`jaxstep._src.loop._prefetch.InTurn`)."""

    def feed(self, batches: Iterator[Any], interrupted: Callable[[], bool]) -> Iterator[Fed]:
        """The batches of ``batches``, in order."""
        raise NotImplementedError

    def untaken(self) -> list[Item]:
        """When fit stops: the batches pulled and never handed to the loop, in order
        (the feeder stopped first)."""
        return []

    def late(self) -> LateBatch | None:
        """After :meth:`untaken`: a batch still on its way (the data was inside
        ``next`` when fit stopped), which goes to the end of ``err.batches`` when it
        arrives; None: none."""
        return None
