"""What the step's collective gathered, as every device holds it after: the step-wide
facts (:class:`Seen`), the reduction's result (:class:`Reduced`) and what the verdict
and the update take (:class:`Gathered`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxstep._src.core import PyTree
from jaxstep._src.core import Status


class Seen(NamedTuple):
    """Step-wide facts, taken from the all-reduce: whether any device failed,
    overflowed or must halt (counted there for the status set before it, so the
    verdict needs no reduction over the table; the few optional checks that set
    status after it add theirs with :meth:`add`), and the state's ``halted`` flag and
    ``step`` as they were before the step."""

    failed: jax.Array
    overflow: jax.Array
    halt: jax.Array
    halted: jax.Array
    step: jax.Array
    #: the devices that failed their own checks before the all-reduce, counted (float)
    failing: jax.Array
    #: ``drop``: which devices failed their own checks ((n,) bool; None otherwise)
    left_out: jax.Array | None = None
    #: a failure found after the all-reduce (``add``): leaving a device out cannot cure it
    late: jax.Array | bool = False
    #: ``drop``: whether a device failed ``max_consecutive_drops`` steps in a row
    repeats: jax.Array | None = None
    #: under ``skip`` and ``drop``, the state's ``consecutive_skips``, and under
    #: ``drop`` its ``monitor["drops"]``, as gathered by the all-reduce: read before it
    #: and not after, so XLA updates their donated buffers in place (no copy kernels)
    skips: jax.Array | None = None
    drops: jax.Array | None = None

    def add(self, bits: jax.Array, halting: int) -> Seen:
        """With every device's ``bits`` (``(n,)`` Status bits) added."""
        failed = jnp.any((bits & ~int(Status.OVERFLOW)) != 0)
        return self._replace(
            late=self.late | failed,
            failed=self.failed | failed,
            overflow=self.overflow | jnp.any((bits & int(Status.OVERFLOW)) != 0),
            halt=self.halt | jnp.any((bits & halting) != 0),
        )


class Gathered(NamedTuple):
    """What every device holds once the step's collective gathered it: what the verdict
    and the update take."""

    losses: jax.Array  # (n,) every device's loss
    status: jax.Array  # (n,) every device's Status bits, the cross-device checks' included
    seen: Seen  # the step-wide facts
    columns: dict[str, jax.Array]  # the table's columns found after the gather
    grad_sums: PyTree  # the gradients summed over the devices (a shard of each sharded leaf)
    model_state: PyTree  # the new model state, its float leaves averaged
    rows: jax.Array  # (n, columns) every device's health row, as packed


class Reduced(NamedTuple):
    """What every device holds after the all-reduce."""

    grad_sums: PyTree  # the gradients summed over the devices (divided in the update)
    model_state: PyTree  # the new model state, its float leaves averaged
    rows: jax.Array  # every device's health row, as packed
    seen: Seen  # the step-wide facts summed alongside
    rest: jax.Array  # (n, k): the fingerprints' halves, then the faults' fire flags
    status: jax.Array  # (n,) every device's status


__all__ = ["Gathered", "Reduced", "Seen"]
