"""The padding of a sharded leaf after an exclusion (``TrainStep.exclude_devices``
under ``shard_state`` with one group): a leaf whose axis no longer divides by the
devices left is held padded with zeros to the next multiple (JAX refuses a
``NamedSharding`` that does not divide), and cut back to its logical shape wherever it
leaves the step's programs. :class:`Kept` is the layout an exclusion keeps;
:class:`jaxstep._src.program.Plan` reads it (``Plan.of``) and pads and cuts whole states."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import numpy as np

#: a sharded leaf held padded (:class:`Kept`): its (logical, padded) length along its axis
Pad = tuple[int, int]
#: per leaf of a state (``jax.tree.leaves``), ``(axis, pad)`` of a leaf held padded, else
#: None; None: no leaf is
Pads = Sequence[tuple[int, Pad] | None] | None


class Kept(NamedTuple):
    """A layout an exclusion keeps (``TrainStep.exclude_devices`` under ``shard_state``
    with one group): each leaf's axis as before the exclusion, and the logical shapes of
    the parameters and the optimizer state. A parameter (its gradient) whose axis no
    longer divides by the devices left is held padded to the next multiple (zeros at its
    end: each device holds ``ceil(rows / n)`` rows of it), never made whole; each
    optimizer-state leaf takes the shape the optimizer builds for the padded parameters
    (``opt_physical``: Adam's moments padded like their parameter, a factored moment
    along the axis it shares with it; one that keeps its shape and whose axis no longer
    divides is whole). The padding stays inside the state and its programs
    (:meth:`Plan.logical`, :meth:`Plan.physical`)."""

    grads: tuple[int | None, ...]
    params: tuple[int | None, ...]
    opt: tuple[int | None, ...]
    param_shapes: tuple[tuple[int, ...], ...]
    opt_shapes: tuple[tuple[int, ...], ...]
    opt_physical: tuple[tuple[int, ...], ...]


def with_size(shape: Sequence[int], axis: int, size: int) -> tuple[int, ...]:
    """``shape`` with ``size`` along ``axis``."""
    return (*shape[:axis], size, *shape[axis + 1 :])


def grown(logical: tuple[int, ...], physical: tuple[int, ...]) -> tuple[int, Pad] | None:
    """The axis and pad of a leaf the optimizer builds as ``physical`` for padded
    parameters, ``logical`` for the logical ones (None: the same shape)."""
    if logical == physical or len(logical) != len(physical):
        return None
    grown = [d for d, (a, b) in enumerate(zip(logical, physical, strict=True)) if a != b]
    if len(grown) != 1:
        raise ValueError(
            f"the optimizer builds a state leaf of shape {logical} as {physical} for the "
            "padded parameters of the devices left: more than one axis grows, which "
            "jaxstep cannot hold padded. Exclude devices down to a count the sharded axes "
            "divide by, or restart on such a count from the latest checkpoint"
        )
    return grown[0], (logical[grown[0]], physical[grown[0]])


def cut(x: Any, axis: int, length: int) -> Any:
    """``x`` (numpy or jax) cut to ``length`` along ``axis`` (as it is if not longer)."""
    if np.shape(x)[axis] <= length:
        return x
    return x[(slice(None),) * axis + (slice(0, length),)]


def pad_to(x: Any, axis: int, length: int) -> Any:
    """``x`` (numpy or jax) with zeros appended along ``axis`` up to ``length`` (as it
    is if not shorter)."""
    extra = length - np.shape(x)[axis]
    if extra <= 0:
        return x
    widths = [(0, 0)] * np.ndim(x)
    widths[axis] = (0, extra)
    if isinstance(x, jax.Array | jax.core.Tracer):
        return jax.numpy.pad(x, widths)
    return np.pad(np.asarray(x), widths)


__all__ = ["Kept", "Pad", "Pads", "cut", "grown", "pad_to", "with_size"]
