"""Metric writers: callbacks for :func:`jaxstep.fit` that write one record per finished
step (global loss, each device's loss, gradient norm and status, skipped, examples/s,
the scalar entries of ``aux``), and each recovery action of ``fit(..., recover=...)``,
to JSONL or TensorBoard, added in one line::

    jaxstep.fit(step, state, batches, callbacks=[jaxstep.JsonlWriter("run.jsonl")])
"""

from __future__ import annotations

import atexit
import json
import math
import os
import queue
import threading
from typing import TYPE_CHECKING
from typing import Any

import jax
import numpy as np

from jaxstep.core import HealthTable
from jaxstep.core import Status
from jaxstep.core import TrainingWorkerError
from jaxstep.loop import Entry
from jaxstep.loop import History
from jaxstep.loop import Recovery

if TYPE_CHECKING:
    from jaxstep.step import TrainStep


def status_name(value: int) -> str:
    """``"OK"``, ``"GRAD_NONFINITE"``, ``"INPUT_NONFINITE|LOSS_NONFINITE"``, ..."""
    value = int(value)
    name = _NAMES.get(value)
    if name is None:  # an IntFlag's name is built on each call: keep each one made
        status = Status(value)
        name = _NAMES[value] = "OK" if not status else str(status.name)
    return name


_NAMES: dict[int, str] = {}
_NOT_OVERFLOW = ~int(Status.OVERFLOW)


def failed(value: int) -> bool:
    """Whether a status is a failure (an OVERFLOW alone is recorded, not a failure)."""
    return bool(int(value) & _NOT_OVERFLOW)


def _number(x: Any) -> float | None:
    """A JSON-safe float: non-finite values become None (the status says why)."""
    x = float(x)
    return x if math.isfinite(x) else None


def step_record(history: History, index: int = -1) -> dict[str, Any]:
    """One finished step of ``history`` as plain, JSON-ready Python.

    Keys: ``step``, ``loss`` (mean over devices), ``skipped``, ``dropped`` and
    ``repaired`` (device ids, ``on_failure="drop"``), ``dropped_rows`` (the global
    batch rows ``[start, stop]`` of each chunk left out), ``examples_per_sec``,
    ``data_wait`` (seconds the loop waited for the step's batch), ``metrics`` (the
    means over devices of ``aux``'s scalar entries), ``devices`` (one dict per device:
    ``id``, ``loss``, ``grad_norm``, ``status``, ``failed``, ``dropped``,
    ``repaired``). Non-finite numbers are None.
    """
    return _record(
        int(history.step[index]),
        history.loss[index],
        bool(history.skipped[index]),
        history.device_ids,
        np.asarray(history.device_loss[index], np.float64).tolist(),
        np.asarray(history.device_grad_norm[index], np.float64).tolist(),
        np.asarray(history.status[index]).tolist(),
        [int(d) for d in history.dropped[index]],
        [int(d) for d in history.repaired[index]],
        [list(span) for span in history.dropped_rows[index]],
        history.examples_per_sec[index],
        history.data_wait[index] if history.data_wait else 0.0,
        history.metrics[index],
    )


def table_record(table: HealthTable, entry: Entry) -> dict[str, Any]:
    """:func:`step_record` of a step from its table and what the history holds beside
    it (``History.last()``), with nothing of the history read: what
    :class:`JsonlWriter`'s thread builds for each step, off the training loop."""
    ids, columns, rows = entry.device_ids, entry.columns, entry.rows
    out = table.dropped != 0
    kept = table.loss[~out] if out.any() else table.loss
    loss = float(np.add.reduce(kept) / max(kept.size, 1))  # as History.loss
    losses = table.loss.astype(np.float64).tolist()
    norms = table.grad_norm.astype(np.float64).tolist()
    statuses = table.status.tolist()
    left = np.flatnonzero(out).tolist()
    mended = np.flatnonzero(table.repaired).tolist()
    spans = [[j * rows, (j + 1) * rows] for j in left] if rows else []
    if columns is not None:  # a step on fewer devices: a column for every device of the run
        at = [int(c) for c in columns]
        losses, norms, statuses = _widen(at, len(ids), losses, norms, statuses)
        left, mended = [at[j] for j in left], [at[j] for j in mended]
    return _record(
        table.step,
        loss,
        table.skipped,
        ids,
        losses,
        norms,
        statuses,
        [int(ids[j]) for j in left] if ids else [],
        [int(ids[j]) for j in mended] if ids else [],
        spans,
        entry.examples_per_sec,
        entry.data_wait,
        entry.metrics,
    )


def _widen(at: list[int], n: int, *values: list[Any]) -> tuple[list[Any], ...]:
    """Each of ``values`` (one entry per device of a step) with one per device of the
    run: at ``at``, and NaN (status 0) for the devices that no longer ran."""
    wide = []
    for column, fill in zip(values, (math.nan, math.nan, 0), strict=True):
        full = [fill] * n
        for j, value in zip(at, column, strict=True):
            full[j] = value
        wide.append(full)
    return tuple(wide)


def _record(
    step: int,
    loss: float,
    skipped: bool,
    ids: list[int],
    losses: list[float],
    norms: list[float],
    statuses: list[int],
    dropped: list[int],
    repaired: list[int],
    dropped_rows: list[list[int]],
    examples_per_sec: float,
    data_wait: float,
    metrics: dict[str, float],
) -> dict[str, Any]:
    return {
        "step": step,
        "loss": _number(loss),
        "skipped": skipped,
        "dropped": dropped,
        "repaired": repaired,
        "dropped_rows": dropped_rows,
        "examples_per_sec": _number(examples_per_sec),
        "data_wait": _number(data_wait),
        "metrics": {k: _number(v) for k, v in metrics.items()},
        "devices": [
            {
                "id": int(device_id),
                "loss": loss if math.isfinite(loss) else None,
                "grad_norm": norm if math.isfinite(norm) else None,
                "status": status_name(status),
                "failed": failed(status),
                "dropped": device_id in dropped,
                "repaired": device_id in repaired,
            }
            for device_id, loss, norm, status in zip(ids, losses, norms, statuses, strict=True)
        ],
    }


def step_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A :func:`step_record` as the flat scalars a metric writer draws as curves:
    ``loss``, ``examples_per_sec``, ``skipped``, ``dropped`` (how many devices),
    ``metrics/<name>`` for each scalar of ``aux``, and ``device_<id>/loss``,
    ``device_<id>/grad_norm``, ``device_<id>/failed``, ``device_<id>/dropped`` per
    device. A non-finite number (None in the record) is NaN again: a curve shows it as
    a gap, and the step stays on it."""
    scalars = {
        "loss": record["loss"],
        "examples_per_sec": record["examples_per_sec"],
        "data_wait": record.get("data_wait"),
        "skipped": float(record["skipped"]),
        "dropped": float(len(record["dropped"])),
    }
    scalars.update({f"metrics/{k}": v for k, v in record["metrics"].items()})
    for d in record["devices"]:
        scalars[f"device_{d['id']}/loss"] = d["loss"]
        scalars[f"device_{d['id']}/grad_norm"] = d["grad_norm"]
        scalars[f"device_{d['id']}/failed"] = float(d["failed"])
        scalars[f"device_{d['id']}/dropped"] = float(d["dropped"])
    return {tag: np.nan if value is None else float(value) for tag, value in scalars.items()}


def failure_record(error: TrainingWorkerError) -> dict[str, Any]:
    """The failure of a run as JSON-ready Python (``event: "failure"``)."""
    return {
        "event": "failure",
        "step": int(error.step),
        "device_id": int(error.device_id),
        "process_index": int(error.process_index),
        "status": status_name(error.status),
        "reason": error.reason,
        "leaf": error.leaf,
        "failures": [
            {"device_id": int(f.device_id), "status": status_name(f.status), "reason": f.reason}
            for f in error.failures
        ],
        "diagnosis": None if error.diagnosis is None else str(error.diagnosis),
        "message": str(error),
    }


def recovery_record(record: Recovery) -> dict[str, Any]:
    """A recovery action as JSON-ready Python (``event: "recovery"``): the fields of
    :meth:`Recovery.to_json` and the ``message`` a person reads."""
    return {"event": "recovery", **record.to_json(), "message": str(record)}


class _Writer:
    """What both writers share: the run's :class:`History`, handed over by ``fit``, and
    writing on one process only (every process of a multi-host run holds the same
    table, so one copy is the whole record)."""

    history: History | None = None
    all_processes: bool = False

    def on_fit_start(self, step: TrainStep, history: History) -> None:
        self.history = history

    @property
    def writes(self) -> bool:
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
    """Writes one JSON line per finished step (see :func:`step_record`), one
    ``{"event": "recovery", ...}`` line per recovery action under ``fit(...,
    recover=...)`` (see :func:`recovery_record`), where it happened among the steps,
    and one ``{"event": "failure", ...}`` line if the run fails. Step lines have no
    ``event`` key.

    A writer thread builds each step's line from its health table, encodes and writes
    it (off the training loop's thread: a line took longer than a small model's whole
    host step), and flushes whenever it has caught up, so a crashed run keeps every step
    it finished but the last few; at a failure, at the end of fit, at :meth:`close` and
    at exit every line is written before the file closes.

    Args:
      path: the file; appended to, so a resumed run continues it.
      all_processes: write on every process of a multi-host run (give each its own
        path); by default only process 0 writes.
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
        if self.writes:
            self._write((table, self._entry()))

    def on_recovery(self, record: Recovery) -> None:
        if self.writes:
            self._write(recovery_record(record))

    def on_failure(self, error: TrainingWorkerError) -> None:
        if self.writes:
            self._write(failure_record(error))
        self.close()

    def on_fit_end(self, history: History) -> None:
        self.close()

    def close(self) -> None:
        """Writes every queued line and closes the file (the writer thread ends; the
        next line starts another)."""
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
    tensorboardX): ``loss``, ``examples_per_sec``, ``skipped``, ``metrics/<name>``
    for each scalar of ``aux``, and ``device_<id>/loss``, ``device_<id>/grad_norm``,
    ``device_<id>/failed`` per device (see :func:`step_scalars`); a failure is written
    as text (``failure``).
    Under ``fit(..., recover=...)`` each recovery action adds, at its step, the scalar
    ``recoveries`` (the count so far) and the text ``recovery`` (the record in words).

    Args:
      logdir: the directory for the event files (``tensorboard --logdir``).
      all_processes: write on every process of a multi-host run (give each its own
        directory); by default only process 0 writes.

    Raises:
      ImportError: tensorboardX is missing (``pip install 'jaxstep[demo]'``).
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
        if self.writer is None:
            return
        record = self._record(table)
        for tag, value in step_scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def on_recovery(self, record: Recovery) -> None:
        self.recoveries += 1
        if self.writer is not None:
            self.writer.add_scalar("recoveries", float(self.recoveries), record.step)
            self.writer.add_text("recovery", str(record), record.step)

    def on_failure(self, error: TrainingWorkerError) -> None:
        if self.writer is not None:
            self.writer.add_text("failure", str(error), int(error.step))
        self.close()

    def on_fit_end(self, history: History) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
