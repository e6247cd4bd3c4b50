"""The diagnosis's passes over one failing chunk, on one device, from one copy of the
state: which examples fail on their own (:meth:`Passes.failing_examples`) and which
gradient leaves a non-finite gradient reached (:meth:`Passes.nonfinite_grad_leaves`).
Each is compiled on first use; ``axis_name`` is bound to a one-example (or
one-chunk) axis, so a model that communicates sees its rows alone. With several
processes each runs only the chunks its own batch holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep.core import Batch
from jaxstep.core import PyTree
from jaxstep.core import TrainState
from jaxstep.core import from_host
from jaxstep.program import Options
from jaxstep.program import example_failed
from jaxstep.program import grad_leaves_finite
from jaxstep.step._backends import Backend
from jaxstep.step._inputs import local_positions


class Passes:
    """What a step's runtime runs for :func:`jaxstep.diagnose`, on its ``backend``'s
    devices (a copy of the state read from the first this process holds)."""

    def __init__(self, options: Options, backend: Backend):
        self.options, self.backend = options, backend
        self.n = len(backend.devices)
        self._examples: Any = None
        self._grad_leaves: Any = None

    def failing_examples(
        self, state: TrainState, batch: Batch, chunks: Sequence[int], step_number: int
    ) -> list[int]:
        """Global batch indices of the examples of ``chunks`` (device positions) that
        fail on their own (input, loss, gradient, model state or a user check) from
        ``state`` at step ``step_number``. ``batch``: what the step took (several
        processes: this process's rows, whose chunks alone are run: the caller gathers
        the rest)."""
        if self._examples is None:
            options, axis = self.options, self.options.axis_name

            def one(state: TrainState, example: Batch, chunk: jax.Array, row: jax.Array) -> Any:
                def alone(ex: Batch) -> jax.Array:
                    return example_failed(options, state, ex, chunk, row)

                return _with_axis(alone, axis, example)

            self._examples = jax.jit(jax.vmap(one, in_axes=(None, 0, None, 0)))
        local = local_positions(self.backend.devices)
        copy = self.backend.read_at(state, local[0])
        state, size, part = self._split(copy, batch, step_number, local)
        found: list[int] = []
        for c in [c for c in chunks if c in set(local)]:
            flags = self._examples(state, part(c), jnp.int32(c), jnp.arange(size))
            found.extend(int(c * size + r) for r in np.flatnonzero(np.asarray(flags)))
        return found

    def nonfinite_grad_leaves(
        self, state: TrainState, batch: Batch, position: int, step_number: int
    ) -> list[int]:
        """Indices (tree order) of the gradient leaves that are not finite for the rows
        ``devices[position]`` holds of ``batch``, run from ``state`` as that device ran
        them (the whole chunk in one pass). Only the process holding that device can
        run it.

        Raises:
          ValueError: another process holds that device's rows.
        """
        devices = self.backend.devices
        local = local_positions(devices)
        if position not in local:
            raise ValueError(
                f"device {devices[position].id}'s rows are not in this process's "
                f"batch: ask process {devices[position].process_index}"
            )
        copy, device_id = self.backend.read_at(state, local[0]), devices[position].id
        if self._grad_leaves is None:
            options, axis = self.options, self.options.axis_name

            def one(state: TrainState, part: Batch, device: jax.Array, chunk: jax.Array) -> Any:
                def alone(p: Batch) -> jax.Array:
                    return grad_leaves_finite(options, state, p, device, chunk)

                return _with_axis(alone, axis, part)

            self._grad_leaves = jax.jit(one)
        state, _, part = self._split(copy, batch, step_number, local)
        args = (jnp.int32(device_id), jnp.int32(position))
        finite = np.asarray(self._grad_leaves(state, part(position), *args))
        return [int(i) for i in np.flatnonzero(~finite)]

    def _split(
        self, copy: TrainState, batch: Batch, step_number: int, local: Sequence[int] | None
    ) -> tuple[TrainState, int, Callable[[int], Batch]]:
        """The state at step ``step_number``, the rows per device, and chunk c (a device
        position) of ``batch``, which holds the chunks of ``local`` in order."""
        step = jnp.asarray(step_number, jnp.int32)
        state = dataclasses.replace(from_host(copy), step=step)
        at = {c: j for j, c in enumerate(range(self.n) if local is None else local)}
        size = jax.tree.leaves(batch)[0].shape[0] // len(at)

        def part(c: int) -> Batch:
            j = at[c]
            return jax.tree.map(lambda x: np.asarray(x)[j * size : (j + 1) * size], batch)

        return state, size, part


def _with_axis(fn: Callable[[PyTree], jax.Array], axis: str, tree: PyTree) -> jax.Array:
    """``fn(tree)`` with ``axis`` bound to an axis of size one (so collectives in the
    model see these rows alone)."""
    return jax.vmap(fn, axis_name=axis)(jax.tree.map(lambda x: x[None], tree))[0]
