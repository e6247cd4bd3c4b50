"""Metric writers: callbacks for :func:`jaxstep.fit` that write one record per finished
step (global loss, each device's loss, gradient norm and status, skipped, examples/s,
the scalar entries of ``aux``), and each recovery action of ``fit(..., recover=...)``,
to JSONL or TensorBoard, added in one line::

    jaxstep.fit(step, state, batches, callbacks=[jaxstep.JsonlWriter("run.jsonl")])
"""

from __future__ import annotations

import json
import math
import os
from typing import IO
from typing import TYPE_CHECKING
from typing import Any

import jax
import numpy as np

from jaxstep.core import HealthTable
from jaxstep.core import Status
from jaxstep.core import TrainingWorkerError
from jaxstep.loop import History
from jaxstep.loop import Recovery

if TYPE_CHECKING:
    from jaxstep.step import TrainStep


def status_name(value: int) -> str:
    """``"OK"``, ``"GRAD_NONFINITE"``, ``"INPUT_NONFINITE|LOSS_NONFINITE"``, ..."""
    status = Status(int(value))
    return "OK" if not status else str(status.name)


def failed(value: int) -> bool:
    """Whether a status is a failure (an OVERFLOW alone is recorded, not a failure)."""
    return bool(int(value) & ~int(Status.OVERFLOW))


def _number(x: Any) -> float | None:
    """A JSON-safe float: non-finite values become None (the status says why)."""
    x = float(x)
    return x if math.isfinite(x) else None


def step_record(history: History, index: int = -1) -> dict[str, Any]:
    """One finished step of ``history`` as plain, JSON-ready Python.

    Keys: ``step``, ``loss`` (mean over devices), ``skipped``, ``dropped`` and
    ``repaired`` (device ids, ``on_failure="drop"``), ``dropped_rows`` (the global
    batch rows ``[start, stop]`` of each chunk left out), ``examples_per_sec``,
    ``metrics`` (the means over devices of ``aux``'s scalar entries), ``devices`` (one
    dict per device: ``id``, ``loss``, ``grad_norm``, ``status``, ``failed``,
    ``dropped``, ``repaired``).
    Non-finite numbers are None.
    """
    dropped = [int(d) for d in history.dropped[index]]
    repaired = [int(d) for d in history.repaired[index]]
    devices = [
        {
            "id": int(device_id),
            "loss": _number(loss),
            "grad_norm": _number(norm),
            "status": status_name(status),
            "failed": failed(status),
            "dropped": int(device_id) in dropped,
            "repaired": int(device_id) in repaired,
        }
        for device_id, loss, norm, status in zip(
            history.device_ids,
            history.device_loss[index],
            history.device_grad_norm[index],
            history.status[index],
            strict=True,
        )
    ]
    return {
        "step": int(history.step[index]),
        "loss": _number(history.loss[index]),
        "skipped": bool(history.skipped[index]),
        "dropped": dropped,
        "repaired": repaired,
        "dropped_rows": [list(span) for span in history.dropped_rows[index]],
        "examples_per_sec": _number(history.examples_per_sec[index]),
        "metrics": {k: _number(v) for k, v in history.metrics[index].items()},
        "devices": devices,
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

    def _record(self, table: HealthTable) -> dict[str, Any]:
        if self.history is None or not len(self.history):
            raise RuntimeError(
                f"{type(self).__name__} got a step before fit started; pass it to "
                "jaxstep.fit(..., callbacks=[...]) rather than calling it by hand"
            )
        return step_record(self.history)


class JsonlWriter(_Writer):
    """Writes one JSON line per finished step (see :func:`step_record`), one
    ``{"event": "recovery", ...}`` line per recovery action under ``fit(...,
    recover=...)`` (see :func:`recovery_record`), where it happened among the steps,
    and one ``{"event": "failure", ...}`` line if the run fails. Step lines have no
    ``event`` key. Lines are flushed as they are written, so a crashed run keeps every
    step it finished.

    Args:
      path: the file; appended to, so a resumed run continues it.
      all_processes: write on every process of a multi-host run (give each its own
        path); by default only process 0 writes.
    """

    def __init__(self, path: str | os.PathLike[str], *, all_processes: bool = False):
        self.path = os.fspath(path)
        self.all_processes = all_processes
        self._file: IO[str] | None = None

    def _write(self, record: dict[str, Any]) -> None:
        if not self.writes:
            return
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def on_step_end(self, table: HealthTable) -> None:
        self._write(self._record(table))

    def on_recovery(self, record: Recovery) -> None:
        self._write(recovery_record(record))

    def on_failure(self, error: TrainingWorkerError) -> None:
        self._write(failure_record(error))
        self.close()

    def on_fit_end(self, history: History) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
