"""Metric writers: callbacks for :func:`jaxstep.fit` that write one record per finished
step (global loss, each device's loss, gradient norm and status, skipped, examples/s,
the scalar entries of ``aux``), and each recovery action of ``fit(..., recover=...)``,
to JSONL or TensorBoard, added in one line::

    jaxstep.fit(step, state, batches, callbacks=[jaxstep.JsonlWriter("run.jsonl")])
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import threading
from typing import TYPE_CHECKING
from typing import Any

import jax

from jaxstep._src.callbacks._step_records import failure_record
from jaxstep._src.callbacks._step_records import goodput_record
from jaxstep._src.callbacks._step_records import goodput_scalars
from jaxstep._src.callbacks._step_records import recovery_record
from jaxstep._src.callbacks._step_records import step_scalars
from jaxstep._src.callbacks._step_records import table_record
from jaxstep._src.core import HealthTable
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.loop import Callback
from jaxstep._src.loop import Entry
from jaxstep._src.loop import History
from jaxstep._src.loop import Recovery

if TYPE_CHECKING:
    from jaxstep._src.step import TrainStep


class _Writer(Callback):
    """What the writers share: the run's :class:`History`, handed over by ``fit``, and
    writing on one process only (every process of a multi-host run holds the same
    table, so one copy is the whole record)."""

    #: The run's History, from ``fit`` (None before ``fit`` started).
    history: History | None = None
    #: Whether every process of a multi-host run writes (else only process 0).
    all_processes: bool = False

    def on_fit_start(self, step: TrainStep, history: History) -> None:
        """Called by ``fit`` before the first step: keeps the run's ``history``, which
        each step's record reads.

        Args:
          step: the step ``fit`` runs.
          history: the :class:`jaxstep.History` ``fit`` fills.
        """
        self.history = history

    @property
    def writes(self) -> bool:
        """Whether this process writes: every process with ``all_processes``, else
        process 0 alone."""
        return self.all_processes or jax.process_index() == 0

    def _entry(self) -> Entry:
        """The newest step's entries beside its table (what its record needs)."""
        if self.history is None or not len(self.history):
            raise RuntimeError(
                f"{type(self).__name__} got a step before fit started; pass it to "
                "jaxstep.fit(..., callbacks=[...]) rather than calling it by hand"
            )
        return self.history.last()

    def _record(self, table: HealthTable) -> dict[str, Any]:
        return table_record(table, self._entry())


class JsonlWriter(_Writer):
    """Writes one JSON line per finished step, one ``{"event": "recovery", ...}`` line
    per recovery action under ``fit(..., recover=...)``, where it happened among the
    steps, one ``{"event": "failure", ...}`` line if the run fails (its last), and one
    ``{"event": "goodput", ...}`` line when ``fit`` returns (its last:
    :meth:`jaxstep.Goodput.to_dict`; after a failure ``err``'s history has it).

    A step's line has no ``event`` key; its keys are ``step``, ``loss`` (the mean over
    devices), ``skipped``, ``dropped`` and ``repaired`` (device ids, under
    ``on_failure="drop"``), ``dropped_rows`` (the global batch rows ``[start, stop]``
    of each chunk left out), ``examples_per_sec``, ``data_wait`` (seconds the loop
    waited for the step's batch), ``metrics`` (the means over devices of ``aux``'s
    scalars) and ``devices`` (one dict a device: ``id``, ``loss``, ``grad_norm``,
    ``status``, ``failed``, ``dropped``, ``repaired``). The JSON is strict:
    non-finite numbers are ``null`` (the status says why). A recovery's line holds
    :meth:`jaxstep.Recovery.to_json` and a ``message``; a failure's, the error's
    fields and message.

    A writer thread builds each step's line from its health table, encodes and writes
    it (off the training loop's thread: a line took longer than a small model's whole
    host step), and flushes whenever it has caught up, so a crashed run keeps every step
    it finished but the last few; at a failure, at the end of fit, at :meth:`close` and
    at exit every line is written before the file closes.

    Args:
      path: the file; appended to, so a resumed run continues it.
      all_processes: write on every process of a multi-host run (give each its own
        path); by default only process 0 writes.

    Example:
      >>> import jaxstep, json, os, tempfile
      >>> tiny = jaxstep.testing.tiny_step(divergence_every=None)
      >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
      >>> state = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3),
      ...                     callbacks=[jaxstep.JsonlWriter(path)])
      >>> [json.loads(line).get("step", "end") for line in open(path)]
      [0, 1, 2, 'end']
      >>> sorted(json.loads(open(path).readlines()[-1]))  # the run's goodput
      ['badput', 'event', 'goodput', 'productive_s', 'steps', 'wall_s']
    """

    def __init__(self, path: str | os.PathLike[str], *, all_processes: bool = False):
        self.path = os.fspath(path)
        self.all_processes = all_processes
        self._queue: queue.SimpleQueue[Any] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None  # the writer thread's, raised here

    def _write(self, record: Any) -> None:
        """Queues ``record`` (a dict, or a step's ``(table, entry)``) for the thread."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=self._writer, args=(self._queue,), name="jaxstep-jsonl", daemon=True
            )
            self._thread.start()
            atexit.register(self.close)  # daemon threads die at exit: write what is queued
        self._queue.put(record)

    def _writer(self, records: queue.SimpleQueue[Any]) -> None:
        encode = json.JSONEncoder(allow_nan=False).encode
        try:
            with open(self.path, "a", encoding="utf-8") as file:
                while (record := records.get()) is not None:
                    if isinstance(record, tuple):  # a step: its line built here
                        record = table_record(*record)
                    file.write(encode(record) + "\n")
                    if records.empty():  # caught up: on disk before waiting again
                        file.flush()
        except BaseException as err:  # raised on the loop's thread at the next write
            self._error = err

    def on_step_end(self, table: HealthTable) -> None:
        """Called by ``fit`` after each step: queues the step's line.

        Args:
          table: the step's :class:`jaxstep.HealthTable`.

        Raises:
          OSError: the writer thread could not write an earlier line.
        """
        if self.writes:
            self._write((table, self._entry()))

    def on_recovery(self, record: Recovery) -> None:
        """Called by ``fit(recover=...)`` after each recovery: queues its line.

        Args:
          record: the :class:`jaxstep.Recovery` taken.
        """
        if self.writes:
            self._write(recovery_record(record))

    def on_failure(self, error: TrainingWorkerError) -> None:
        """Called by ``fit`` when a step fails: writes the failure's line, then every
        queued line, and closes the file.

        Args:
          error: the :class:`jaxstep.TrainingWorkerError` ``fit`` raises next.
        """
        if self.writes:
            self._write(failure_record(error))
        self.close()

    def on_fit_end(self, history: History) -> None:
        """Called by ``fit`` when it returns: writes every queued line and closes the
        file (:meth:`close`).

        Args:
          history: the run's :class:`jaxstep.History`.
        """
        if self.writes:
            self._write(goodput_record(history))
        self.close()

    def close(self) -> None:
        """Writes every queued line and closes the file (the writer thread ends; the
        next line starts another).

        Raises:
          OSError: the writer thread could not write a line.
        """
        thread, records = self._thread, self._queue
        self._thread = self._queue = None
        if thread is not None and records is not None:
            records.put(None)
            thread.join()
            atexit.unregister(self.close)
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class TensorBoardWriter(_Writer):
    """Writes each finished step's scalars to TensorBoard event files (through
    tensorboardX): ``loss``, ``examples_per_sec``, ``data_wait``, ``skipped``,
    ``dropped`` (how many devices), ``metrics/<name>`` for each scalar of ``aux``, and
    ``device_<id>/loss``, ``device_<id>/grad_norm``, ``device_<id>/failed``,
    ``device_<id>/dropped`` per device; a non-finite value is NaN (a gap in the
    curve). A failure is written as text (``failure``).
    Under ``fit(..., recover=...)`` each recovery action adds, at its step, the scalar
    ``recoveries`` (the count so far) and the text ``recovery`` (the record in words).

    Args:
      logdir: the directory for the event files (``tensorboard --logdir``).
      all_processes: write on every process of a multi-host run (give each its own
        directory); by default only process 0 writes.

    Raises:
      ImportError: tensorboardX is missing (``pip install 'jaxstep[demo]'``).

    Example:
      >>> import os, tempfile, jaxstep
      >>> tiny = jaxstep.testing.tiny_step(divergence_every=None)
      >>> logdir = tempfile.mkdtemp()
      >>> state = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(2),
      ...                     callbacks=[jaxstep.TensorBoardWriter(logdir)])
      >>> [name.split(".")[:3] for name in os.listdir(logdir)]
      [['events', 'out', 'tfevents']]
    """

    def __init__(self, logdir: str | os.PathLike[str], *, all_processes: bool = False):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "TensorBoardWriter writes through tensorboardX: pip install 'jaxstep[demo]' "
                "(or pip install tensorboardX)"
            ) from err
        self.logdir = os.fspath(logdir)
        self.all_processes = all_processes
        self.writer = SummaryWriter(self.logdir) if self.writes else None
        self.recoveries = 0  # written so far (the ``recoveries`` scalar)

    def on_step_end(self, table: HealthTable) -> None:
        """Called by ``fit`` after each step: writes the step's scalars at its step.

        Args:
          table: the step's :class:`jaxstep.HealthTable`.
        """
        if self.writer is None:
            return
        record = self._record(table)
        for tag, value in step_scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def on_recovery(self, record: Recovery) -> None:
        """Called by ``fit(recover=...)`` after each recovery: writes the count so far
        (``recoveries``) and the record in words (``recovery``) at its step.

        Args:
          record: the :class:`jaxstep.Recovery` taken.
        """
        self.recoveries += 1
        if self.writer is not None:
            self.writer.add_scalar("recoveries", float(self.recoveries), record.step)
            self.writer.add_text("recovery", str(record), record.step)

    def on_failure(self, error: TrainingWorkerError) -> None:
        """Called by ``fit`` when a step fails: writes the message as the text
        ``failure`` at the failed step, and closes the event file.

        Args:
          error: the :class:`jaxstep.TrainingWorkerError` ``fit`` raises next.
        """
        if self.writer is not None:
            self.writer.add_text("failure", str(error), int(error.step))
        self.close()

    def on_fit_end(self, history: History) -> None:
        """Called by ``fit`` when it returns: flushes the event file (it stays open
        for a next ``fit`` call).

        Args:
          history: the run's :class:`jaxstep.History`.
        """
        if self.writer is not None:
            at, scalars = goodput_scalars(history)
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, at)
            self.writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file."""
        if self.writer is not None:
            self.writer.close()
