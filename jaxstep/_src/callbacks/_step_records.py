"""A run's steps, recoveries and failure as plain, JSON-ready Python: what the metric
writers (JSONL, TensorBoard, CLU) write. Non-finite numbers are None in a record (the
status says why) and NaN again in its scalars (a gap in a curve)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxstep._src.core import HealthTable
from jaxstep._src.core import Status
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.loop import Entry
from jaxstep._src.loop import History
from jaxstep._src.loop import Recovery


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


def goodput_record(history: History) -> dict[str, Any]:
    """The ``{"event": "goodput", ...}`` line of a run that ended:
    :meth:`jaxstep.Goodput.to_dict` of ``history.goodput()``."""
    return {"event": "goodput", **history.goodput().to_dict()}


def goodput_scalars(history: History) -> tuple[int, dict[str, float]]:
    """The goodput figures of a run that ended as scalars (``goodput``,
    ``goodput/wall_s``, ``goodput/productive_s``, ``goodput/badput/<bucket>``,
    ``goodput/steps/<count>``), and the step to write them at (the last one's)."""
    report = history.goodput()
    scalars = {
        "goodput": report.goodput,
        "goodput/wall_s": report.wall_s,
        "goodput/productive_s": report.productive_s,
    }
    scalars |= {f"goodput/badput/{k}": v for k, v in report.badput.items()}
    scalars |= {f"goodput/steps/{k}": float(v) for k, v in report.steps.items()}
    return (history.step[-1] + 1 if len(history) else 0), scalars
