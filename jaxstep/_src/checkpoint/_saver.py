"""How a run's checkpoints are written so that a failure loses nothing: a copy of the
state taken at a step (:meth:`Saver.take`), written from a worker thread once that
step's replica check has passed (:meth:`Saver.settled`: every checkpoint is verified);
a state written at once (:meth:`Saver.save_now`: fit's final state, an early stop's,
:func:`jaxstep.save`); a failure's emergency save of the last good state, the failing
batch and the error report (:meth:`Saver.emergency`).

When fit writes one, and from which data position, is fit's own: its checkpoint
listener (:class:`jaxstep._src.loop._checkpoints.FitCheckpoints`) calls these.
:func:`jaxstep._src.checkpoint._resume.begin_fit` builds the saver of a fit call.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxstep._src.checkpoint import _blocks as blocks
from jaxstep._src.checkpoint import _coordination as coordination
from jaxstep._src.checkpoint import _emergency as emergency
from jaxstep._src.checkpoint._layout import Layout
from jaxstep._src.checkpoint._layout import local_copy
from jaxstep._src.checkpoint._position import Cursor
from jaxstep._src.checkpoint._position import Position
from jaxstep._src.checkpoint._position import Source
from jaxstep._src.checkpoint._store import Store
from jaxstep._src.checkpoint._store import run_meta
from jaxstep._src.core import HealthTable
from jaxstep._src.core import Status
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.core import log
from jaxstep._src.program import Pads
from jaxstep._src.step import Runtime

# A failed replica check at a checkpoint step: the state it checked is not saved.
_UNVERIFIED = int(Status.DIVERGED | Status.PARAM_NONFINITE)
# Failures whose err.state cannot be trusted as the run's state: name a checkpoint.
_NAME_CHECKPOINT = Status.HUNG | Status.DIVERGED
_DRAIN_TIMEOUT = 120.0  # seconds to let queued writes finish on the failure path
# Seconds the writer waits for a peer's data position: published before the step ran,
# so a missing one means a lost peer (the checkpoint is then not written).
_GATHER_TIMEOUT = 20.0


@dataclasses.dataclass
class _Snapshot:
    number: int
    leaves: list[jax.Array]  # one replica, on device, not yet read
    position: Position | None  # None: saved outside fit (jaxstep.save), no data position
    # taken with the state, not when the writer thread gets to it: a recovery may have
    # rebuilt the step on fewer devices by then (per-device monitor columns included)
    devices: tuple[jax.Device, ...]
    layout: Layout
    #: the leaves the layout holds padded (written with their logical shapes)
    pads: Pads = None

    @classmethod
    def of(cls, step: Runtime, number: int, state: TrainState, position: Position | None) -> Any:
        """A copy of ``state`` (dispatched, not waited for) as ``step`` lays it out."""
        stacked, pads = step.stacked, step.backend.pads(state)
        layout = Layout.of(state, stacked=stacked, pads=pads)
        copy = local_copy(state, stacked=stacked)
        return cls(number, copy, position, tuple(step.devices), layout, pads)


class Saver:
    """Writes one run's checkpoints into ``store`` (None: no checkpoint directory,
    nothing written), on the step's runtime (:meth:`resumed_on`: a new one once a
    recovery left a device out). The run it writes for: a checkpoint every ``every``
    steps (None: at the end only; no writer thread) from step ``first``, the data
    read from ``source``. Built by :func:`jaxstep._src.checkpoint._resume.begin_fit`
    (and by :func:`jaxstep.save`)."""

    def __init__(
        self, step: Runtime, store: Store | None, every: int | None, source: Source, first: int
    ):
        self.step = step
        self.store = store
        self.every = every
        self.source = source
        if step.origin is not None:  # the step lost devices in an earlier call
            source.carrying = True
        self.first = first  # the step number of the first state the run dispatches
        # Several processes: each publishes its data position for every checkpoint;
        # one (the writer) writes (see jaxstep.coordination).
        self.processes = coordination.processes(step.devices)
        self.writer = coordination.is_writer()
        many = len(self.processes) > 1
        self._positions = coordination.Positions(self.processes) if many else None
        self._snap: _Snapshot | None = None
        self._done = set(store.steps()) if store is not None else set()
        self._futures: list[concurrent.futures.Future[None]] = []
        self._closed = False
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxstep-checkpoint")
            if store is not None and every is not None
            else None
        )
        if store is not None and source.kind == "checkpointable":
            # The iterator's state before every batch (the last few kept): a periodic
            # checkpoint, an emergency save or the save of an early stop resumes
            # exactly at the first batch it did not train.
            source.watch(lambda count: True)

    def holds(self, number: int) -> bool:
        """Whether step ``number`` is written already (this run, or an earlier one)."""
        return number in self._done

    def take(self, number: int, state: TrainState, position: Position) -> None:
        """A copy of ``state``, the state of checkpoint step ``number`` just before it
        is dispatched (and donated), which resumes from ``position``: dispatched now,
        written once its step's table shows the replicas agree (:meth:`settled`). On
        several processes every process publishes its position first (the writer reads
        it once the step's collective finished, so it is there by then); one that
        neither writes nor holds shards of its own takes no copy."""
        if self._positions is not None:
            self._positions.publish(number, position.to_json())
            if not self.writer and not blocks.spread(state):  # (or write its shards)
                return
        self._snap = _Snapshot.of(self.step, number, state, position)

    @property
    def waiting(self) -> bool:
        """Whether a snapshot waits for its step's health table (:meth:`settled`)."""
        return self._snap is not None

    def settled(self, table: HealthTable) -> None:
        """Called with each step's health table: a snapshot whose replica check passed
        goes to the writer thread."""
        verified = not np.any(np.asarray(table.status) & _UNVERIFIED)
        if self._positions is not None and self._positions.settled(table.step, verified):
            self._done.add(table.step)  # written: not published again (a rollback to it)
        snap = self._snap
        if snap is None or table.step != snap.number:
            return
        self._snap = None
        if not verified:
            return  # its replicas disagree (or hold non-finite values): never saved
        assert self._pool is not None
        self._done.add(snap.number)
        future = self._pool.submit(self._write, snap)
        future.add_done_callback(_report_failed_write)
        self._futures = [f for f in self._futures if not f.done()] + [future]

    def _write(self, snap: _Snapshot, verified_by: str | None = None) -> None:
        """Writes ``snap`` (verified by its step's replica check, or as ``verified_by``
        says: starting "not verified" when it was not)."""
        assert self.store is not None
        leaves, mine = blocks.to_host(snap.leaves, snap.pads)
        if mine is not None and not self._parts_in(snap.number, mine):
            return  # a process that writes its own shards only
        if verified_by is None:
            verified_by = (
                f"the replica check of step {snap.number} (parameter and optimizer state "
                f"fingerprints of all {len(snap.devices)} devices agreed)"
            )
        verified = not verified_by.startswith("not verified")
        meta = self._meta(snap.number, snap.devices, verified=verified)
        if mine is not None:
            meta["blocks"] = blocks.describe(snap.leaves, self.processes, snap.pads)
        if self._positions is not None:  # every process's own data position
            found = self._positions.gather(snap.number, _GATHER_TIMEOUT)
            meta["data_by_process"] = {str(p): pos for p, pos in found.items()}
        meta.update(
            data=None if snap.position is None else snap.position.to_json(),
            exact_resume=snap.position is not None and self.source.exact,
            verified_by=verified_by,
            layout=snap.layout.to_json(),
        )
        self.store.save(snap.number, {"state": leaves, "meta": meta})
        if mine is not None:
            blocks.forget_older(self.store.directory, self.store.steps(), snap.number)

    def _parts_in(self, number: int, mine: dict[str, Any]) -> bool:
        """Writes this process's shards of step ``number`` and says so through the
        store; True on the writer once every process's are in (then it writes the step:
        a step is only listed once whole)."""
        assert self.store is not None and self._positions is not None
        blocks.write(self.store.directory, number, jax.process_index(), mine)
        key = f"{self._positions.prefix}blocks/{number}"
        coordination.publish(key, True)
        if not self.writer:
            return False
        coordination.gather(key, self.processes, _DRAIN_TIMEOUT)
        coordination.forget(key, self.processes)
        return True

    def _meta(
        self, number: int, devices: Sequence[jax.Device], *, verified: bool
    ) -> dict[str, Any]:
        return run_meta(number, devices, self.step.options.backend, verified=verified)

    def resumed_on(self, step: Runtime) -> None:
        """A recovery left a device out: the step runs on ``step`` (a runtime) from now
        on, and rows are carried (the positions saved say so)."""
        self.step = step
        if step.origin is not None:
            self.source.carrying = True

    def rewind(self, number: int) -> None:
        """The run goes on from step ``number`` (a recovery went back or retries a
        step): a copy waiting for a step that did not count is let go."""
        if self._snap is not None and self._snap.number >= number:
            self._snap = None

    def latest_verified(self) -> int | None:
        """The step of the newest verified checkpoint written (queued writes waited
        for), or None: none, or no checkpoint directory. Several processes: the
        writer's answer on every process (the others cannot wait for its writes)."""
        store = self.store
        if store is None:
            return None

        def written() -> int | None:
            self.drain(_DRAIN_TIMEOUT)
            return store.latest_verified()

        if self._positions is None:
            return written()
        return self._positions.latest(written, _DRAIN_TIMEOUT + _GATHER_TIMEOUT)

    def drain(self, timeout: float | None = None) -> None:
        """Waits for the queued writes."""
        concurrent.futures.wait(self._futures, timeout=timeout)

    def emergency(self, error: TrainingWorkerError, first: Cursor) -> TrainingWorkerError:
        """The error (``error.batches``: the failing batch first, which begins at
        ``first`` in the data) with the emergency save, and the latest verified
        checkpoint named (queued writes waited for first). Closes the saver."""
        assert self.store is not None
        self.drain(_DRAIN_TIMEOUT)
        try:
            return self._save_and_name(error, first)
        finally:
            self.close()

    def _save_and_name(self, error: TrainingWorkerError, first: Cursor) -> TrainingWorkerError:
        assert self.store is not None
        try:
            path = emergency.save(
                self.store.directory,
                error,
                meta=self._meta(error.step, self.step.devices, verified=False),
                failing=self.source.position(first),
                stacked=self.step.stacked,
                devices=self.step.devices,
                pads=self.step.backend.pads(error.state) if error.state is not None else None,
            )
        except Exception as err:  # never hide the failure behind a failed save
            log.exception("the emergency save failed")
            return error.with_note(f"the emergency save failed: {err!r}")
        if any(f.status & _NAME_CHECKPOINT for f in error.failures):
            latest = self.store.latest_verified()
            where = self.store.directory
            error = error.with_note(
                f"the latest verified checkpoint is step {latest} ({where / str(latest)}): "
                f"state = jaxstep.restore(step, {str(where)!r})"
                if latest is not None
                else f"no verified checkpoint in {str(where)!r} yet",
            )
        return error.replace(checkpoint=path)

    def save_now(
        self,
        state: TrainState,
        position: Position | None,
        when: str,
        *,
        verified: bool | None = None,
    ) -> str:
        """``state`` written as the checkpoint of its step, on this thread (after the
        queued writes), unless that step is written already, with the data position
        ``position`` (None: none, :func:`jaxstep.save`); ``when``: in the words that
        say how it was verified; ``verified``: whether its replicas agree, when the
        caller compared them (None: they are compared here). Every process calls it
        alike. Returns where."""
        assert self.store is not None
        self.drain(_DRAIN_TIMEOUT)
        number = int(np.asarray(self.step.read_first(state.step)))
        where = str(self.store.directory / str(number))
        if number in self._done:  # this very state was written as a checkpoint
            return where
        if verified is None:
            verified = self.step.replicas_agree(state)  # (every process calls it alike)
        n = len(self.step.devices)
        verified_by = (
            f"the replicas of all {n} devices compared {when}"
            if verified
            else f"not verified: the replicas differed {when}"
        )
        if self._positions is not None:  # every process's own data position
            self._positions.publish(number, None if position is None else position.to_json())
            if not self.writer and not blocks.spread(state):
                return where
        self._write(_Snapshot.of(self.step, number, state, position), verified_by)
        self._done.add(number)
        return where

    def close(self) -> None:
        """Waits for the queued writes (a while) and releases the writer; a write still
        going on finishes in the background (the interpreter waits for it at exit).
        Called on every way out of fit; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.drain(_DRAIN_TIMEOUT)
        finished = all(f.done() for f in self._futures)
        if self._pool is not None:
            self._pool.shutdown(wait=finished)
        if self._positions is not None and finished:  # else a write may still gather
            self._positions.close()
        if self.store is not None:
            self.store.close()


def _report_failed_write(future: concurrent.futures.Future[None]) -> None:
    err = future.exception()
    if err is not None:
        log.error("a checkpoint write failed (training goes on): %r", err)
        warnings.warn(f"a checkpoint write failed (training goes on): {err!r}", stacklevel=1)
