"""The emergency save of a failed ``fit``: the last good state, the failing batch and
the error report, in ``<checkpoint_dir>/emergency/step_<k>/``; read back with
:func:`read_emergency` (the batch and report) and :func:`jaxstep.restore` (the state).

With several processes, each writes its own part, ``step_<k>/process_<i>/``: its rows
of the failing batch, its report and data position. The state is the same on every
process, so only the lowest-numbered live process writes it; the others' parts say
where it is (``state_in``), and :func:`jaxstep.restore` follows that. A state sharded
across processes (``shard_state``) has no whole copy on any one: each process writes its
shards beside it (:mod:`jaxstep._src.checkpoint._blocks`), and restoring needs them
all. Nothing here waits for another process: a process whose peer is lost still saves.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxstep._src.checkpoint import _blocks as blocks
from jaxstep._src.checkpoint import _coordination as coordination
from jaxstep._src.checkpoint._layout import Layout
from jaxstep._src.checkpoint._layout import local_copy
from jaxstep._src.checkpoint._position import Position
from jaxstep._src.checkpoint._store import EMERGENCY
from jaxstep._src.checkpoint._store import Store
from jaxstep._src.checkpoint._store import as_path
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.program import Pads


def save(
    directory: Any,
    error: TrainingWorkerError,
    *,
    meta: dict[str, Any],
    failing: Position,
    stacked: bool,
    devices: Sequence[jax.Device],
    pads: Pads = None,
) -> str:
    """Writes the emergency save of ``error`` under ``directory``; returns its path (the
    same path on every process of a multi-process run). ``pads``: the leaves of
    ``error.state`` its layout holds padded (written with their logical shapes)."""
    multi = len(coordination.processes(devices)) > 1
    me = jax.process_index()
    base = directory / EMERGENCY
    path, i = base / f"step_{error.step}", 2
    while (path / _part(me) if multi else path).exists():
        path, i = base / f"step_{error.step}-{i}", i + 1
    items: dict[str, Any] = {}
    if error.state is not None and multi and blocks.spread(error.state):
        # sharded across processes: each writes its shards, read from the state as it
        # is (no program runs: a lost peer cannot hold it up); restoring needs them all
        state = [_key_data(x) for x in jax.tree.leaves(error.state)]
        host, mine = blocks.to_host(state, pads)
        if mine is not None:
            blocks.write(path, error.step, me, mine)
        if coordination.is_writer():
            items["state"] = host
            meta["layout"] = Layout.of(error.state, pads=pads).to_json()
            meta["blocks"] = blocks.describe(state, coordination.processes(devices), pads)
    elif error.state is not None and (not multi or coordination.is_writer()):
        items["state"] = blocks.logical(
            jax.device_get(local_copy(error.state, stacked=stacked)), pads
        )
        meta["layout"] = Layout.of(error.state, stacked=stacked, pads=pads).to_json()
    batch = jax.tree.map(_local_rows, error.batches[0]) if error.batches else None
    meta.update(
        kind=EMERGENCY,
        state_is_good=error.state_is_good,
        data={"index": failing.index, "kind": failing.kind},
    )
    if batch is not None:
        meta["batch_layout"] = Layout.of(batch).to_json()
    if multi:
        # Process 0 writes the state (orbax writes host arrays from process 0 only);
        # every process writes its own rows, position and report, as plain files.
        part = path / _part(me)
        part.mkdir(parents=True, exist_ok=True)
        if batch is not None:
            leaves = {f"{k:05d}": x for k, x in enumerate(jax.tree.leaves(batch))}
            with (part / "batch.npz").open("wb") as f:
                np.savez(f, **leaves)
        (part / "meta.json").write_text(json.dumps({**meta, "process_index": me}, indent=2))
        (part / "report.json").write_text(json.dumps(report(error), indent=2))
        if items:
            _write(path, error.step, items, {**meta, "items": sorted(items)})
        return str(path)
    if batch is not None:
        items["batch"] = list(jax.tree.leaves(batch))
    _write(path, error.step, items, {**meta, "items": sorted(items)})
    (path / "report.json").write_text(json.dumps(report(error), indent=2))
    return str(path)


def _write(path: Any, number: int, items: dict[str, Any], meta: dict[str, Any]) -> None:
    store = Store(path, create=True)
    try:
        store.save(number, {**items, "meta": meta})
    finally:
        store.close()


def _key_data(x: Any) -> Any:
    """A typed PRNG key leaf as its key data (what a checkpoint holds)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x.addressable_data(0))
    return x


def _part(process: int) -> str:
    return f"process_{process}"


def _local_rows(x: Any) -> np.ndarray:
    """A batch leaf as this process holds it: a global array spanning processes gives
    its own rows (in the order of the global batch)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
        return np.concatenate([np.asarray(s.data) for s in shards])
    return np.asarray(jax.device_get(x))


def report(error: TrainingWorkerError) -> dict[str, Any]:
    """The error as JSON-able data: :func:`jaxstep.distributed.reports.build`'s report (device,
    process, host, step, status, leaf, reason, every failing device, the message and
    traceback) with the diagnosis, whether the state is good, and the batches held."""
    from jaxstep._src.distributed import reports

    me, origin = jax.process_index(), error.process_index
    out = reports.build(
        error,
        process_index=me,
        root_cause=origin is None or origin == me,
        root_cause_process=origin,
    )
    diagnosis = error.diagnosis
    if dataclasses.is_dataclass(diagnosis) and not isinstance(diagnosis, type):
        diagnosis = dataclasses.asdict(diagnosis)
    elif diagnosis is not None:
        diagnosis = str(diagnosis)
    out.update(
        diagnosis=diagnosis,
        state_is_good=error.state_is_good,
        microbatch=error.microbatch,
        batches_pulled_untrained=len(error.batches),
    )
    return out


@dataclasses.dataclass(frozen=True)
class Emergency:
    """An emergency save read back: the failing batch and the error report (the state
    comes back with :func:`jaxstep.restore`)."""

    step: int
    batch: Any
    report: dict[str, Any]


def read_emergency(where: str | os.PathLike[str], *, process: int | None = None) -> Emergency:
    """Reads the batch and report of an emergency save (``error.checkpoint``): what
    ``fit(..., checkpoint_dir=...)`` saved when a step failed. The state comes back with
    :func:`jaxstep.restore` (``restore(step, error.checkpoint)`` is ``error.state``).

    Args:
      where: ``error.checkpoint``.
      process: of a multi-process run's save, whose rows and report to read (default:
        this process's).

    Returns:
      ``.step`` (the failed step), ``.batch`` (the failing batch, or this process's
      rows of it: it reproduces the failure; None when it was not saved) and
      ``.report`` (the JSON report: device, process, host, step, status, leaf, reason,
      the diagnosis when there was one, every failing device, the message).

    Raises:
      FileNotFoundError: there is no emergency save at ``where`` (or no part of
        ``process`` in it).

    Example:
      >>> import tempfile, jaxstep
      >>> from jaxstep.testing import Fault, tiny_step
      >>> tiny = tiny_step(faults=[Fault("input", device_id=3, step=1)])
      >>> try:
      ...     jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3), diagnose=False,
      ...                 checkpoint_dir=tempfile.mkdtemp())
      ... except jaxstep.TrainingWorkerError as err:
      ...     saved = jaxstep.read_emergency(err.checkpoint)
      >>> saved.step, saved.report["device_id"], saved.report["status"]
      (1, 3, 'INPUT_NONFINITE|LOSS_NONFINITE|GRAD_NONFINITE')
      >>> saved.batch["x"].shape  # the failing batch: it reproduces the failure
      (16, 3)
    """
    path = as_path(where)
    part = path / _part(jax.process_index() if process is None else process)
    if part.is_dir():
        meta = json.loads((part / "meta.json").read_text())
        batch = None
        if (part / "batch.npz").exists():
            with (part / "batch.npz").open("rb") as f, np.load(io.BytesIO(f.read())) as saved:
                leaves = [saved[k] for k in sorted(saved.files)]
            batch = Layout.from_json(meta["batch_layout"]).build(leaves)
        return Emergency(int(meta["step"]), batch, json.loads((part / "report.json").read_text()))
    parts = sorted(p.name for p in path.glob("process_*"))
    if parts:
        raise FileNotFoundError(f"{str(path)!r} holds no part {part.name}; it holds {parts}")
    store = Store(path) if path.is_dir() else None
    if store is None or not store.steps():
        raise FileNotFoundError(f"no emergency save at {str(path)!r}")
    try:
        number = store.steps()[-1]
        meta = store.read(number)[0]
        batch = None
        if "batch" in meta.get("items", ()):
            leaves = store.read(number, "batch")[1]["batch"]
            batch = Layout.from_json(meta["batch_layout"]).build(leaves)
    finally:
        store.close()
    report = json.loads((path / "report.json").read_text())
    return Emergency(number, batch, report)
