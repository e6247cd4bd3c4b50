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
    """Why a device failed a step. Flags combine: ``INPUT_NONFINITE | LOSS_NONFINITE``."""

    OK = 0
    INPUT_NONFINITE = 1
    LOSS_NONFINITE = 2
    GRAD_NONFINITE = 4
    PARAM_NONFINITE = 8
    CHECK_FAILED = 16
    DIVERGED = 32
    HUNG = 64
    LOSS_SPIKE = 128


# Columns of the health table. Per-device columns first; the last ones hold the
# step-wide verdict (the same value in every row) so one array carries everything.
COLUMNS: tuple[str, ...] = (
    "status",  # Status bits of this device
    "input_leaf",  # index of the first non-finite batch leaf, or -1
    "grad_leaf",  # index of the first non-finite gradient leaf, or -1
    "param_leaf",  # index of the first non-finite parameter leaf, or -1
    "check",  # index of the first failing user check, or -1
    "diverged_leaf",  # index of the first state leaf that differs from the majority, or -1
    "loss",  # local loss (float32 bits)
    "grad_norm",  # local gradient norm, before averaging (float32 bits)
    "step",  # state.step the step started from
    "halted",  # 1 if the state is halted after this step
    "skipped",  # 1 if this step's update was discarded (skip policy)
    "consecutive_skips",  # skips in a row after this step
)
COL = {name: i for i, name in enumerate(COLUMNS)}
FLOAT_COLUMNS = frozenset({"loss", "grad_norm"})
PRE_COLLECTIVE = (
    Status.INPUT_NONFINITE | Status.LOSS_NONFINITE | Status.GRAD_NONFINITE | Status.CHECK_FAILED
)


def first_nonfinite(leaves: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Returns (any leaf non-finite, index of the first such leaf or -1).

    Integer and boolean leaves are always finite and are not looked at.
    """
    flags = [
        jnp.logical_not(jnp.all(jnp.isfinite(x)))
        for x in leaves
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    positions = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not flags:
        return jnp.array(False), jnp.array(-1, jnp.int32)
    bad = jnp.stack(flags)
    first = jnp.asarray(positions, jnp.int32)[jnp.argmax(bad)]
    return jnp.any(bad), jnp.where(jnp.any(bad), first, -1).astype(jnp.int32)


def sum_of_squares(leaves: Sequence[jax.Array]) -> jax.Array:
    """Sum of squares over all float leaves, accumulated in float32."""
    total = jnp.zeros((), jnp.float32)
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.inexact):
            total = total + jnp.sum(jnp.square(x.astype(jnp.float32)))
    return total


def pack_row(values: dict[str, Any]) -> jax.Array:
    """Packs one device's health fields (missing ones are 0) into an int32 row."""
    cells = []
    for name in COLUMNS:
        v = values.get(name, 0)
        if name in FLOAT_COLUMNS:
            v = jax.lax.bitcast_convert_type(jnp.asarray(v, jnp.float32), jnp.int32)
        cells.append(jnp.asarray(v).astype(jnp.int32))
    return jnp.stack(cells)


def column(table: jax.Array, name: str) -> jax.Array:
    """One column of a packed table (inside or outside jit), float columns decoded."""
    col = table[..., COL[name]]
    if name in FLOAT_COLUMNS:
        return jax.lax.bitcast_convert_type(col, jnp.float32)
    return col


class HealthTable(NamedTuple):
    """A step's health table, decoded on the host. Row i is ``devices[i]`` of the step."""

    status: np.ndarray
    input_leaf: np.ndarray
    grad_leaf: np.ndarray
    param_leaf: np.ndarray
    check: np.ndarray
    diverged_leaf: np.ndarray
    loss: np.ndarray
    grad_norm: np.ndarray
    step: int
    halted: bool
    skipped: bool
    consecutive_skips: int

    @classmethod
    def from_array(cls, table: np.ndarray) -> HealthTable:
        table = np.asarray(table, np.int32)
        fields: dict[str, Any] = {}
        for name in COLUMNS:
            col = table[:, COL[name]]
            if name in FLOAT_COLUMNS:
                fields[name] = col.view(np.float32)
            elif name in ("step", "consecutive_skips"):
                fields[name] = int(col[0])
            elif name in ("halted", "skipped"):
                fields[name] = bool(col[0])
            else:
                fields[name] = col
        return cls(**fields)

    @property
    def failed(self) -> bool:
        return bool(np.any(self.status != 0))

    @property
    def mean_loss(self) -> float:
        return float(np.mean(self.loss))
