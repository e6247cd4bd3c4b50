"""The ways out of one fit call's loop, a plain object the loop owns
(:class:`Exits`): an exception that leaves fit (:meth:`Exits.abandon`: the last good
state and every batch pulled and not trained go on it), a failure reported with the
batches it leaves untrained (:meth:`Exits.report`), a hang or a lost peer, after which
nothing of this process can go on (:meth:`Exits.hung`), and a wait on the devices that
a lost peer broke (:meth:`Exits.lost`). It holds the loop's parts that last the whole
call; what changes during it (the step, the state, the rows carried, the batches
pulled) the loop passes with each call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import NoReturn

from jaxstep._src.checkpoint import Cursor
from jaxstep._src.core import StepOutput
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.loop._actions import Actions
from jaxstep._src.loop._carry import Carry
from jaxstep._src.loop._flight import InFlight
from jaxstep._src.loop._peers import Peers
from jaxstep._src.loop._pending import Item
from jaxstep._src.loop._pending import Pending
from jaxstep._src.loop._recorder import Recorder
from jaxstep._src.loop._resplit import Resplit
from jaxstep._src.loop._stopping import Untrained
from jaxstep._src.loop._stopping import attach
from jaxstep._src.loop._stopping import last_good
from jaxstep._src.step import Runtime

#: what a way out hands back of a batch: a step in flight, a batch on its way, or none
Left = Pending | Item | None


class Exits:
    """The loop's ways out.

    Args:
      flight: the loop's batches between the data and a settled step.
      actions: the fit call's actions (they report, save and close).
      peers: how the loop waits on devices shared with other processes.
      record: the history's recorder (the steps read on the way out).
    """

    def __init__(self, flight: InFlight, actions: Actions, peers: Peers, record: Recorder):
        self.flight = flight
        self.actions = actions
        self.peers = peers
        self.record = record

    def lost(
        self,
        err: Exception,
        number: int,
        runtime: Runtime,
        untrained: Sequence[Left],
        carry: Carry | Resplit | None,
        pulled: int,
    ) -> NoReturn:
        """Raises for ``err``, raised while waiting on ``runtime``'s devices for step
        ``number``: a lost peer (or a collective it failed) as a hang reported with the
        ``untrained`` batches (:meth:`hung`), anything else as it is."""
        cause = self.peers.cause(err, number, runtime.devices)
        if not isinstance(cause, TrainingWorkerError):
            raise err
        raise self.hung(cause, untrained, carry, pulled) from (None if cause is err else err)

    def abandon(
        self,
        err: BaseException,
        runtime: Runtime,
        state: TrainState,
        last: StepOutput | None,
        carry: Carry | Resplit | None,
        pulled: int,
    ) -> None:
        """An exception (``err``) leaves fit. With peer processes, first lets the newest
        dispatched step (``last``) finish, so no collective is left half done (a peer
        still in it would abort). A :class:`TrainingWorkerError` already carries what it
        must; anything else (Ctrl-C, a callback's or the data source's exception,
        ``SystemExit``, a rejected batch) gets ``err.state``, the last good state (from
        ``state``, the newest dispatched on ``runtime``; usable: nothing of it donated),
        and ``err.batches``, every batch pulled and not trained, in order, with a note
        saying so; with a checkpoint directory the state is saved first, so
        ``resume=True`` goes on from it. The actions are closed on every path."""
        self.peers.let_finish(None if last is None else last.health, err)
        if isinstance(err, TrainingWorkerError):
            self.actions.close()
            return
        try:
            left, failed = self.flight.read_unconfirmed(runtime, self.record, self.actions.read)
        except Exception as why:  # the steps in flight cannot be read: say so, lose nothing
            left, failed = list(self.flight.unconfirmed), f"(unread: {why!r})"
        untrained, first = self._untrained([*left, self.flight.in_hand], carry, pulled)
        good = last_good(runtime, state, failed)
        saved = None
        if good is not None and last is not None:  # something trained: keep it
            try:
                saved = self.actions.stopped(good, len(untrained), first)
            except Exception as why:
                err.add_note(f"jaxstep: saving the state on the way out failed: {why!r}")
        self.actions.close()
        attach(err, good, untrained, failed, saved)

    def _untrained(
        self, left: Sequence[Left], carry: Carry | Resplit | None, pulled: int
    ) -> tuple[Untrained, Cursor | None]:
        """The batches of ``left``, of the queue, the rows ``carry`` holds and those the
        feeder pulled and never handed over, untrained, in the order they were pulled
        (with a batch still on its way from the data, :class:`Untrained`), and where the
        first is in the data (``pulled``: the batches the loop was handed); empties the
        queue and the carry."""
        carried: list[Any] = [] if carry is None else carry.release()
        return self.flight.untrained([*left, *carried], self.actions.feeder, pulled)

    def report(
        self,
        error: TrainingWorkerError,
        untrained: Sequence[Left],
        carry: Carry | Resplit | None,
        pulled: int,
    ) -> TrainingWorkerError:
        """A failure, a hang or a lost peer: the ``untrained`` batches (failing batch
        first, then those pulled after it and those a recovery queued) and the rows
        carried go on the error, the actions report it (the emergency save) and the
        callbacks hear of it."""
        batches, first = self._untrained(untrained, carry, pulled)
        error = self.actions.report(error.replace(batches=batches), first)
        self.actions.on_failure(error)
        return error

    def hung(
        self,
        error: TrainingWorkerError,
        untrained: Sequence[Left],
        carry: Carry | Resplit | None,
        pulled: int,
    ) -> TrainingWorkerError:
        """A hung step or a lost peer, reported (:meth:`report`). Nothing of this
        process can go on: under ``recover`` it exits for a restart (``hung``)."""
        error = self.report(error, untrained, carry, pulled)
        self.actions.hung(error)
        return error
