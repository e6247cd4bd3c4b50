"""The step under a sharded layout (``make_train_step(shard_state=...)``).

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

Under ``on_failure="drop"`` a device is left out of the sums by what its forward pass
tells (input, loss, model state, user checks), before any gradient is scattered; a
device whose gradients alone turn out non-finite (known leaf by leaf, after other
leaves were scattered) makes the step run its forward and backward once more, in a
``lax.cond``, with that device left out: one more pass, on such failing steps only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxstep._src.core import Batch
from jaxstep._src.core import PyTree
from jaxstep._src.core import Status
from jaxstep._src.core import StepInfo
from jaxstep._src.core import StepOutput
from jaxstep._src.core import TrainState
from jaxstep._src.program import _drop as drop
from jaxstep._src.program import _fsdp as fsdp
from jaxstep._src.program._body import body
from jaxstep._src.program._body import map_body
from jaxstep._src.program._body import outputs
from jaxstep._src.program._device import device_work
from jaxstep._src.program._device import microbatched_work
from jaxstep._src.program._grid import Grid
from jaxstep._src.program._local import Beat
from jaxstep._src.program._local import Here
from jaxstep._src.program._local import LocalPart
from jaxstep._src.program._local import chunk_key
from jaxstep._src.program._local import here
from jaxstep._src.program._local import local_part
from jaxstep._src.program._on_shards import OnShards
from jaxstep._src.program._options import Options
from jaxstep._src.program._reduce import Reduced
from jaxstep._src.program._reduce import compare_devices
from jaxstep._src.program._reduce import floats_of
from jaxstep._src.program._reduce import received
from jaxstep._src.program._reduce import send
from jaxstep._src.program._reduce import with_floats
from jaxstep._src.program._shards import Plan
from jaxstep._src.program._verdict import Gathered
from jaxstep._src.program._verdict import Seen
from jaxstep._src.program._verdict import times_share
from jaxstep._src.program._verdict import update

#: the failures a device's forward pass tells (a drop leaves it out before any scatter)
FORWARD = int(
    Status.INPUT_NONFINITE
    | Status.LOSS_NONFINITE
    | Status.MODEL_STATE_NONFINITE
    | Status.CHECK_FAILED
)

Rerun = Callable[[jax.Array], tuple[PyTree, PyTree]]


class Parted(NamedTuple):
    """What the ``shard_map`` hands the update: what the collective gathered (the
    reduced gradients, a shard of each sharded leaf and the sum of each replicated one,
    the new model state, every device's loss, status and row, the step-wide facts), the
    extras it changed, and each device's ``aux``."""

    gathered: Gathered
    extras: dict[str, Any]
    aux: PyTree
    info: StepInfo
    #: under ``drop``, at a replica-check step: the state with every diverged replica
    #: repaired inside the ``shard_map`` (what the update must start from); else None
    repaired: TrainState | None = None


def shard_mask(plan: Plan, state: TrainState) -> list[bool]:
    """Which leaves of (params, opt_state, model_state) a device holds a shard of."""
    ms = len(jax.tree.leaves(state.model_state))
    return [a is not None for a in (*plan.params, *plan.opt)] + [False] * ms


def sharded_step(
    options: Options,
    mesh: Mesh,
    extra_specs: Mapping[str, P],
    state: TrainState,
    batch: Batch,
    extras: dict[str, Any],
    *,
    beat: Beat | None,
    check_replicas: bool,
) -> tuple[TrainState, StepOutput, dict[str, Any]]:
    """The whole step on global arrays (traced inside the backend's ``jit``): each
    device's part in a ``shard_map``, then the verdict and the update."""
    axis = options.axis_name
    plan = Plan.of(options, state)
    if not plan.sharded:  # the rule shards no leaf: the replicated step, bit for bit
        device_step = functools.partial(body, options, beat=beat, check_replicas=check_replicas)
        return map_body(device_step, mesh, axis, extra_specs)(state, batch, extras)
    grid = Grid(mesh, options.replicas)
    specs, blocks = grid.state_specs(plan, state), grid.block_specs(plan, state)
    rows = jax.tree.leaves(batch)[0].shape[0] // options.n

    def part(state: TrainState, batch: Batch, extras: dict[str, Any]) -> Parted:
        out = device_part(
            options, plan, grid, state, batch, extras, beat=beat, check_replicas=check_replicas
        )
        return out._replace(aux=jax.tree.map(lambda x: x[None], out.aux))

    grads = plan.grad_specs(state.params, axis)
    seen = Seen._make([P()] * len(Seen._fields))
    gathered = Gathered._make([P(), P(), seen, P(), grads, P(), P()])
    repairs = options.on_failure == "drop" and check_replicas  # the repaired state comes out
    out_specs = Parted._make(
        [gathered, dict(extra_specs), P(axis), P(), blocks if repairs else None]
    )
    mapped = jax.shard_map(
        part,
        mesh=mesh,
        in_specs=(blocks, P(axis), dict(extra_specs)),
        out_specs=out_specs,
        check_vma=False,  # as the replicated step (program.map_body says why)
    )
    p = mapped(grid.to_blocks(state, specs), batch, extras)
    grad_sums = grid.from_blocks(
        p.gathered.grad_sums, plan.grad_specs(state.params, grid.state_axis)
    )
    if p.repaired is not None:  # the update starts from the repaired copies, not the old
        state = grid.from_blocks(p.repaired, specs)
    shards = OnShards(options, plan, grid, state, extras, dict(extra_specs), rows)
    gathered = p.gathered._replace(grad_sums=grad_sums)
    new_state, status, columns = update(options, state, gathered, shards=shards)
    table, metrics = outputs(options, gathered.rows, status, columns, gathered.losses)
    placed = jax.tree.map(lambda s: NamedSharding(grid.state_mesh, s), specs)
    new_state = jax.lax.with_sharding_constraint(new_state, placed)
    return new_state, StepOutput(metrics=metrics, health=table, aux=p.aux, info=p.info), p.extras


def device_part(
    options: Options,
    plan: Plan,
    grid: Grid,
    state: TrainState,
    batch: Batch,
    extras: dict[str, Any],
    *,
    beat: Beat | None,
    check_replicas: bool,
) -> Parted:
    """One device's step up to the update (inside the ``shard_map``): its local part and
    checks, the reduction, the checks that compare the devices' rows."""
    at = here(options, state, batch, extras)
    shards = shard_mask(plan, state)
    dropping = options.on_failure == "drop"
    repair = None
    if dropping and check_replicas:  # diverged copies (and shards, among twins) repaired first
        state, repair = drop.repair_replicas(options, state, at.position, shards, grid)
    rerun: Rerun
    if options.shard_state == "params":
        part, rerun = fsdp.local_part(
            options,
            plan,
            grid,
            state,
            batch,
            at,
            beat=beat,
            check_replicas=check_replicas,
            sharded=shards,
        )
    else:
        work_fn = functools.partial(device_work, input_apart=True) if dropping else None
        part = local_part(
            options,
            state,
            batch,
            at,
            beat=beat,
            check_replicas=check_replicas,
            sharded=None if grid.grouped else shards,  # shards with twins are compared
            work_fn=work_fn,
        )
        if dropping and check_replicas:
            part = part._replace(prints=None)  # compared before (drop.repair_replicas)

        def rerun(left_out: jax.Array) -> tuple[PyTree, PyTree]:
            key = chunk_key(state, at.chunk)
            again = microbatched_work(
                options, state, batch, key, at.ctx, options.microbatches, work_fn
            )
            return again[0].grads, again[0].model_state

    reduced = reduce(options, plan, grid, state, part, at, rerun)
    twinned = shards if grid.grouped else None
    gathered, extras = compare_devices(options, reduced, part, at, extras, repair, twinned, grid.k)
    seen = gathered.seen._replace(late=jnp.asarray(gathered.seen.late))  # leaves the shard_map
    gathered = gathered._replace(seen=seen)
    repaired = state if repair is not None else None
    return Parted(gathered, extras, part.work.aux, StepInfo(part.checks), repaired)


def reduce(
    options: Options,
    plan: Plan,
    grid: Grid,
    state: TrainState,
    part: LocalPart,
    at: Here,
    rerun: Rerun,
) -> Reduced:
    """The reduction of a sharded layout: each sharded leaf's gradient reduce-scattered
    (under ``"params"`` already, in its backward), the replicated leaves, the float
    model state and the health rows in one ``psum`` (:func:`jaxstep._src.program._reduce.send`:
    the same rows as the replicated step). Under ``drop``: a device left out by what
    its forward pass tells, and the rerun after a failure only the gradients showed."""
    summed, sent = send(options, state, part, at)
    leaves, treedef = jax.tree.flatten(part.grads)
    floats = floats_of(part.work.model_state)
    scattered = options.shard_state == "params"
    if options.on_failure == "drop":
        leaves, floats = _left_out(plan, part.work.forward_failed, leaves, floats, scattered)
    grad_sums, floats, gathered = _sums(options, plan, grid, leaves, floats, sent, scattered)
    assert gathered is not None  # sent rode along
    reduced = received(
        options, part, summed, jax.tree.unflatten(treedef, grad_sums), floats, gathered
    )
    if options.on_failure != "drop":
        return reduced
    status = reduced.status
    left = drop.left_out(status)
    if options.microbatches > 1 and scattered:  # each micro-batch scattered its own
        again = jnp.any(left)
    else:
        again = jnp.any(left & ((status & FORWARD) == 0))  # its gradients alone failed
    again &= (reduced.seen.failing <= options.dropped_limit) & ~reduced.seen.halted
    healthy = jnp.maximum(options.n - reduced.seen.failing, 1)

    def once_more(_: Any) -> tuple[PyTree, PyTree]:
        grads, model_state = rerun(left[at.position])
        leaves, treedef = jax.tree.flatten(grads)
        floats = floats_of(model_state)
        leaves, floats = _left_out(plan, left[at.position], leaves, floats, scattered)
        sums, floats, _ = _sums(options, plan, grid, leaves, floats, None, scattered)
        floats = [times_share(x, healthy) for x in floats]
        return jax.tree.unflatten(treedef, sums), with_floats(model_state, floats)

    def as_reduced(_: Any) -> tuple[PyTree, PyTree]:
        return reduced.grad_sums, reduced.model_state

    grad_sums, model_state = jax.lax.cond(again, once_more, as_reduced, None)
    return reduced._replace(grad_sums=grad_sums, model_state=model_state)


def _left_out(
    plan: Plan, bad: jax.Array, leaves: list[jax.Array], floats: list[jax.Array], scattered: bool
) -> tuple[list[jax.Array], list[jax.Array]]:
    """The local gradients and float model state zeroed when ``bad`` (a ``lax.cond`` per
    leaf: each scatter waits for its own leaf alone); the leaves scattered already
    (``scattered``: masked in their backward) as they are."""
    leaves = [
        g if scattered and a is not None else drop.leave_out(bad, g)
        for g, a in zip(leaves, plan.grads, strict=True)
    ]
    return leaves, drop.leave_out(bad, floats)


def _sums(
    options: Options,
    plan: Plan,
    grid: Grid,
    leaves: list[jax.Array],
    floats: list[jax.Array],
    sent: jax.Array | None,
    scattered: bool,
) -> tuple[list[jax.Array], list[jax.Array], jax.Array | None]:
    """The gradients reduced (sharded leaves reduce-scattered unless ``scattered``
    already; the replicated ones summed with the float model state and ``sent``, one
    ``psum``), the float model state summed, and the gathered rows."""
    axis = options.axis_name
    local = [g for g, a in zip(leaves, plan.grads, strict=True) if a is None]
    out = [
        g if a is None or scattered else grid.scatter(plan.grad_padded(i, g), a)
        for i, (g, a) in enumerate(zip(leaves, plan.grads, strict=True))
    ]
    local, floats, gathered = jax.lax.psum((local, floats, sent), axis)
    summed = iter(local)
    out = [next(summed) if a is None else g for g, a in zip(out, plan.grads, strict=True)]
    return out, floats, gathered


__all__ = ["Parted", "device_part", "reduce", "shard_mask", "sharded_step"]
