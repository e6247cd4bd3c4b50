"""The sharded layouts (``make_train_step(shard_state=...)``): :class:`OptimizerShards`
(ZeRO-1) and :class:`ParamShards` (FSDP), each over the ``replicas`` groups of its
:class:`~jaxstep._src.program._grid.Grid` and the padding its
:class:`~jaxstep._src.program._shards.Plan` holds after an exclusion.

One program shape for both layouts: inside a ``shard_map`` each device runs its own
part and checks as under the replicated layout (:mod:`jaxstep._src.program._local`), then the
gradients are reduce-scattered along each sharded leaf's axis (``"params"``: inside the
backward, :mod:`jaxstep._src.program._fsdp`) while the replicated leaves, the float model
state and the health rows ride in one ``psum`` as today; the ``shard_map`` returns the
reduced gradients as global arrays sharded by the rule (:mod:`jaxstep._src.program._shards`).
The verdict and the optimizer's update run after it, in the same ``jit``, on global
arrays (``lax.cond(ok, update, keep)``): XLA partitions the update over the shards,
and optax transforms that look at the whole tree (``clip_by_global_norm``) stay right,
where a per-shard update inside the ``shard_map`` would compute them per shard.

Under ``on_failure="drop"`` (:class:`jaxstep._src.program._policies.Drop`) a device is
left out of the sums by what its forward pass tells (input, loss, model state, user
checks), before any gradient is scattered; a device whose gradients alone turn out
non-finite (known leaf by leaf, after other leaves were scattered) makes the step run
its forward and backward once more, in a ``lax.cond``, with that device left out: one
more pass, on such failing steps only.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxstep._src.core import Batch
from jaxstep._src.core import PyTree
from jaxstep._src.core import TrainState
from jaxstep._src.program import _fsdp as fsdp
from jaxstep._src.program._device import device_work
from jaxstep._src.program._device import microbatched_work
from jaxstep._src.program._gathered import Gathered
from jaxstep._src.program._gathered import Reduced
from jaxstep._src.program._gathered import Seen
from jaxstep._src.program._grid import Grid
from jaxstep._src.program._layouts import Body
from jaxstep._src.program._layouts import Finish
from jaxstep._src.program._layouts import Parted
from jaxstep._src.program._layouts import Rerun
from jaxstep._src.program._layouts import Result
from jaxstep._src.program._local import Beat
from jaxstep._src.program._local import Here
from jaxstep._src.program._local import LocalPart
from jaxstep._src.program._local import chunk_key
from jaxstep._src.program._local import local_part
from jaxstep._src.program._model import chip_prints
from jaxstep._src.program._model import merged
from jaxstep._src.program._model import model_specs
from jaxstep._src.program._model_dims import model_dims
from jaxstep._src.program._on_shards import OnShards
from jaxstep._src.program._options import Options
from jaxstep._src.program._policies import OnFailure
from jaxstep._src.program._reduce import floats_of
from jaxstep._src.program._reduce import received
from jaxstep._src.program._reduce import send
from jaxstep._src.program._reduce import with_floats
from jaxstep._src.program._shards import Plan


def shard_mask(plan: Plan, state: TrainState) -> list[bool]:
    """Which leaves of (params, opt_state, model_state) a device holds a shard of."""
    ms = len(jax.tree.leaves(state.model_state))
    return [a is not None for a in (*plan.params, *plan.opt)] + [False] * ms


class OptimizerShards:
    """``shard_state="optimizer"`` (ZeRO-1): the parameters whole on every device, the
    optimizer state sharded by ``plan`` over a group of ``grid``; each device's
    gradients reduce-scattered after its local part."""

    #: the gradients leave the local part already reduce-scattered (``"params"``)
    scattered = False

    def __init__(
        self, options: Options, plan: Plan, grid: Grid, mesh: Mesh, extra_specs: Mapping[str, P]
    ):
        self.options, self.plan, self.grid = options, plan, grid
        self.mesh, self.extra_specs = mesh, dict(extra_specs)

    def replica_view(self, state: TrainState) -> tuple[Sequence[bool] | None, Grid | None]:
        # diverged copies (and shards, among twins) repaired first
        return shard_mask(self.plan, state), self.grid

    def twins(self, state: TrainState) -> tuple[Sequence[bool] | None, int]:
        return (shard_mask(self.plan, state) if self.grid.grouped else None), self.grid.k

    def chip_prints(self, state: TrainState) -> jax.Array:
        # read on the blocks the body takes (replica groups: each group's, tiled)
        grid, plan = self.grid, self.plan
        blocks = grid.to_blocks(state, grid.state_specs(plan, state))
        return chip_prints(self.options, blocks, grid.block_specs(plan, state))

    def local_part(
        self,
        policy: OnFailure,
        state: TrainState,
        batch: Batch,
        at: Here,
        *,
        beat: Beat | None,
        check_replicas: bool,
    ) -> tuple[LocalPart, Rerun | None]:
        options = self.options
        # a device left out by what its forward pass tells: its input checked apart
        work_fn = functools.partial(device_work, input_apart=True) if policy.leaves_out else None
        part = local_part(
            options,
            state,
            batch,
            at,
            beat=beat,
            check_replicas=check_replicas,
            # shards with twins are compared
            sharded=None if self.grid.grouped else shard_mask(self.plan, state),
            work_fn=work_fn,
        )

        def rerun(left_out: jax.Array) -> tuple[PyTree, PyTree]:
            key = chunk_key(state, at.chunk)
            again = microbatched_work(
                options, state, batch, key, at.faults, options.microbatches, work_fn
            )
            return again[0].grads, again[0].model_state

        return part, rerun

    def compared_before(self, part: LocalPart) -> LocalPart:
        return part._replace(prints=None)  # compared before (drop.repair_replicas)

    def reduce(
        self,
        policy: OnFailure,
        state: TrainState,
        part: LocalPart,
        at: Here,
        rerun: Rerun | None,
    ) -> Reduced:
        """Each sharded leaf's gradient reduce-scattered (under ``"params"`` already, in
        its backward), the replicated leaves, the float model state and the health rows
        in one ``psum`` (:func:`jaxstep._src.program._reduce.send`: the same rows as the
        replicated layout). Under ``drop``: a device left out by what its forward pass
        tells, and the rerun after a failure only the gradients showed."""
        options = self.options
        summed, sent = send(options, policy, state, part, at)
        leaves, treedef = jax.tree.flatten(part.grads)
        floats = floats_of(part.work.model_state)
        leaves, floats = self._left_out(policy, part.work.forward_failed, leaves, floats)
        model = model_dims(options, state.params)  # a leaf split over the model axis too
        grad_sums, floats, gathered = self._sums(leaves, floats, sent, model)
        assert gathered is not None  # sent rode along
        reduced = received(
            options, policy, part, summed, jax.tree.unflatten(treedef, grad_sums), floats, gathered
        )
        assert rerun is not None  # made by local_part

        def redo(left_here: jax.Array, share: Any) -> tuple[PyTree, PyTree]:
            grads, model_state = rerun(left_here)
            leaves, treedef = jax.tree.flatten(grads)
            floats = floats_of(model_state)
            leaves, floats = self._left_out(policy, left_here, leaves, floats)
            sums, floats, _ = self._sums(leaves, floats, None, model)
            floats = [share(x) for x in floats]
            return jax.tree.unflatten(treedef, sums), with_floats(model_state, floats)

        each = options.microbatches > 1 and self.scattered  # each micro-batch scattered its own
        return policy.rerun(reduced, at.position, each, redo)

    def _left_out(
        self, policy: OnFailure, bad: jax.Array, leaves: list[jax.Array], floats: list[jax.Array]
    ) -> tuple[list[jax.Array], list[jax.Array]]:
        """The local gradients and float model state as ``policy`` leaves them out when
        ``bad`` (one per leaf: each scatter waits for its own leaf alone); the leaves
        scattered already (masked in their backward) as they are."""
        leaves = [
            g if self.scattered and a is not None else policy.leave_out(bad, g)
            for g, a in zip(leaves, self.plan.grads, strict=True)
        ]
        return leaves, policy.leave_out(bad, floats)

    def _sums(
        self,
        leaves: list[jax.Array],
        floats: list[jax.Array],
        sent: jax.Array | None,
        model: Sequence[int | None],
    ) -> tuple[list[jax.Array], list[jax.Array], jax.Array | None]:
        """The gradients reduced (sharded leaves reduce-scattered unless scattered
        already, each by every device of a model group on its own block when ``model``
        splits it: :meth:`Links.of_leaf`; the replicated ones summed with the float
        model state and ``sent``, one ``psum``), the float model state summed, and the
        gathered rows."""
        plan, links = self.plan, self.grid.links
        local = [g for g, a in zip(leaves, plan.grads, strict=True) if a is None]
        out = [
            g
            if a is None or self.scattered
            else links.of_leaf(d).scatter(plan.grad_padded(i, g), a)
            for i, (g, a, d) in enumerate(zip(leaves, plan.grads, model, strict=True))
        ]
        local, floats, gathered = jax.lax.psum((local, floats, sent), self.options.axis_name)
        summed = iter(local)
        out = [next(summed) if a is None else g for g, a in zip(out, plan.grads, strict=True)]
        return out, floats, gathered

    def run(
        self,
        body: Body,
        finish: Finish,
        state: TrainState,
        batch: Batch,
        extras: Any,
        *,
        repairs: bool,
    ) -> Result:
        """Each device's part in a ``shard_map`` on its blocks; the verdict and the
        update after it, on global arrays (:class:`OnShards`)."""
        options, plan, grid = self.options, self.plan, self.grid
        axis = options.axis_name
        specs, blocks = grid.state_specs(plan, state), grid.block_specs(plan, state)
        rows = jax.tree.leaves(batch)[0].shape[0] // options.n

        # the model groups' fingerprints read before the body (chip_prints) do not go out
        kept = {k: s for k, s in self.extra_specs.items() if k != "unit_prints"}

        def part(state: TrainState, batch: Batch, extras: dict[str, Any]) -> Parted:
            out = body(state, batch, extras)
            seen = out.gathered.seen._replace(late=jnp.asarray(out.gathered.seen.late))
            gathered = out.gathered._replace(seen=seen)  # leaves the shard_map
            aux = jax.tree.map(lambda x: x[None], out.aux)
            extras = {k: v for k, v in out.extras.items() if k in kept}
            return out._replace(gathered=gathered, extras=extras, aux=aux, at=None)

        grads = plan.grad_specs(state.params, axis)
        seen = Seen._make([P()] * len(Seen._fields))
        gathered = Gathered._make([P(), P(), seen, P(), grads, P(), P()])
        out_specs = Parted._make([gathered, kept, P(axis), P(), blocks if repairs else None, None])
        # as the replicated step (program.map_body says why; under model_parallel manual
        # over the data axis alone)
        manual = {} if options.model_parallel == 1 else {"axis_names": {axis}}
        mapped = jax.shard_map(
            part,
            mesh=self.mesh,
            in_specs=(blocks, P(axis), self.extra_specs),
            out_specs=out_specs,
            check_vma=False,
            **manual,
        )
        p = mapped(grid.to_blocks(state, specs), batch, extras)
        grad_sums = grid.from_blocks(
            p.gathered.grad_sums, plan.grad_specs(state.params, grid.state_axis)
        )
        if p.repaired is not None:  # the update starts from the repaired copies, not the old
            state = grid.from_blocks(p.repaired, specs)
        inputs = {k: v for k, v in extras.items() if k in kept}
        shards = OnShards(options, plan, grid, state, inputs, kept, rows)
        new_state, out = finish(
            state, p._replace(gathered=p.gathered._replace(grad_sums=grad_sums)), shards
        )
        if options.model_parallel > 1:  # each leaf also split over the model axis
            specs = jax.tree.map(
                merged, specs, model_specs(options, new_state), is_leaf=lambda x: isinstance(x, P)
            )
        placed = jax.tree.map(lambda s: NamedSharding(grid.state_mesh, s), specs)
        new_state = jax.lax.with_sharding_constraint(new_state, placed)
        return new_state, out, p.extras


class ParamShards(OptimizerShards):
    """``shard_state="params"`` (FSDP, ZeRO-3): parameters and optimizer state sharded;
    each parameter gathered for the loss and its cotangent checked, then
    reduce-scattered, in the backward (:mod:`jaxstep._src.program._fsdp`)."""

    scattered = True

    def local_part(
        self,
        policy: OnFailure,
        state: TrainState,
        batch: Batch,
        at: Here,
        *,
        beat: Beat | None,
        check_replicas: bool,
    ) -> tuple[LocalPart, Rerun | None]:
        return fsdp.local_part(
            self.options,
            policy,
            self.plan,
            self.grid,
            state,
            batch,
            at,
            beat=beat,
            check_replicas=check_replicas,
            sharded=shard_mask(self.plan, state),
        )

    def compared_before(self, part: LocalPart) -> LocalPart:
        return part  # the gathered copies are compared after too: a bad link shows there


__all__ = ["OptimizerShards", "ParamShards", "shard_mask"]
