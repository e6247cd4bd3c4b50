"""The update of a sharded layout (``make_train_step(shard_state=...)``), on global
arrays after the step's ``shard_map``: the parameters as the optimizer sees them (each
device's shard, padded where the layout holds a leaf padded after an exclusion) and as
the state holds them, and ``verify_update``'s check of each device's own shard."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxstep._src.core import Params
from jaxstep._src.core import PyTree
from jaxstep._src.core import TrainState
from jaxstep._src.core import health
from jaxstep._src.program._grid import Grid
from jaxstep._src.program._model import merged
from jaxstep._src.program._model import model_specs
from jaxstep._src.program._options import Options
from jaxstep._src.program._padding import cut
from jaxstep._src.program._shards import Plan


class OnShards:
    """:class:`jaxstep._src.program._verdict.View` for one traced step: the update on
    the global arrays of a sharded layout (after the step's ``shard_map``)."""

    def __init__(
        self,
        options: Options,
        plan: Plan,
        grid: Grid,
        state: TrainState,
        extras: dict[str, Any],
        extra_specs: dict[str, P],
        rows: int,
    ):
        self.options, self.plan, self.grid = options, plan, grid
        self.mesh = grid.state_mesh  # the update runs on the state's global arrays
        self._grad_specs = plan.grad_specs(state.params, grid.state_axis)
        self._blocks = plan.grad_specs(state.params, options.axis_name)  # the step's mesh
        self._param_specs = plan.specs(state, grid.state_axis).params
        if options.model_parallel > 1:  # global arrays: each leaf split over both axes
            model = model_specs(options, state).params
            both = lambda a, b: jax.tree.map(merged, a, b, is_leaf=lambda x: isinstance(x, P))  # noqa: E731
            self._grad_specs = both(self._grad_specs, model)
            self._param_specs = both(self._param_specs, model)
        self._step = state.step
        self._extras = extras
        self._extra_specs = extra_specs
        self._rows = rows

    def _named(self, specs: PyTree) -> PyTree:
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)

    def to_shards(self, params: Params) -> Params:
        """Each device's shard of each sharded gradient's parameter (under
        ``"optimizer"`` a slice of the replicated parameters: no data moves; a leaf
        held padded, padded as its gradient is)."""
        return jax.lax.with_sharding_constraint(
            self.plan.grad_view(params), self._named(self._grad_specs)
        )

    def to_state(self, params: Params) -> Params:
        """The parameters as the state holds them (under ``"optimizer"`` replicated:
        XLA all-gathers the updated shards, cut to their logical shapes)."""
        to_shards = jax.lax.with_sharding_constraint(params, self._named(self._grad_specs))
        if self.plan.grad_pads and self.options.shard_state == "optimizer":
            leaves, treedef = jax.tree.flatten(to_shards)
            leaves = [
                x if p is None or a is None else cut(x, a, p[0])
                for x, a, p in zip(leaves, self.plan.grads, self.plan.grad_pads, strict=True)
            ]
            to_shards = jax.tree.unflatten(treedef, leaves)
        return jax.lax.with_sharding_constraint(to_shards, self._named(self._param_specs))

    def verify(self, params: Params) -> jax.Array:
        """``verify_update``: every device's first non-finite leaf of the shard of the
        new parameters it computed ((n,), -1: none), one small ``psum``."""
        options = self.options

        def check(shards: Params, number: jax.Array, extras: dict[str, Any]) -> jax.Array:
            index = jax.lax.axis_index(options.axis_name)
            chunk = extras["chunk"].reshape(-1)[0]
            faults = options.arm(number, chunk, self._rows, extras.get("fired"), position=index)
            shards = faults.params(shards)
            leaf = health.first_nonfinite(jax.tree.leaves(shards))[1]
            mine = jnp.arange(options.n) == index
            return jax.lax.psum(jnp.where(mine, leaf, 0), options.axis_name)

        # on the step's mesh: each device checks its block (a model group: its unit's)
        manual = {} if options.model_parallel == 1 else {"axis_names": {options.axis_name}}
        mapped = jax.shard_map(
            check,
            mesh=self.grid.mesh,
            in_specs=(self._blocks, P(), self._extra_specs),
            out_specs=P(),
            check_vma=False,
            **manual,
        )
        shards = self.to_shards(params)
        blocks = self.grid.to_blocks(shards, self._grad_specs)
        return mapped(blocks, self._step, self._extras)


__all__ = ["OnShards"]
