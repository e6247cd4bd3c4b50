"""The record of a run: one entry per finished step (from its health table), and the
:class:`Recorder` that writes each step fit settles into it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any
from typing import get_args

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep.core import HealthTable
from jaxstep.core import RecoveryAction
from jaxstep.core import Verdict
from jaxstep.loop._pending import Pending

# History fields filled from the health tables, decoded when first read.
_DECODED = frozenset(
    {
        "step",
        "loss",
        "device_loss",
        "device_grad_norm",
        "status",
        "skipped",
        "dropped",
        "repaired",
        "dropped_rows",
    }
)


#: ``Recovery.verdict`` values, and the ``Recovery.action`` values (a record may come
#: from JSON, where nothing typed it: checked when built).
VERDICTS: tuple[Verdict, ...] = get_args(Verdict)
ACTIONS: tuple[RecoveryAction, ...] = get_args(RecoveryAction)


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One action :func:`jaxstep.fit` took to recover from a failure
    (``fit(..., recover=jaxstep.Recover())``), in ``History.recoveries``.

    Attributes:
      step: the step that failed (``state.step`` when it ran).
      verdict: ``"transient"``, ``"data"``, ``"device"``, ``"spike"`` or ``"diverged"``.
      action: ``"retried"`` (the same batch again from the last good state),
        ``"quarantined"`` (the step again with the chunks holding ``examples`` left
        out of the mean; when a collective in the model carried them to every device,
        the step's batch is skipped instead: ``skipped_batches``), ``"excluded"``
        (training goes on without ``device_ids``),
        ``"rolled back"`` (to the last verified checkpoint, ``skipped_batches`` left
        out) or ``"repaired"`` (a diverged replica copied from the majority).
      device_ids: the ``jax.Device.id`` s the verdict is about (failing, excluded,
        repaired).
      examples: the offending examples, as indices into the failing global batch.
      skipped_batches: batches never trained, counting the stream's first batch as 0.
      batch: the failing step's batch, counting the stream's first batch as 0 (None
        when unknown).
      detail: what happened, in words.
      example_ids: with ``Recover(example_id=...)``: the values of that batch leaf for
        ``examples``, in their order (what names them in the data, shuffled or not).
    """

    step: int
    verdict: Verdict
    action: RecoveryAction
    device_ids: tuple[int, ...] = ()
    examples: tuple[int, ...] = ()
    skipped_batches: tuple[int, ...] = ()
    batch: int | None = None
    detail: str = ""
    example_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}; expected one of {VERDICTS}")
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; expected one of {ACTIONS}")

    def __str__(self) -> str:
        text = f"step {self.step}: {self.verdict} -> {self.action}"
        if self.device_ids:
            text += f" (device {', '.join(map(str, self.device_ids))})"
        if self.examples:
            text += f"; examples {list(self.examples)}"
        if self.batch is not None:
            text += f" of batch {self.batch}"
        if self.example_ids:
            text += f" (ids {list(self.example_ids)})"
        if self.skipped_batches:
            text += f"; skipped batches {list(self.skipped_batches)}"
        if self.detail:
            text += f"; {self.detail}"
        return text

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the metric writers' ``recoveries`` entries)."""
        return {
            "step": self.step,
            "verdict": self.verdict,
            "action": self.action,
            "device_ids": list(self.device_ids),
            "examples": list(self.examples),
            "skipped_batches": list(self.skipped_batches),
            "batch": self.batch,
            "detail": self.detail,
            "example_ids": list(self.example_ids),
        }


@dataclasses.dataclass
class History:
    """Per-step record of a run, one entry per finished step, for reading or plotting.

    The fields from the health tables (``step``, ``loss``, the per-device lists,
    ``skipped``) are filled from the appended tables when one of them is first read,
    all at once: :func:`fit`'s loop does no per-step decoding.
    """

    device_ids: list[int] = dataclasses.field(default_factory=list)
    step: list[int] = dataclasses.field(default_factory=list)
    loss: list[float] = dataclasses.field(default_factory=list)
    device_loss: list[np.ndarray] = dataclasses.field(default_factory=list)
    device_grad_norm: list[np.ndarray] = dataclasses.field(default_factory=list)
    status: list[np.ndarray] = dataclasses.field(default_factory=list)
    skipped: list[bool] = dataclasses.field(default_factory=list)
    #: ``on_failure="drop"``: the ``jax.Device.id`` s left out of each step's mean
    #: (empty when none)
    dropped: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    #: the ``jax.Device.id`` s whose replica was repaired from the majority at each step
    repaired: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    #: the global batch rows ``(start, stop)`` of each chunk left out, per step, in the
    #: order of ``dropped`` (empty when the rows per device are unknown), to check the
    #: data later
    dropped_rows: list[tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=list)
    #: the mean over devices of each scalar entry of the step's ``aux`` (e.g. accuracy)
    metrics: list[dict[str, float]] = dataclasses.field(default_factory=list)
    #: global examples over the wall time since the previous step finished (the first
    #: step's includes compiling)
    examples_per_sec: list[float] = dataclasses.field(default_factory=list)
    #: ``fit(..., recover=...)``: each recovery action, in the order taken
    recoveries: list[Recovery] = dataclasses.field(default_factory=list)
    #: rows never trained because the data ended while they were carried (a run that
    #: lost a device carries the rows that do not divide by the devices left into the
    #: next step): ``(batch, first row, stop)`` of each stretch, the batch counted from
    #: the data's first (0)
    left_over: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    # tables appended but not decoded yet, oldest first
    _tables: list[HealthTable] = dataclasses.field(
        default_factory=list, init=False, repr=False, compare=False
    )
    # rows per device of each waiting table's batch (0: unknown)
    _rows: list[int] = dataclasses.field(
        default_factory=list, init=False, repr=False, compare=False
    )
    # per waiting table: None, or the positions of its devices in device_ids
    _columns: list[Any] = dataclasses.field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def __getattribute__(self, name: str) -> Any:
        if name in _DECODED and object.__getattribute__(self, "_tables"):
            object.__getattribute__(self, "_decode")()
        return object.__getattribute__(self, name)

    def append(
        self,
        table: HealthTable,
        metrics: dict[str, float] | None = None,
        examples_per_sec: float = float("nan"),
        rows: int = 0,
        columns: Any = None,
    ) -> None:
        """Adds a finished step (what :func:`fit` calls once per step): its table is
        kept as it is and decoded into the fields above when one is first read.
        ``rows``: rows per device of the step's batch (for ``dropped_rows``).
        ``columns``: once a device left the run, the position in ``device_ids`` of each
        of the table's devices (the per-device fields keep a column for every device
        the run started with: NaN loss and status 0 where a device no longer ran)."""
        fields = object.__getattribute__(self, "__dict__")  # once: fit calls this each step
        fields["_tables"].append(table)
        fields["_rows"].append(rows)
        if columns is not None or fields["_columns"]:
            fields["_columns"] += [None] * (len(fields["_rows"]) - 1 - len(fields["_columns"]))
            fields["_columns"].append(columns)
        fields["metrics"].append(dict(metrics) if metrics else {})
        fields["examples_per_sec"].append(float(examples_per_sec))

    def _decode(self) -> None:
        waiting: list[HealthTable] = object.__getattribute__(self, "_tables")
        if not waiting:
            return
        tables = waiting.copy()
        waiting.clear()  # first: the fields read below are then decoded
        waiting_rows: list[int] = object.__getattribute__(self, "_rows")
        rows, waiting_rows[:] = waiting_rows[: len(tables)], waiting_rows[len(tables) :]
        waiting_columns: list[Any] = object.__getattribute__(self, "_columns")
        columns = waiting_columns[: len(tables)]
        waiting_columns[:] = waiting_columns[len(tables) :]
        columns += [None] * (len(tables) - len(columns))
        self.loss.extend(_mean_losses(tables, uniform=all(c is None for c in columns)))
        sizes = rows + [0] * (len(tables) - len(rows))
        for table, size in zip(tables, sizes, strict=True):  # chunk i: rows of position i
            spans = ((int(i) * size, (int(i) + 1) * size) for i in np.flatnonzero(table.dropped))
            self.dropped_rows.append(tuple(spans) if size else ())
        n = len(self.device_ids)
        tables = [t if c is None else _widen(t, c, n) for t, c in zip(tables, columns, strict=True)]
        self.step.extend(t.step for t in tables)
        self.device_loss.extend(t.loss for t in tables)
        self.device_grad_norm.extend(t.grad_norm for t in tables)
        self.status.extend(t.status for t in tables)
        self.skipped.extend(t.skipped for t in tables)
        ids = self.device_ids
        for table in tables:
            dropped = np.flatnonzero(table.dropped)
            self.dropped.append(tuple(int(ids[i]) for i in dropped) if ids else ())
            repaired = np.flatnonzero(table.repaired)
            self.repaired.append(tuple(int(ids[i]) for i in repaired) if ids else ())

    def __len__(self) -> int:
        return len(self.metrics)

    def recovery_summary(self) -> str:
        """``recoveries`` in words, for the end of a run: a count of each action, then
        one line a record; ``""`` when there were none.

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
        """Every field as an array: per-device ones are ``(steps, devices)``; each
        scalar of ``aux`` (``metrics``) as ``"metrics/<name>"``, NaN at steps without it."""
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
        }


def _mean_losses(tables: list[HealthTable], *, uniform: bool) -> list[float]:
    """Each step's loss: the mean over its devices (under ``drop`` over the chunks it
    trained on), as np.mean computes it (the float32 sum, then divided)."""
    if len(tables) == 1:  # read after every step (a callback): no stacking
        means = [tables[0].mean_loss]
    elif uniform:
        losses = np.stack([t.loss for t in tables])  # (steps, devices) float32
        means = (np.add.reduce(losses, axis=1) / losses.shape[1]).tolist()
    else:
        means = [t.mean_loss for t in tables]
    for k, table in enumerate(tables):
        if table.dropped.any():
            kept = table.loss[~table.dropped.astype(bool)]
            means[k] = float(np.add.reduce(kept) / max(kept.size, 1))
    return means


def _widen(table: HealthTable, columns: Any, n: int) -> HealthTable:
    """``table`` with a column for each of the run's ``n`` devices: its own at
    ``columns``, NaN (floats) or 0 where a device no longer ran."""
    changed = {}
    for name, value in table._asdict().items():
        if isinstance(value, np.ndarray) and value.ndim == 1 and value.shape[0] == len(columns):
            fill = np.nan if np.issubdtype(value.dtype, np.floating) else 0
            wide = np.full((n,), fill, value.dtype)
            wide[np.asarray(columns)] = value
            changed[name] = wide
    return table._replace(**changed)  # type: ignore[arg-type]


def _id_array(steps: list[tuple[int, ...]]) -> np.ndarray:
    """Device ids per step as one array, ``(steps, most in a step)``, padded with -1."""
    width = max((len(ids) for ids in steps), default=0)
    out = np.full((len(steps), width), -1, np.int64)
    for i, ids in enumerate(steps):
        out[i, : len(ids)] = ids
    return out


def scalar_aux(aux: Any, n: int) -> dict[str, float]:
    """The mean over devices of each scalar entry of a step's ``aux`` (one value per
    device, leading axis ``n``), named by its keys joined with ``/``. Called once the
    step has finished: reading these few numbers does not wait."""
    found = {}
    for path, x in jax.tree_util.tree_leaves_with_path(aux):
        if getattr(x, "shape", None) == (n,) and jnp.issubdtype(x.dtype, jnp.number):
            name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            found[name or "aux"] = float(np.mean(np.asarray(x, np.float64)))
    return found


class Recorder:
    """Writes each step one fit call settles into ``history``: its table, the scalar
    entries of its ``aux``, its examples per second, and, once a device left the run,
    the columns of ``history.device_ids`` its devices fill."""

    __slots__ = ("columns", "devices", "history", "since")

    def __init__(self, history: History):
        self.history = history
        self.devices = 0  # devices of the step
        self.columns: Any = None  # their positions in history.device_ids (None: all, in order)
        self.since = 0.0  # when the step before was settled (or the run started)

    def start(self, ids: list[int], origin: list[int] | None) -> None:
        """The run starts on the devices ``ids``; ``origin``: the devices its step was
        built with, when some left in an earlier fit call (the history keeps a column
        for each)."""
        history = self.history
        if not (history.device_ids and set(ids) < set(history.device_ids)):
            # (a history shared with the fit calls before keeps its columns)
            history.device_ids = ids if origin is None else origin
        self.now_on(ids)

    def now_on(self, ids: Sequence[int]) -> None:
        """The step runs on the devices ``ids`` from now on."""
        self.devices = len(ids)
        if self.history.device_ids != list(ids):
            where = {d: i for i, d in enumerate(self.history.device_ids)}
            self.columns = np.asarray([where[d] for d in ids])

    def settled(self, pending: Pending, table: HealthTable) -> None:
        """A step settled: recorded with the examples per second since the one before."""
        now = time.perf_counter()
        aux = pending.out.aux
        metrics = {} if aux is None else scalar_aux(aux, self.devices)
        rate = self.devices * pending.rows / max(now - self.since, 1e-9)
        self.history.append(table, metrics, rate, pending.rows, self.columns)
        self.since = now

    def add(
        self, pending: Pending, table: HealthTable, examples_per_sec: float = float("nan")
    ) -> None:
        """``pending``'s step (read, not settled: its rate unknown), recorded."""
        aux = pending.out.aux
        metrics = {} if aux is None else scalar_aux(aux, self.devices)
        self.history.append(table, metrics, examples_per_sec, pending.rows, self.columns)
