"""``fit(..., prefetch=N)``: a background thread pulls the next ``N`` batches from the
data and places them on the devices while the step runs, so a step costs the longer of
the data and the compute, not their sum (the thread runs while the loop's thread waits
in the step's compiled call, which releases the GIL).

Every promise of the loop stands: the batches reach the loop in the order pulled (the
loop numbers them as it takes them, so the data position a checkpoint saves is the next
batch to *train*, not the next to pull); when fit stops, the thread is stopped first and
every batch it pulled and the loop did not take goes on ``err.batches`` after the
others, as the data gave it; an exception of the data source reaches the loop in its
place, after every batch pulled before it. The thread places for the step fit starts
on, and only for it: once a device left, rows are carried and the step places them
(nothing is placed ahead any more), and a batch placed for the step before is placed
again by the step from the batch as given. ``prefetch=0``: no thread (:class:`InTurn`:
a source that must be pulled on the calling thread).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import NamedTuple

from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.loop._action import Fed
from jaxstep._src.loop._action import Feeder
from jaxstep._src.loop._outcome import Resume
from jaxstep._src.loop._pending import Item
from jaxstep._src.loop._pending import Pending
from jaxstep._src.loop._pending import Placed
from jaxstep._src.loop._stopping import LateBatch
from jaxstep._src.step import Runtime

#: how long the loop waits for the thread when fit stops (a source stuck in next())
JOIN_S = 2.0
_POLL_S = 0.02  # the thread looks at its stop event this often while it waits for room
_INTERRUPT_S = 0.05  # the loop looks for a first Ctrl-C this often while it waits for data
_END = object()  # the data ended


class _Pulled(NamedTuple):
    seq: int  # batches the thread pulled before it (the loop's count too)
    batch: Any  # as the data gave it
    placed: Placed | None


class _Raised(NamedTuple):
    error: BaseException  # what next(batches) raised


class InTurn(Feeder):
    """``prefetch=0``: the batches pulled on the loop's thread as it asks for each."""

    def feed(self, batches: Iterator[Any], interrupted: Callable[[], bool]) -> Iterator[Fed]:
        """``(batch, None, wait)`` each (``wait``: the time ``next`` took)."""
        clock, end = time.perf_counter, _END
        while True:
            start = clock()
            batch = next(batches, end)
            if batch is end:
                return
            yield batch, None, clock() - start


class Prefetch(Feeder):
    """The loop's prefetch feeder: a thread pulls and places the batches ahead.

    Args:
      runtime: the runtime of the step fit starts on, the one the batches are placed
        for (until a device leaves: then nothing is placed ahead, :meth:`resumed`).
      depth: batches pulled ahead of the one the loop takes (``fit(prefetch=...)``; the
        data source keeps their positions).
      presplit: batches come ``(n_devices, per_device, ...)``: joined before placing.
      place: place them on the devices (False: pulled ahead only, placed by the step:
        under ``pmap``, the step watchdog, or while rows are carried).
      cut: this process's rows of a batch as the data gives it, the rows placed (None:
        the batch itself; ``fit(global_batches=True)`` on several processes).
    """

    def __init__(
        self,
        runtime: Runtime,
        depth: int,
        *,
        presplit: bool,
        place: bool,
        cut: Callable[[Any], Any] | None = None,
    ):
        self.runtime = runtime
        self.cut = cut
        self.presplit = presplit
        self.place = place  # as fit started
        self.placing = place  # now: paused while a failure is acted on
        # Room for batches pulled ahead: a token each (C-level queues: a Python
        # Semaphore or Queue took ~90 opcodes of the loop's thread per batch).
        self._room: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(depth):
            self._room.put(None)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # a batch is either in hand or queued, never both
        self._in_hand: _Pulled | None = None  # pulled, not queued yet
        self._pulling = False  # the thread is inside next(batches)
        #: fit stopped while the thread was inside next(batches): where its batch goes
        self._late: LateBatch | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq = 0  # batches the thread pulled (a later feed goes on counting)

    def feed(self, batches: Iterator[Any], interrupted: Callable[[], bool]) -> Iterator[Fed]:
        """The batches of ``batches``, in order, as ``(batch, placed, wait)``: the
        thread (started here, again for each call once the one before ended) pulls them
        ahead; ``wait`` is how long the loop waited for
        each. Raises what the data raised, in its place; ``KeyboardInterrupt`` when a
        first Ctrl-C (``interrupted()``) comes while the loop waits for data."""
        self._thread = threading.Thread(
            target=self._pull, args=(batches,), name="jaxstep-prefetch", daemon=True
        )
        self._thread.start()
        clock, take, room = time.perf_counter, self._queue.get, self._room.put
        while True:
            start = clock()
            try:
                entry = take(block=False)
            except queue.Empty:
                entry = self._wait(interrupted)
            if entry is _END:
                return
            if isinstance(entry, _Raised):
                raise entry.error
            room(None)  # the thread may pull the next
            yield entry.batch, entry.placed, clock() - start

    def _wait(self, interrupted: Callable[[], bool]) -> Any:
        """The next entry, waited for in slices: a first Ctrl-C stops fit at once."""
        while True:
            if interrupted():
                raise KeyboardInterrupt("fit stopped by Ctrl-C while waiting for data")
            try:
                return self._queue.get(timeout=_INTERRUPT_S)
            except queue.Empty:
                continue

    def _pull(self, batches: Iterator[Any]) -> None:
        """The thread: pulls a batch whenever there is room, places it, queues it."""
        stop, room, put, lock = self._stop, self._room.get, self._queue.put, self._lock
        seq = self._seq
        while True:
            while True:
                try:
                    room(timeout=_POLL_S)
                    break
                except queue.Empty:
                    if stop.is_set():
                        return
            if stop.is_set():
                return
            self._pulling = True
            try:
                batch = next(batches)
            except BaseException as err:
                with lock:
                    self._pulling = False
                    if self._late is not None:  # fit left meanwhile: nothing comes
                        self._late.cancel()
                        return
                # the data ended, or what it raised goes to the loop in its place; its
                # room is free again (the loop may feed the thread more: :meth:`feed`)
                self._seq = seq
                self._room.put(None)
                put(_END if isinstance(err, StopIteration) else _Raised(err))
                return
            with lock:
                self._pulling = False
                if self._late is not None:  # fit left meanwhile: err.batches takes it
                    self._late.arrive(batch)
                    return
                self._in_hand = pulled = _Pulled(seq, batch, None)
            if self.placing:
                pulled = pulled._replace(placed=self._place(batch))
            with lock:
                put(pulled)
                self._in_hand = None
            seq += 1

    def _place(self, batch: Any) -> Placed | None:
        runtime = self.runtime
        try:
            if self.cut is not None:
                batch = self.cut(batch)
            placed = runtime.place_ahead(batch, self.presplit)
        except Exception:  # the step, given the batch itself, says what is wrong
            return None
        return None if placed is None else Placed(runtime, placed)

    # -- the loop's hooks ----------------------------------------------------------

    def failed(self, pending: Pending, error: TrainingWorkerError) -> TrainingWorkerError:
        """A step failed: no batch is placed until the loop goes on (a recovery may
        take the failing device out of the step)."""
        self.placing = False
        return error

    def resumed(self, resume: Resume, number: int) -> None:
        """The loop went on from a recovery: placing again, unless a device left (rows
        are carried from now on: the step places them, so the thread never needs the
        new step)."""
        if resume.step is not None:
            self.place = False
        self.placing = self.place

    def untaken(self) -> list[Item]:
        """Stops the thread: the batches it pulled that the loop did not take, in
        order (the one it held between pulling and queueing included). A thread still
        inside ``next(batches)`` after :data:`JOIN_S` hands the batch it returns to
        :meth:`late` when it arrives."""
        self.close()
        with self._lock:
            found = []
            while True:
                try:
                    found.append(self._queue.get(block=False))
                except queue.Empty:
                    break
            if self._in_hand is not None:
                found.append(self._in_hand)
                self._in_hand = None
            if self._pulling and self._late is None:
                self._late = LateBatch()
        return [Item(e.batch, e.seq) for e in found if isinstance(e, _Pulled)]

    def late(self) -> LateBatch | None:
        """After :meth:`untaken`: the batch the thread was still pulling (None: none)."""
        return self._late

    def close(self) -> None:
        """On every way out of fit: the thread stopped and joined (a thread still inside
        ``next(batches)`` after :data:`JOIN_S` is left to finish: what it returns goes
        to ``err.batches``, see :meth:`untaken`)."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        thread.join(JOIN_S)
        self._thread = None
