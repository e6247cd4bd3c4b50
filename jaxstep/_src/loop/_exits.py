"""The ways out of one fit call's loop (:class:`~jaxstep._src.loop._driver.Loop` is made of
them and its steps): an exception that leaves fit (:meth:`Exits.abandon`: the last good
state and every batch pulled and not trained go on it), a failure reported with the
batches it leaves untrained (:meth:`Exits._report`), a hang or a lost peer, after which
nothing of this process can go on (:meth:`Exits._hung`), and a wait on the devices that
a lost peer broke (:meth:`Exits._lost`)."""

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


class Exits:
    """The loop's ways out, on the loop's own fields (declared here, set by the loop)."""

    peers: Peers  # how it waits on devices shared with other processes
    last: StepOutput | None  # the newest dispatched step
    actions: Actions
    flight: InFlight
    runtime: Runtime
    record: Recorder
    state: TrainState  # the newest state dispatched, or the last good one
    carry: Carry | Resplit | None
    pulled: int  # batches pulled from the source

    def _lost(self, err: Exception, number: int, untrained: list[Any]) -> NoReturn:
        """Raises for ``err``, raised while waiting on the devices for step ``number``:
        a lost peer (or a collective it failed) as a hang reported with the
        ``untrained`` batches (:meth:`_hung`), anything else as it is."""
        cause = self.peers.cause(err, number, self.runtime.devices)
        if not isinstance(cause, TrainingWorkerError):
            raise err
        raise self._hung(cause, untrained) from (None if cause is err else err)

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
        self.peers.let_finish(None if self.last is None else self.last.health, err)
        if isinstance(err, TrainingWorkerError):
            self.actions.close()
            return
        try:
            left, failed = self.flight.read_unconfirmed(
                self.runtime, self.record, self.actions.read
            )
        except Exception as why:  # the steps in flight cannot be read: say so, lose nothing
            left, failed = list(self.flight.unconfirmed), f"(unread: {why!r})"
        untrained, first = self._untrained(*left, self.flight.in_hand)
        state = last_good(self.runtime, self.state, failed)
        saved = None
        if state is not None and self.last is not None:  # something trained: keep it
            try:
                saved = self.actions.stopped(state, len(untrained), first)
            except Exception as why:
                err.add_note(f"jaxstep: saving the state on the way out failed: {why!r}")
        self.actions.close()
        attach(err, state, untrained, failed, saved)

    def _untrained(self, *left: Pending | Item | None) -> tuple[Untrained, Cursor | None]:
        """The batches of ``left``, of the queue, the rows carried and those the feeder
        pulled and never handed over, untrained, in the order they were pulled (with a
        batch still on its way from the data, :class:`Untrained`), and where the first
        is in the data (:func:`untrained_batches`); empties the queue and the carry."""
        carried = [] if self.carry is None else self.carry.release()
        return self.flight.untrained([*left, *carried], self.actions.feeder, self.pulled)

    def _report(
        self, error: TrainingWorkerError, untrained: Sequence[Pending | Item | None]
    ) -> TrainingWorkerError:
        """A failure, a hang or a lost peer: the ``untrained`` batches (failing batch
        first, then those pulled after it and those a recovery queued) go on the error,
        the actions report it (the emergency save) and the callbacks hear of it."""
        batches, first = self._untrained(*untrained)
        error = self.actions.report(error.replace(batches=batches), first)
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
