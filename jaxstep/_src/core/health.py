"""Per-device health: the status flags, the checks run on each device before the
first collective, and the health table every device ends up holding.

The table is one small int32 array of shape ``(n_devices, len(COLUMNS))``; float
columns are stored bit-cast so the host reads a single array per step.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Status(enum.IntFlag):
    """Why a device failed a step. Flags combine: ``INPUT_NONFINITE | LOSS_NONFINITE``.

    Read in ``HealthTable.status``, ``TrainingWorkerError.status``, ``History.status``.

    Attributes:
      OK: nothing failed (0).
      INPUT_NONFINITE: a float leaf of this device's chunk of the batch holds a NaN or
        an Inf (checked before the loss runs).
      LOSS_NONFINITE: the device's loss is NaN or Inf.
      GRAD_NONFINITE: a leaf of the device's own gradient, before the all-reduce, holds
        a NaN or an Inf.
      PARAM_NONFINITE: a parameter is not finite: after the update, with
        ``verify_update=True``; else at the start of every ``divergence_every``-th step.
      CHECK_FAILED: a check the loss returned in ``aux["checks"]`` is False.
      DIVERGED: the device's copy of the state differs from the majority's (replica
        fingerprints, every ``divergence_every`` steps).
      HUNG: the device did not finish its part of the step in time
        (``fit(step_timeout=...)``), or its process was lost.
      LOSS_SPIKE: the loss jumped above its own recent range (:class:`LossSpike`).
      OVERFLOW: the scaled gradients overflowed (``loss_scale``): recorded, the step
        skipped and the scale lowered; no failure, unless the scale is at its minimum.
      MODEL_STATE_NONFINITE: the new model state (e.g. BatchNorm statistics) is not
        finite.

    Example:
      >>> from jaxstep import Status
      >>> status = Status.INPUT_NONFINITE | Status.LOSS_NONFINITE
      >>> int(status), bool(status & Status.LOSS_NONFINITE), Status(4).name
      (3, True, 'GRAD_NONFINITE')
    """

    OK = 0
    INPUT_NONFINITE = 1
    LOSS_NONFINITE = 2
    GRAD_NONFINITE = 4
    PARAM_NONFINITE = 8
    CHECK_FAILED = 16
    DIVERGED = 32
    HUNG = 64
    LOSS_SPIKE = 128
    OVERFLOW = 256  # scaled gradients overflowed (loss scaling): recorded, not a failure
    MODEL_STATE_NONFINITE = 512  # the new model state (e.g. BatchNorm statistics)


# Columns of the health table. Per-device columns first; the last ones hold the
# step-wide verdict (the same value in every row) so one array carries everything.
COLUMNS: tuple[str, ...] = (
    "status",  # Status bits of this device
    "input_leaf",  # index of the first non-finite batch leaf, or -1
    "grad_leaf",  # index of the first non-finite gradient leaf, or -1
    "param_leaf",  # index of the first non-finite parameter leaf, or -1
    "check",  # index of the first failing user check, or -1
    "diverged_leaf",  # index of the first state leaf that differs from the majority, or -1
    "model_state_leaf",  # index of the first non-finite new model-state leaf, or -1
    "microbatch",  # the first failing micro-batch, or -1
    "loss",  # local loss (float32 bits)
    "grad_norm",  # local gradient norm, before averaging (float32 bits; the gathered
    # rows hold its square, the table its root)
    "step",  # state.step the step started from
    "halted",  # 1 if the state is halted after this step
    "skipped",  # 1 if this step's update was discarded (skip policy)
    "consecutive_skips",  # skips in a row after this step
    "failed",  # 1 if this step failed (OVERFLOW alone is no failure, but at the minimum scale)
    # on_failure="drop" (0 under the other policies):
    "dropped",  # 1 if this device's chunk was left out of the step's (applied) mean
    "repaired",  # 1 if this device's replica was replaced by a majority copy this step
    "consecutive_drops",  # steps in a row this device was left out, after this step
)
COL = {name: i for i, name in enumerate(COLUMNS)}
FLOAT_COLUMNS = frozenset({"loss", "grad_norm"})


def _floats(leaves: Sequence[jax.Array]) -> list[tuple[int, jax.Array]]:
    return [(i, x) for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]


# Up to this many flags, "first True" is a chain of scalar selects: elementwise, so
# XLA fuses it into whatever consumes it. ``argmax`` over a stacked vector is a
# concatenate and two reductions, each a kernel of its own (three of the ~20 kernels
# the checks added to the tiny benchmark model's step).
_CHAIN = 64


def first_true(
    flags: jax.Array | Sequence[jax.Array], labels: Sequence[int] | None = None
) -> jax.Array:
    """Index of the first True among 1-d bool ``flags`` (an array or a list of
    scalars), or -1; with ``labels``, ``labels[index]`` instead of the index."""
    count = len(flags) if isinstance(flags, Sequence) else flags.shape[0]
    labels = range(count) if labels is None else labels
    if count == 0:
        return jnp.array(-1, jnp.int32)
    if count > _CHAIN:
        stacked = jnp.stack(list(flags)) if isinstance(flags, Sequence) else flags
        first = jnp.asarray(labels, jnp.int32)[jnp.argmax(stacked)]
        return jnp.where(jnp.any(stacked), first, -1).astype(jnp.int32)
    first = jnp.array(-1, jnp.int32)
    for i in reversed(range(count)):
        first = jnp.where(flags[i], jnp.int32(labels[i]), first)
    return first


def any_true(flags: jax.Array | Sequence[jax.Array]) -> jax.Array:
    """Whether any of 1-d bool ``flags`` is True (a chain of ``|`` up to a few dozen
    flags, so it fuses into its consumer)."""
    count = len(flags) if isinstance(flags, Sequence) else flags.shape[0]
    if count > _CHAIN:
        return jnp.any(jnp.stack(list(flags)) if isinstance(flags, Sequence) else flags)
    found = jnp.array(False)
    for i in range(count):
        found = found | flags[i]
    return found


def first_nonfinite(
    leaves: Sequence[jax.Array], labels: Sequence[int] | None = None
) -> tuple[jax.Array, jax.Array]:
    """Returns (any leaf non-finite, index of the first such leaf or -1; with
    ``labels``, ``labels[index]`` instead of the index).

    ``sum(x * 0)`` is NaN exactly when ``x`` holds a NaN or an Inf, and is one fused
    reduction per leaf (``all(isfinite(x))`` is three kernels on XLA:CPU). Integer
    and boolean leaves are always finite and are not looked at.
    """
    floats = _floats(leaves)
    if not floats:
        return jnp.array(False), jnp.array(-1, jnp.int32)
    bad = [~jnp.isfinite(jnp.sum(x * jnp.zeros((), x.dtype))) for _, x in floats]
    at = range(len(leaves)) if labels is None else labels
    return any_true(bad), first_true(bad, [at[i] for i, _ in floats])


# Leaves up to this many elements share one reduction kernel (`gradient_health`).
# Its loop runs at ~1.4 ns an element on XLA:CPU, where a leaf's own sum costs a
# kernel or three (a 512-element sum is split in three), a few microseconds each;
# a large leaf's own sum is vectorized and split over threads, ~5x faster an element.
SHARED_BELOW = 4096


def gradient_health(
    grads: Sequence[jax.Array], inputs: Sequence[jax.Array] = ()
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (the float32 sum of squares of every float gradient leaf, the index of
    the first non-finite gradient leaf or -1, the index of the first non-finite
    ``inputs`` leaf or -1), in few kernels.

    The sum gives the gradient norm and the finiteness check: it is non-finite when a
    leaf holds NaN or Inf (or when the squares overflow float32, |g| > ~1e19, a
    gradient no run survives either; then a leaf is named only if its own squares
    overflow). A large leaf is checked by its own sum (``sum(x * 0)`` for an input,
    see :func:`first_nonfinite`); the small leaves (up to ``SHARED_BELOW`` elements)
    of both share one variadic reduction over their concatenation, which adds up the
    gradients' squares and takes, for each of the two, the smallest index of a
    non-finite element alongside (float labels: an int32 ``min`` in the same
    reduction was ~20x slower on XLA:CPU).
    """
    squares = [(i, jnp.square(x.astype(jnp.float32))) for i, x in _floats(grads)]
    large = [(i, jnp.sum(x)) for i, x in squares if x.size > SHARED_BELOW]
    total = sum((s for _, s in large), jnp.zeros((), jnp.float32))
    grad_first = first_true([~jnp.isfinite(s) for _, s in large], [i for i, _ in large])
    large_in = [(i, x) for i, x in _floats(inputs) if x.size > SHARED_BELOW]
    input_first = first_nonfinite([x for _, x in large_in], [i for i, _ in large_in])[1]
    groups = [
        [(i, jnp.ravel(x)) for i, x in squares if x.size <= SHARED_BELOW],
        [(i, jnp.ravel(x)) for i, x in _floats(inputs) if x.size <= SHARED_BELOW],
    ]
    if not any(groups):
        return total, grad_first, input_first
    none = float(max(len(grads), len(inputs)))  # above every index: nothing is bad
    flat = [(k, i, x) for k, group in enumerate(groups) for i, x in group]
    # the gradients' squares (0 for the inputs' elements), then per group its labels,
    # all float32 (also under jax_enable_x64, where Python floats become float64)
    f32 = jnp.float32
    operands = [jnp.concatenate([x if k == 0 else jnp.zeros(x.shape, f32) for k, _, x in flat])]
    for g, group in enumerate(groups):
        if group:
            labels = [
                jnp.where(jnp.isfinite(x), f32(none), f32(i))
                if k == g
                else jnp.full(x.shape, none, f32)
                for k, i, x in flat
            ]
            operands.append(jnp.concatenate(labels))

    def combine(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return (a[0] + b[0], *(jnp.minimum(x, y) for x, y in zip(a[1:], b[1:], strict=True)))

    init = (f32(0), *[f32(none)] * (len(operands) - 1))
    shared, *labels = jax.lax.reduce(tuple(operands), init, combine, (0,))
    firsts = iter(labels)
    found = [next(firsts) if group else None for group in groups]
    return (
        total + shared,
        _first_of(grad_first, found[0], none),
        _first_of(input_first, found[1], none),
    )


def _first_of(first: jax.Array, label: jax.Array | None, none: float) -> jax.Array:
    """The smaller of two leaf indices, either of which may be missing (-1, ``none``)."""
    if label is None:
        return first
    return earliest(first, jnp.where(label < none, label, -1).astype(jnp.int32))


def earliest(a: jax.Array, b: jax.Array) -> jax.Array:
    """The smaller of two leaf indices, where -1 means none."""
    return jnp.where((a < 0) | ((b >= 0) & (b < a)), b, a)


def onehot_rows(
    values: dict[str, Any],
    index: jax.Array,
    n: int,
    summed: Sequence[Any] = (),
    extra: jax.Array | None = None,
) -> jax.Array:
    """This device's contribution to the health all-reduce, ``(n, len(COLUMNS) +
    len(summed) + len(extra))`` float32: its health fields (missing ones are 0) in
    row ``index`` of the first columns and zeros elsewhere, so the psum over the
    devices gathers every device's row; then ``summed``, the same in every row, so
    the psum adds them up over the devices; then ``extra``, one-hot like the fields.

    float32, so it can ride in the gradient all-reduce: every integer field is below
    2**24 and exact, and the one-hot rows add only zeros to it. Built as one
    elementwise select over the column index (no stack of scalars), so XLA makes it
    a single kernel together with the scalar checks feeding it.
    """
    width = len(COLUMNS) + len(summed)
    # numpy constants, not iotas: XLA:CPU gives an iota a kernel of its own
    col = np.broadcast_to(np.arange(width, dtype=np.int32)[None, :], (n, width))
    row = np.broadcast_to(np.arange(n, dtype=np.int32)[:, None], (n, width))
    cells = jnp.zeros((n, width), jnp.float32)
    fields = [values.get(name, 0) for name in COLUMNS] + list(summed)
    for c, value in enumerate(fields):
        cells = jnp.where(col == c, jnp.asarray(value).astype(jnp.float32), cells)
    rows = jnp.where((row == index) | (col >= len(COLUMNS)), cells, 0.0)
    if extra is None:
        return rows
    mine = jnp.arange(n)[:, None] == index
    return jnp.concatenate([rows, jnp.where(mine, extra.astype(jnp.float32)[None, :], 0.0)], 1)


def to_table(rows: jax.Array, overrides: dict[str, Any]) -> jax.Array:
    """The gathered float32 rows as the int32 health table (float columns bit-cast),
    with ``overrides`` (column name -> (n,) or scalar int) written in: one fused
    elementwise pass, where per-column slices and ``.at[].set`` updates would be a
    kernel each (the whole table's assembly was ~20 kernels of a ~60-kernel step on a
    tiny model)."""
    col = jnp.arange(len(COLUMNS), dtype=jnp.int32)[None, :]
    is_float = jnp.asarray([name in FLOAT_COLUMNS for name in COLUMNS])[None, :]
    # The rows carry the gradient's sum of squares; its root is taken here, in this
    # pass, rather than before the all-reduce, where it was a kernel of its own.
    rows = jnp.where(col == COL["grad_norm"], jnp.sqrt(rows), rows)
    table = jnp.where(
        is_float, jax.lax.bitcast_convert_type(rows, jnp.int32), rows.astype(jnp.int32)
    )
    for name, value in overrides.items():
        value = jnp.asarray(value).astype(jnp.int32)
        table = jnp.where(
            col == COL[name], value.reshape(value.shape + (1,) * (2 - value.ndim)), table
        )
    return table


def column(table: jax.Array, name: str) -> jax.Array:
    """One column of a packed table (inside or outside jit), float columns decoded."""
    col = table[..., COL[name]]
    if name in FLOAT_COLUMNS:
        return jax.lax.bitcast_convert_type(col, jnp.float32)
    return col


# How each column is decoded on the host: per-device arrays, or one step-wide value.
_KINDS = tuple(
    "float"
    if name in FLOAT_COLUMNS
    else "int"
    if name in ("step", "consecutive_skips")
    else "bool"
    if name in ("halted", "skipped", "failed")
    else "array"
    for name in COLUMNS
)
# The decoding as a plan built once: the table's columns in field order are the
# per-device arrays (int32 or float32 views) and step-wide values of the first row; a
# list comprehension over the kinds, run for every table, was a third of fit's
# Python per step (issue 29).
_FLOATS = [i for i, kind in enumerate(_KINDS) if kind == "float"]
_SCALARS = [(i, kind == "bool") for i, kind in enumerate(_KINDS) if kind in ("int", "bool")]


class HealthTable(NamedTuple):
    """A step's health table, decoded on the host: ``step.table(out)``, and what
    callbacks' ``on_step_end`` gets. Row i is ``step.devices[i]``.

    Per-device fields are ``(n_devices,)`` arrays; the step-wide ones (the verdict
    every device reached) are Python scalars. A leaf index counts in the list of
    names ``step.names`` holds for that kind (``step.names["input"]``,
    ``["params"]``, ``["checks"]``, ``["state"]``, ``["model_state"]``); -1 is none.

    Attributes:
      status: each device's :class:`Status` flags, as ints.
      input_leaf: the first non-finite leaf of each device's chunk of the batch.
      grad_leaf: the first non-finite gradient leaf (in ``step.names["params"]``).
      param_leaf: the first non-finite parameter leaf.
      check: the first failing check of ``aux["checks"]``.
      diverged_leaf: the first state leaf whose copy differs from the majority's.
      model_state_leaf: the first non-finite leaf of the new model state.
      microbatch: the first failing micro-batch (``microbatches > 1``), or -1.
      loss: each device's loss on its chunk (float32).
      grad_norm: each device's gradient norm, before the all-reduce (float32).
      step: the ``state.step`` the step started from.
      halted: whether the state is halted after this step: later steps change nothing.
      skipped: whether this step's update was discarded on every device.
      consecutive_skips: skipped steps in a row, this one included.
      failed: whether this step failed (an overflow alone is no failure).
      dropped: ``on_failure="drop"``: 1 where the device's chunk was left out of the
        step's mean.
      repaired: ``on_failure="drop"``: 1 where the device's replica was replaced by a
        majority copy in this step.
      consecutive_drops: ``on_failure="drop"``: steps in a row each device was left
        out, this one included.

    Example:
      >>> import jaxstep
      >>> from jaxstep.testing import Fault, tiny_step
      >>> tiny = tiny_step(faults=[Fault("loss", device_id=5, step=0)])
      >>> state, out = tiny.step(tiny.state(), tiny.batches(1)[0])
      >>> table = tiny.step.table(out)
      >>> table.status.tolist()  # one row a device: device 5's loss is NaN
      [0, 0, 0, 0, 0, 6, 0, 0]
      >>> table.step, table.failed, table.halted
      (0, True, True)
    """

    status: np.ndarray
    input_leaf: np.ndarray
    grad_leaf: np.ndarray
    param_leaf: np.ndarray
    check: np.ndarray
    diverged_leaf: np.ndarray
    model_state_leaf: np.ndarray
    microbatch: np.ndarray
    loss: np.ndarray
    grad_norm: np.ndarray
    step: int
    halted: bool
    skipped: bool
    consecutive_skips: int
    failed: bool
    dropped: np.ndarray
    repaired: np.ndarray
    consecutive_drops: np.ndarray

    @classmethod
    def from_array(cls, table: np.ndarray) -> HealthTable:
        """Decodes the packed table a step returns (``out.health``, read to the host).

        Args:
          table: the ``(n_devices, len(COLUMNS))`` int32 array, float columns bit-cast.

        Returns:
          The decoded table (:meth:`to_array` is the inverse).
        """
        # Read once per step by fit (when an action or callback takes the table): a
        # couple of microseconds, no per-column dispatch.
        table = np.asarray(table, np.int32)
        fields: list[Any] = list(table.T)  # each column, a view
        floats = table.view(np.float32).T
        for i in _FLOATS:
            fields[i] = floats[i]
        first = table[0].tolist()
        for i, is_bool in _SCALARS:
            fields[i] = bool(first[i]) if is_bool else first[i]
        return tuple.__new__(cls, fields)

    def to_array(self) -> np.ndarray:
        """The table packed as the step returned it: the inverse of :meth:`from_array`.

        Returns:
          An ``(n_devices, columns)`` int32 array, float columns bit-cast.
        """
        n = len(self.status)
        table = np.empty((n, len(COLUMNS)), np.int32)
        for i, value in enumerate(self):
            if i in _FLOATS:
                table[:, i] = np.asarray(value, np.float32).view(np.int32)
            else:
                table[:, i] = np.asarray(value, np.int64)  # a scalar fills every row
        return table

    @property
    def mean_loss(self) -> float:
        """The mean of the devices' losses (what ``out.metrics["loss"]`` holds)."""
        # np.mean's value (float32 sum, then divided) without its overhead (~15 us)
        return float(np.add.reduce(self.loss) / self.loss.size)
