"""The diagnosis's passes over the failing chunks: which examples fail on their own
(:meth:`Passes.failing_examples`) and which gradient leaves a non-finite gradient
reached (:meth:`Passes.nonfinite_grad_leaves`).

Each pass is one program over every device of the step, on the state as it lies
(replicated, sharded or stacked: no copy of it is read or made): device ``i`` runs
the rows it held in the failed step (chunk ``i``), when that chunk is asked for, from
the parameters it holds, a sharded parameter gathered whole inside the program, leaf
by leaf, as the step's own FSDP gathers it (the optimizer state is never read). The
examples run one after another (``lax.map``), so a pass holds one example's
gradients at a time, never a chunk's worth. ``axis_name`` is bound to a one-example
(or one-chunk) axis inside, so a model that communicates sees its rows alone.
Compiled on first use; with several processes every process runs them (the gathers
are collectives) and reads what its own devices found."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxstep._src.core import Batch
from jaxstep._src.core import PyTree
from jaxstep._src.core import TrainState
from jaxstep._src.program import Options
from jaxstep._src.program import cut
from jaxstep._src.program import example_failed
from jaxstep._src.program import grad_leaves_finite
from jaxstep._src.program import model_dims
from jaxstep._src.step._backends import Backend
from jaxstep._src.step._inputs import local_positions

#: ``per_device(state, chunk_batch, position, device_id) -> result`` (traced): a pass on
#: one device, from whole parameters, for the chunk it holds
PerDevice = Callable[[TrainState, Batch, jax.Array, jax.Array], jax.Array]


class Passes:
    """What a step's runtime runs for :func:`jaxstep.diagnose`, on its ``backend``'s
    devices and state layout."""

    def __init__(self, options: Options, backend: Backend):
        self.options, self.backend = options, backend
        self.devices = list(backend.devices)
        self.n = len(self.devices)
        # the step's devices in its order, on its axis (under model_parallel its model
        # groups too): the placement the state has
        self.mesh: Mesh = backend.mesh
        self._examples: Any = None
        self._grad_leaves: Any = None

    def failing_examples(
        self, state: TrainState, batch: Batch, chunks: Sequence[int], step_number: int
    ) -> list[int]:
        """Global batch indices of the examples of ``chunks`` (device positions) that
        fail on their own (input, loss, gradient, model state or a user check) from
        ``state`` at step ``step_number``. ``batch``: what the step took (several
        processes: this process's rows); each process returns the examples of the
        chunks its devices hold (the caller gathers the rest)."""
        if self._examples is None:
            options = self.options
            axis = options.axis_name

            def examples(
                state: TrainState, part: Batch, position: jax.Array, _: jax.Array
            ) -> jax.Array:
                def one(example_row: tuple[Batch, jax.Array]) -> jax.Array:
                    example, row = example_row

                    def alone(ex: Batch) -> jax.Array:
                        return example_failed(options, state, ex, position, row)

                    return _with_axis(alone, axis, example)

                size = jax.tree.leaves(part)[0].shape[0]
                return jax.lax.map(one, (part, jnp.arange(size)))

            self._examples = self._program(examples)
        flags = self._run(self._examples, state, batch, chunks, step_number)
        size = next(iter(flags.values())).shape[0] if flags else 0
        return [c * size + int(r) for c in sorted(flags) for r in np.flatnonzero(flags[c])]

    def nonfinite_grad_leaves(
        self, state: TrainState, batch: Batch, position: int, step_number: int
    ) -> list[int] | None:
        """Indices (tree order) of the gradient leaves that are not finite for the rows
        ``devices[position]`` holds of ``batch``, run from ``state`` as that device ran
        them (the whole chunk in one pass). Every process runs it; None on a process
        that does not hold that device (its rows are another process's)."""
        if self._grad_leaves is None:
            options, axis = self.options, self.options.axis_name

            def leaves(
                state: TrainState, part: Batch, position: jax.Array, device_id: jax.Array
            ) -> jax.Array:
                def alone(p: Batch) -> jax.Array:
                    return grad_leaves_finite(options, state, p, device_id, position)

                return _with_axis(alone, axis, part)

            self._grad_leaves = self._program(leaves)
        finite = self._run(self._grad_leaves, state, batch, [position], step_number)
        if position not in finite:
            return None
        return [int(i) for i in np.flatnonzero(~finite[position])]

    def _program(self, per_device: PerDevice) -> Any:
        """``per_device`` over the step's devices: ``(state, batch, want, step) ->
        result``, each device's result along the leading axis (``want``, ``step``: one
        entry a device; a device whose ``want`` is False skips its work). Jitted."""
        options, backend, mesh = self.options, self.backend, self.mesh
        axis, grid = options.axis_name, backend.grid
        ids = np.asarray([d.id for d in self.devices], np.int32)

        def run(state: TrainState, batch: Batch, want: jax.Array, step: jax.Array) -> Any:
            plan = backend.plan(state)
            model = model_dims(options, state.params)  # on the global shapes, as asked
            # the optimizer state stays out: no pass reads it
            state = dataclasses.replace(state, opt_state=None)
            n_params = len(jax.tree.leaves(state.params))
            gathered: tuple[int | None, ...] = (None,) * n_params
            held: tuple[Any, ...] = (None,) * n_params  # a leaf held padded: (axis, pad)
            if backend.stacked:
                specs = jax.tree.map(lambda _: P(axis), state)
            elif plan is None:
                specs = jax.tree.map(lambda _: P(), state)
            else:  # each device's blocks (replicas: tiled onto the step's axis, no copy)
                state = grid.to_blocks(state, grid.state_specs(plan, state))
                specs, gathered = grid.block_specs(plan, state), plan.params
                held = plan.param_pads
            links = grid.links

            def local(state: TrainState, part: Batch, want: jax.Array, step: jax.Array) -> Any:
                if backend.stacked:  # this device's copy, as the step's body sees it
                    state = jax.tree.map(lambda x: x[0], state)
                shards, treedef = jax.tree.flatten(state.params)
                whole = [  # one gather a sharded leaf (inside its group), as the step's own
                    x if a is None else links.of_leaf(d).gather(x, a)
                    for x, a, d in zip(shards, gathered, model, strict=True)
                ]
                whole = [  # a leaf held padded (after an exclusion) as the loss sees it
                    x if p is None else cut(x, p[0], p[1][0])
                    for x, p in zip(whole, held, strict=True)
                ]
                params = jax.tree.unflatten(treedef, whole)
                state = dataclasses.replace(state, params=params, step=step[0])
                position = jax.lax.axis_index(axis)
                device_id = jnp.asarray(ids)[position]

                def work() -> jax.Array:
                    return per_device(state, part, position, device_id)

                shape = jax.eval_shape(work)
                skip = lambda: jnp.zeros(shape.shape, shape.dtype)  # noqa: E731
                return jax.lax.cond(want[0], work, skip)[None]

            # manual over the data axis (a model group one unit, as the step's own body)
            manual = {} if options.model_parallel == 1 else {"axis_names": frozenset({axis})}
            mapped = jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(specs, P(axis), P(axis), P(axis)),
                out_specs=P(axis),
                check_vma=False,  # as the step's own programs
                **manual,
            )
            return mapped(state, batch, want, step)

        return jax.jit(run)

    def _run(
        self, program: Any, state: TrainState, batch: Batch, chunks: Sequence[int], step: int
    ) -> dict[int, np.ndarray]:
        """``program`` on ``state`` and ``batch`` (placed as the step places it) for the
        devices at positions ``chunks``; what the devices of this process found, by
        position (those asked for)."""
        want = np.isin(np.arange(self.n), np.asarray(list(chunks), np.int64))
        # each device's own entry of both (split as the step's extras are, on any backend)
        given = {"want": want, "step": np.full(self.n, step, np.int32)}
        extras = self.backend.place_extras(given, {"want": True, "step": True})
        placed = self.backend.place_batch(batch)
        out = program(state, placed, extras["want"], extras["step"])
        # each device by the position of its unit (model_parallel: every device of a
        # group holds the group's result; the first read is kept)
        position = {d: i for i, g in enumerate(self.options.groups) for d in g}
        mine = set(local_positions(self.devices)) & {int(c) for c in chunks}
        found = {}
        for shard in out.addressable_shards:
            p = position[shard.device]
            if p in mine and p not in found:
                found[p] = np.asarray(shard.data)[0]
        return found


def _with_axis(fn: Callable[[PyTree], jax.Array], axis: str, tree: PyTree) -> jax.Array:
    """``fn(tree)`` with ``axis`` bound to an axis of size one (so collectives in the
    model see these rows alone; it shadows the step's device axis of that name)."""
    return jax.vmap(fn, axis_name=axis)(jax.tree.map(lambda x: x[None], tree))[0]
