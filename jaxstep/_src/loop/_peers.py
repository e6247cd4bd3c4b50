"""How one fit call waits on devices it shares with peer processes: with several
processes and their heartbeats on (``jax.distributed``), no wait may block where a lost
peer would leave this process stuck, and a collective that fails is most likely a peer
that died. The loop waits through :class:`Peers` wherever it reads the devices: a
step's health table, the rows re-split across processes (:mod:`jaxstep._src.loop._resplit`)
and, before an exception leaves fit, the newest step in flight."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxstep._src import distributed
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import processes


class Peers:
    """Whether this fit call watches peer processes (set by :meth:`start`), and its waits."""

    def __init__(self) -> None:
        self.watched = False

    def start(self, devices: Sequence[jax.Device]) -> None:
        """The run starts on ``devices``: peers are watched when they span processes
        and the heartbeats are on."""
        self.watched = processes.spans_processes(devices) and distributed.watch() is not None

    def ready(self, array: Any, number: int, devices: Sequence[jax.Device]) -> None:
        """Returns once ``array`` (of step ``number``) is ready while peers are watched,
        raising a lost peer's error (a :class:`TrainingWorkerError`) rather than wait for
        it forever; at once otherwise (the caller's read waits)."""
        if self.watched:
            distributed.wait_ready(array, number, devices)

    def cause(self, err: Exception, number: int, devices: Sequence[jax.Device]) -> Exception:
        """What to raise for ``err``, raised while waiting on step ``number``: a lost
        peer's :class:`TrainingWorkerError` when a collective failed because a peer died
        (waiting for the heartbeats to tell, at most the lost timeout), else ``err``."""
        if isinstance(err, TrainingWorkerError) or not self.watched:
            return err
        found = distributed.lost_after(err, number, devices)
        return found if isinstance(found, Exception) else err

    def let_finish(self, newest: Any, err: BaseException) -> None:
        """Before ``err`` leaves fit: lets the newest dispatched step (its health
        array, ``newest``; None: none) finish, so no collective is left half done."""
        if self.watched and newest is not None:
            distributed.finish_in_flight(newest, err)
