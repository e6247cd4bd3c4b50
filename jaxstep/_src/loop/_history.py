"""The record of a run: one entry per finished step, kept as the step's raw health
table in a preallocated block and decoded into the fields a reader sees, all at once,
when one is first read (:class:`History`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import numpy as np

from jaxstep._src.core import COL
from jaxstep._src.core import HealthTable
from jaxstep._src.core import health
from jaxstep._src.loop._goodput import Goodput
from jaxstep._src.loop._ledger import Ledger
from jaxstep._src.loop._records import ACTIONS
from jaxstep._src.loop._records import Recovery


class Entry(NamedTuple):
    """What the history holds of one step beside its health table (:meth:`History.last`):
    enough to write the step from its table alone, without decoding the history."""

    device_ids: list[int]
    metrics: dict[str, float]
    examples_per_sec: float
    data_wait: float
    rows: int  # rows per device of the step's batch (0: unknown)
    columns: Any  # None, or the positions in device_ids of the table's devices


class _Decoded:
    """A field of :class:`History` filled from the tables appended, decoded when it is
    first read (all the waiting tables at once)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, history: History | None, owner: type | None = None) -> Any:
        if history is None:
            return self
        if history._waiting:
            history._decode()
        return getattr(history, self.slot)

    def __set__(self, history: History, value: Any) -> None:
        if history._waiting:
            history._decode()
        setattr(history, self.slot, value)


# The step's fields decoded from its table, and those the history keeps beside it.
_TABLE_FIELDS = (
    "step",
    "loss",
    "device_loss",
    "device_grad_norm",
    "status",
    "skipped",
    "dropped",
    "repaired",
    "dropped_rows",
)
_FIELDS = (*_TABLE_FIELDS, "metrics", "examples_per_sec", "data_wait")
# per-device columns: those before the step-wide ones, and the drop policy's
_PER_DEVICE = [*range(COL["step"]), COL["dropped"], COL["repaired"], COL["consecutive_drops"]]
_FLOAT_AT = [COL[name] for name in sorted(health.FLOAT_COLUMNS)]
_NAN = int(np.float32(np.nan).view(np.int32))
_FIRST = 64  # entries of a fresh block (it doubles when full)


class History:
    """Per-step record of a run, one entry per finished step, for reading or plotting.

    Each field is a list with one entry per step. :func:`fit` appends each step's
    raw health table to a preallocated block (its only work per step); the fields are
    decoded from the block, all the waiting steps at once, when one of them is first
    read. Built empty (``History()``) for :func:`fit` to fill, or from saved lists.

    Args:
      device_ids: see the attribute.
      recoveries: see the attribute.
      left_over: see the attribute.
      **fields: any of the per-step fields below (``step``, ``loss``, ...), each a
        list with one entry per step: a history rebuilt from saved lists.

    Attributes:
      device_ids: the ``jax.Device.id`` of each column of the per-device fields.
      step: ``state.step`` each step started from.
      loss: the mean over devices (under ``drop`` over the chunks the step trained on).
      device_loss: per device, ``(n,)`` arrays: each device's own loss.
      device_grad_norm: per device, ``(n,)`` arrays: the norm of each device's own
        gradient, before the all-reduce.
      status: per device, ``(n,)`` arrays of :class:`Status` bits.
      skipped: whether the update was discarded (``skip`` policy).
      dropped: ``on_failure="drop"``: the ``jax.Device.id`` s left out of each step's
        mean (empty when none).
      repaired: the ``jax.Device.id`` s whose replica was repaired from the majority.
      dropped_rows: the global batch rows ``(start, stop)`` of each chunk left out, in
        the order of ``dropped`` (empty when the rows per device are unknown).
      metrics: the mean over devices of each scalar entry of the step's ``aux``.
      examples_per_sec: global examples over the wall time since the previous step
        finished (the first step's includes compiling).
      data_wait: seconds the loop waited for the step's batch from the data (pulling
        it, or with ``fit(prefetch=...)`` taking it from the prefetched ones): a slow
        input pipeline shows here, a slow step does not.
      recoveries: ``fit(..., recover=...)``: each recovery action, in the order taken.
      ledger: where each fit call's time went, in spans (fit writes it; read it
        through :meth:`goodput`).
      left_over: rows never trained because the data ended while they were carried (a
        run that lost a device carries the rows that do not divide by the devices left
        into the next step, each shape's until a batch of its shape comes):
        ``(batch, first row, stop)`` of each stretch, the batch counted from the data's
        first (0), its rows every process's together (the same on every process).

    Example:
      >>> import jaxstep
      >>> tiny = jaxstep.testing.tiny_step(divergence_every=None)
      >>> history = jaxstep.History()
      >>> state = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3), history=history)
      >>> history.step, len(history.device_ids), history.device_loss[0].shape
      ([0, 1, 2], 8, (8,))
      >>> history.loss[-1] < history.loss[0]
      True
    """

    step = _Decoded()
    loss = _Decoded()
    device_loss = _Decoded()
    device_grad_norm = _Decoded()
    status = _Decoded()
    skipped = _Decoded()
    dropped = _Decoded()
    repaired = _Decoded()
    dropped_rows = _Decoded()
    metrics = _Decoded()
    examples_per_sec = _Decoded()
    data_wait = _Decoded()
    # where the decoded fields are kept (the descriptors above read them)
    _step: list[int]
    _loss: list[float]
    _device_loss: list[np.ndarray]
    _device_grad_norm: list[np.ndarray]
    _status: list[np.ndarray]
    _skipped: list[bool]
    _dropped: list[tuple[int, ...]]
    _repaired: list[tuple[int, ...]]
    _dropped_rows: list[tuple[tuple[int, int], ...]]
    _metrics: list[dict[str, float]]
    _examples_per_sec: list[float]
    _data_wait: list[float]

    def __init__(
        self,
        device_ids: Sequence[int] | None = None,
        *,
        recoveries: Sequence[Recovery] = (),
        left_over: Sequence[tuple[int, int, int]] = (),
        **fields: Sequence[Any],
    ):
        unknown = set(fields) - set(_FIELDS)
        if unknown:
            raise TypeError(f"History got unknown fields {sorted(unknown)}; its fields: {_FIELDS}")
        self._waiting = 0  # entries of the block not decoded yet
        self._block: np.ndarray | None = None  # (capacity, n, columns) int32 tables
        self._meta = np.empty((0, 3))  # per entry: examples/s, data wait, rows
        self._sparse: dict[int, tuple[Any, Any]] = {}  # entry -> (metrics, columns)
        self._newest: tuple[int, Any] = (0, None)  # the newest entry's rows and columns
        self.device_ids: list[int] = list(device_ids or ())
        for name in _FIELDS:
            setattr(self, "_" + name, list(fields.get(name, ())))
        self.recoveries: list[Recovery] = list(recoveries)
        self.left_over: list[tuple[int, int, int]] = list(left_over)
        self.ledger = Ledger()  # (the ledger attribute, above)

    def __repr__(self) -> str:
        return f"History({len(self)} steps, device_ids={self.device_ids})"

    def __len__(self) -> int:
        return len(self._metrics) + self._waiting

    def append(
        self,
        table: HealthTable | np.ndarray,
        metrics: dict[str, float] | None = None,
        examples_per_sec: float = math.nan,
        rows: int = 0,
        columns: Any = None,
        data_wait: float = 0.0,
    ) -> None:
        """Adds a finished step (what :func:`fit` calls once per step): its table is
        copied into the block and decoded into the fields when one is first read.

        Args:
          table: a :class:`HealthTable`, or the raw int32 array the step returned.
          metrics: the mean over devices of each scalar of the step's ``aux``.
          examples_per_sec: the step's rate.
          rows: rows per device of the step's batch (for ``dropped_rows``).
          columns: once a device left the run, the position in ``device_ids`` of each
            of the table's devices (the per-device fields keep a column for every
            device the run started with: NaN loss and status 0 where a device no
            longer ran).
          data_wait: seconds the loop waited for the step's batch.
        """
        raw = table if isinstance(table, np.ndarray) else table.to_array()
        if columns is not None:
            raw = _widen(raw, columns, len(self.device_ids))
        k, block = self._waiting, self._block
        if block is None or k == len(block) or block.shape[1] != raw.shape[0]:
            block = self._grow(raw.shape)
        block[k] = raw
        self._meta[k] = (examples_per_sec, data_wait, rows)
        if metrics or columns is not None:
            self._sparse[k] = (dict(metrics) if metrics else None, columns)
        if rows != self._newest[0] or columns is not None or self._newest[1] is not None:
            self._newest = (rows, columns)
        self._waiting = k + 1

    def last(self) -> Entry:
        """The newest step's entries beside its table, without decoding anything (what
        the metric writers read each step).

        Returns:
          An :class:`Entry` (the device ids, metrics, rate, data wait, rows, columns).
        """
        k, (rows, columns) = self._waiting - 1, self._newest
        if k < 0:  # decoded already
            wait = self._data_wait[-1] if self._data_wait else 0.0
            rate = self._examples_per_sec[-1]
            return Entry(self.device_ids, self._metrics[-1], rate, wait, rows, columns)
        rate, wait, _ = self._meta[k].tolist()
        metrics = self._sparse.get(k, (None, None))[0]
        return Entry(self.device_ids, metrics or {}, rate, wait, rows, columns)

    def _grow(self, shape: tuple[int, ...]) -> np.ndarray:
        """A block with room for the next entry (tables of ``shape``): twice as large
        when full, a new one (the waiting entries decoded first) for another shape."""
        block, k = self._block, self._waiting
        if block is not None and block.shape[1:] != shape:
            self._decode()
            block, k = None, 0
        size = _FIRST if block is None else 2 * len(block)
        grown = np.empty((size, *shape), np.int32)
        meta = np.empty((size, 3))
        if block is not None:
            grown[:k], meta[:k] = block[:k], self._meta[:k]
        self._block, self._meta = grown, meta
        return grown

    def _decode(self) -> None:
        """Every waiting entry, decoded into the fields at once (long because each
        field is one vectorised pass over the block, in one place)."""
        k, block = self._waiting, self._block
        if not k or block is None:
            return
        self._waiting = 0  # first: the block is free again once this returns
        sparse, self._sparse = self._sparse, {}
        raw = block[:k]
        first = raw[:, 0, :]  # the step-wide columns, the same in every row
        floats = raw.view(np.float32)
        device_loss = floats[:, :, COL["loss"]].copy()
        n = device_loss.shape[1]
        losses = np.add.reduce(device_loss, axis=1) / n
        means: list[float] = losses.tolist()
        dropped = raw[:, :, COL["dropped"]] != 0
        repaired = raw[:, :, COL["repaired"]] != 0
        rates, waits, rows = self._meta[:k].T.tolist()
        ids = self.device_ids
        left: list[tuple[int, ...]] = [()] * k
        mended: list[tuple[int, ...]] = [()] * k
        spans: list[tuple[tuple[int, int], ...]] = [()] * k
        metrics: list[dict[str, float]] = [{} for _ in range(k)]
        marked = np.flatnonzero(dropped.any(axis=1) | repaired.any(axis=1)).tolist()
        for i in sorted({*marked, *sparse}):
            if i in sparse:
                metrics[i] = sparse[i][0] or {}
            columns = None if i not in sparse else sparse[i][1]
            own = slice(None) if columns is None else np.asarray(columns)
            out = dropped[i, own]  # the step's own devices, in its order
            if columns is not None or out.any():  # the mean over the chunks it trained on
                kept = device_loss[i, own][~out]
                means[i] = float(np.add.reduce(kept) / max(kept.size, 1))
            if ids:
                left[i] = tuple(ids[j] for j in np.flatnonzero(dropped[i]).tolist())
                mended[i] = tuple(ids[j] for j in np.flatnonzero(repaired[i]).tolist())
            size = int(rows[i])
            if size:  # chunk j: the rows of the step's position j
                spans[i] = tuple((j * size, (j + 1) * size) for j in np.flatnonzero(out).tolist())
        self._step += first[:, COL["step"]].tolist()
        self._loss += means
        self._device_loss += list(device_loss)
        self._device_grad_norm += list(floats[:, :, COL["grad_norm"]].copy())
        self._status += list(raw[:, :, COL["status"]].copy())
        self._skipped += (first[:, COL["skipped"]] != 0).tolist()
        self._dropped += left
        self._repaired += mended
        self._dropped_rows += spans
        self._metrics += metrics
        self._examples_per_sec += rates
        self._data_wait += waits

    def goodput(self) -> Goodput:
        """Where the job's time went: the share of it that trained steps whose update
        was kept (every fit call that filled this history, and with ``checkpoint_dir``
        every process before a restart), and the rest by bucket. Also after ``fit``
        raised: the history it filled holds the time up to the failure.

        Returns:
          A :class:`jaxstep.Goodput` (``print`` it for a table).

        Example:
          >>> import jaxstep
          >>> tiny = jaxstep.testing.tiny_step()
          >>> history = jaxstep.History()
          >>> _ = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3), history=history)
          >>> report = history.goodput()
          >>> report.steps["productive"], sorted(report.badput)[:3]
          (3, ['checkpoint', 'data', 'diagnosis'])
        """
        return Goodput.of(self)

    def recovery_summary(self) -> str:
        """``recoveries`` in words, for the end of a run.

        Returns:
          A count of each action, then one line a record; ``""`` when there were none.

        >>> h = History(recoveries=[Recovery(5, "transient", "retried")])
        >>> print(h.recovery_summary())
        jaxstep: 1 recovery action: 1 retried
          step 5: transient -> retried
        """
        records = self.recoveries
        if not records:
            return ""
        counts = []
        for action in ACTIONS:
            taken = [r for r in records if r.action == action]
            if not taken:
                continue
            count = f"{len(taken)} {action}"
            if action == "excluded":  # who is gone for the rest of the run
                ids = sorted({d for r in taken for d in r.device_ids})
                count += f" (device {', '.join(map(str, ids))})" if ids else ""
            counts.append(count)
        actions = "action" if len(records) == 1 else "actions"
        head = f"jaxstep: {len(records)} recovery {actions}: {', '.join(counts)}"
        return "\n".join([head, *(f"  {r}" for r in records)])

    def as_arrays(self) -> dict[str, np.ndarray]:
        """Every field as an array (for numpy, pandas or a plot).

        Returns:
          ``{name: array}``: per-device fields ``(steps, devices)``; each scalar of
          ``aux`` (``metrics``) as ``"metrics/<name>"``, NaN at steps without it.
        """
        n = len(self.device_ids)
        names = sorted({name for m in self.metrics for name in m})
        metrics = {
            f"metrics/{name}": np.asarray([m.get(name, np.nan) for m in self.metrics], np.float64)
            for name in names
        }
        return metrics | {
            "device_ids": np.asarray(self.device_ids, np.int64),
            "step": np.asarray(self.step, np.int64),
            "loss": np.asarray(self.loss, np.float32),
            "device_loss": np.asarray(self.device_loss, np.float32).reshape(-1, n),
            "device_grad_norm": np.asarray(self.device_grad_norm, np.float32).reshape(-1, n),
            "status": np.asarray(self.status, np.int32).reshape(-1, n),
            "skipped": np.asarray(self.skipped, bool),
            "dropped": _id_array(self.dropped),
            "repaired": _id_array(self.repaired),
            "examples_per_sec": np.asarray(self.examples_per_sec, np.float64),
            "data_wait": np.asarray(self.data_wait, np.float64),
        }


def _widen(raw: np.ndarray, columns: Any, n: int) -> np.ndarray:
    """A raw table of fewer devices with a row for each of the run's ``n``: its own at
    ``columns``, and elsewhere the step-wide columns with NaN (floats) or 0 per device."""
    wide = np.repeat(raw[:1], n, axis=0)
    wide[:, _PER_DEVICE] = 0
    wide[:, _FLOAT_AT] = _NAN
    wide[np.asarray(columns)] = raw
    return wide


def _id_array(steps: list[tuple[int, ...]]) -> np.ndarray:
    """Device ids per step as one array, ``(steps, most in a step)``, padded with -1."""
    width = max((len(ids) for ids in steps), default=0)
    out = np.full((len(steps), width), -1, np.int64)
    for i, ids in enumerate(steps):
        out[i, : len(ids)] = ids
    return out
