"""The per-device program: what every device runs inside ``shard_map`` / ``pmap``.

its local part (:mod:`jaxstep.program._device`: input, loss, gradients, checks) -> one
all-reduce of (gradients, model state, health rows) -> the checks that compare the
devices' rows -> the same verdict on every device and the optimizer update under
``lax.cond`` (:mod:`jaxstep.program._verdict`). Pure functions over an immutable
:class:`~jaxstep.program._options.Options`; nothing here touches host state.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from jaxstep.core import COL
from jaxstep.core import COLUMNS
from jaxstep.core import Batch
from jaxstep.core import PyTree
from jaxstep.core import Status
from jaxstep.core import StepInfo
from jaxstep.core import StepOutput
from jaxstep.core import TrainState
from jaxstep.core import health
from jaxstep.program import _cross_checks as cross_checks
from jaxstep.program import _drop as drop
from jaxstep.program._device import DeviceWork
from jaxstep.program._device import WorkFn
from jaxstep.program._device import microbatched_work
from jaxstep.program._faults import Context
from jaxstep.program._options import Options
from jaxstep.program._verdict import Seen
from jaxstep.program._verdict import halting_status
from jaxstep.program._verdict import times_share
from jaxstep.program._verdict import update

__all__ = ["Beat", "body"]

#: ``beat(position, step_number, status) -> status``: a host callback telling the host that a
#: device finished its local part (``fit(step_timeout=...)``).
Beat = Callable[[Any, Any, Any], Any]
_SKIPS, _DROPS = COL["consecutive_skips"], COL["consecutive_drops"]  # counters, gathered


def body(
    options: Options,
    state: TrainState,
    batch: Batch,
    extras: dict[str, Any],
    *,
    beat: Beat | None,
    replicas: bool,
) -> tuple[TrainState, StepOutput, dict[str, Any]]:
    """One device's step. ``replicas``: the every-``divergence_every``-th variant that
    also fingerprints this device's copy of the state; ``beat``: call it once the
    local part is done (before the collective). Returns the extras it changed (not
    ``chunk``)."""
    index = jax.lax.axis_index(options.axis_name)
    repair = None
    if options.on_failure == "drop" and replicas:  # a diverged replica is repaired first
        state, repair = drop.repair_replicas(options, state, index)
    # The chunk of the global batch this device holds: its own position, except in a
    # replay that moves the chunks, where the key and the faults travel with the rows.
    chunk = extras["chunk"].reshape(-1)[0]
    ctx, token = fault_context(options, state, batch, extras, index, chunk)
    # 1. input, 2. loss and gradients, 3. local health: all before any collective.
    part = local_part(options, state, batch, ctx, token, index, chunk, beat=beat, replicas=replicas)
    # 4. the first collective, 5. the checks that compare the devices' rows.
    reduced = all_reduce(options, state, part, ctx, index)
    status, seen, columns, extras = compare_devices(options, reduced, part, ctx, extras, repair)
    # 6.-8. the verdict, the same on every device, and the update it allows.
    losses = reduced.rows[:, COL["loss"]]
    new_state, status, columns = update(
        options,
        state,
        losses,
        status,
        seen,
        columns,
        reduced.grad_sums,
        reduced.model_state,
        ctx,
        index,
    )
    table, metrics = outputs(options, reduced.rows, status, columns, losses)
    info = StepInfo(checks=part.checks)
    out = StepOutput(metrics=metrics, health=table, aux=part.work.aux, info=info)
    # only the extras a step changes go out (``fired``): an output chunk was a copy kernel
    return new_state, out, {k: v for k, v in extras.items() if k != "chunk"}


def outputs(
    options: Options,
    rows: jax.Array,
    status: jax.Array,
    columns: dict[str, jax.Array],
    losses: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The step's health table (the gathered ``rows`` with the verdict's ``columns``
    and every device's ``status`` written in) and its metrics (the mean loss, under
    ``drop`` over the chunks the step trained on)."""
    table = health.to_table(rows, {**columns, "status": status})
    metrics = {"loss": jnp.mean(losses)}
    if options.on_failure == "drop":  # the mean over the chunks the step trained on
        kept = ~columns["dropped"]
        metrics = {"loss": jnp.sum(jnp.where(kept, losses, 0.0)) / jnp.maximum(jnp.sum(kept), 1)}
    return table, metrics


def fault_context(
    options: Options,
    state: TrainState,
    batch: Batch,
    extras: dict[str, Any],
    index: jax.Array,
    chunk: jax.Array,
) -> tuple[Context | None, jax.Array]:
    """The injected faults' view of this device's step (None without faults) and the
    token an injected stall sets."""
    ctx, token = None, jnp.zeros((), jnp.int32)
    rows = jax.tree.leaves(batch)[0].shape[0]
    if options.injector:
        ctx = Context(
            step=state.step,
            device_id=jnp.asarray(options.device_ids, jnp.int32)[index],
            chunk=chunk,
            rows=jnp.arange(rows),
            fired=extras["fired"],
        )
        options.injector.check_rows(rows)
        token = options.injector.stall(ctx, token)
    return ctx, token


class LocalPart(NamedTuple):
    """This device's part of the step, ready for the all-reduce."""

    work: DeviceWork  # its loss, gradients and health, before any collective
    grads: PyTree  # the gradients it sends (injected faults and the heartbeat's term in)
    row: dict[str, Any]  # its health row, status included
    prints: jax.Array | None  # its fingerprints (the replica-check variant), or None
    checks: tuple[str, ...]  # the names of the user checks


def local_part(
    options: Options,
    state: TrainState,
    batch: Batch,
    ctx: Context | None,
    token: jax.Array,
    index: jax.Array,
    chunk: jax.Array,
    *,
    beat: Beat | None,
    replicas: bool,
    sharded: Sequence[bool] | None = None,
    work_fn: WorkFn | None = None,
) -> LocalPart:
    """This device's loss, gradients and health row, before any collective; with
    ``replicas`` its fingerprints too, and with ``beat`` the host told it is done. The
    key is folded with the step and ``chunk``: a replay that moves a chunk to another
    device moves its random numbers with it (dropout masks), so a failure that follows
    the chunk is the data's and one that stays is the device's. ``sharded``: which
    leaves of (params, opt_state, model_state) this device holds only a shard of (a
    sharded layout: no replica to compare; their fingerprints are left out);
    ``work_fn``: what each (micro-)batch runs in place of ``device_work``."""
    key = chunk_key(state, chunk)
    work, microbatch, check_names = microbatched_work(
        options, state, batch, key, ctx, options.microbatches, work_fn
    )
    grads, squares, grad_leaf = work.grads, work.grad_squares, work.grad_leaf
    status = work.status | jnp.minimum(token, 0)  # keeps an injected stall ahead
    if ctx is not None:
        grads = options.injector.tree("grad", grads, ctx)
        # an injected gradient fault is checked like a real one
        injected, injected_leaf, _ = health.gradient_health(jax.tree.leaves(grads))
        bad = ~jnp.isfinite(injected)
        squares = jnp.where(bad, injected + squares, squares)
        grad_leaf = health.earliest(grad_leaf, injected_leaf)
        flag: Any = int(Status.GRAD_NONFINITE)
        if options.loss_scale is not None:  # as a real one: an overflow of scaled values
            overflow = (work.input_leaf < 0) & jnp.isfinite(work.loss)
            flag = jnp.where(overflow, int(Status.OVERFLOW), flag)
        status |= jnp.where(bad, flag, 0)
    row = row_of(work, grad_leaf, squares, microbatch)
    prints = None
    if replicas:
        prints, param_leaf = replica_check(state, sharded)
        if options.on_failure == "drop":
            prints = None  # compared before the local part (drop.repair_replicas)
        row["param_leaf"] = param_leaf
        status |= jnp.where(param_leaf >= 0, int(Status.PARAM_NONFINITE), 0)
    if beat is not None:
        # Tell the host this device finished its local part. The gradients take a
        # (zero) term from the callback's result, so it runs before the collective.
        done = io_callback(beat, jax.ShapeDtypeStruct((), jnp.int32), index, state.step, status)
        zero = jnp.minimum(done, 0)  # the callback returns status >= 0
        grads = jax.tree.map(lambda g: g + zero.astype(g.dtype), grads)
        status |= zero
    row["status"] = status
    return LocalPart(work, grads, row, prints, check_names)


def chunk_key(state: TrainState, chunk: jax.Array) -> jax.Array | None:
    """The key of this step's chunk ``chunk`` (None: the state holds none)."""
    if state.rng is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(state.rng, state.step), chunk)


def row_of(
    work: DeviceWork, grad_leaf: jax.Array, squares: jax.Array, microbatch: jax.Array
) -> dict[str, Any]:
    """A device's health row (but its status) from its work."""
    return {
        "input_leaf": work.input_leaf,
        "grad_leaf": grad_leaf,
        "param_leaf": -1,
        "diverged_leaf": -1,
        "model_state_leaf": work.model_state_leaf,
        "microbatch": microbatch,
        "check": health.first_true(work.check_failed),
        "loss": work.loss,
        "grad_norm": squares,  # squared: health.to_table takes the root
    }


class Reduced(NamedTuple):
    """What every device holds after the all-reduce."""

    grad_sums: PyTree  # the gradients summed over the devices (divided in the update)
    model_state: PyTree  # the new model state, its float leaves averaged
    rows: jax.Array  # every device's health row, as packed
    seen: Seen  # the step-wide facts summed alongside
    rest: jax.Array  # (n, k): the fingerprints' halves, then the faults' fire flags
    status: jax.Array  # (n,) every device's status


def all_reduce(
    options: Options,
    state: TrainState,
    part: LocalPart,
    ctx: Context | None,
    index: jax.Array,
) -> Reduced:
    """The first collective: the health rows (one-hot, so the sum is a gather), the
    count of devices failing or halting so far (summed: the verdict needs no
    reduction over the table), the float model state, the fingerprints and the fault
    flags ride in the gradients' all-reduce."""
    summed, sent = send(options, state, part, ctx, index)
    grads, floats = part.grads, floats_of(part.work.model_state)
    if options.on_failure == "drop":  # a failing device sends zeros: left out of the mean
        grads, floats = drop.leave_out(summed[0], (grads, floats))
    # The gradients stay summed here: the division by n happens inside the update,
    # where it fuses into the optimizer's pass (a kernel and a pass per leaf saved).
    grad_sums, floats, gathered = jax.lax.psum((grads, floats, sent), options.axis_name)
    return received(options, part, summed, grad_sums, floats, gathered)


def send(
    options: Options,
    state: TrainState,
    part: LocalPart,
    ctx: Context | None,
    index: jax.Array,
) -> tuple[list[jax.Array], jax.Array]:
    """This device's columns summed over the devices (``summed``) and what it sends
    of the health table (its one-hot row, the summed columns, its fingerprints' halves
    and the faults' fire flags)."""
    n, status = options.n, part.row["status"]
    extra = []
    if part.prints is not None:
        extra.append(cross_checks.split16(part.prints))
    if ctx is not None:
        extra.append(options.injector.fire_flags(ctx).astype(jnp.float32))
    halting = int(halting_status(options))
    summed = [
        (status & ~int(Status.OVERFLOW)) != 0,
        (status & int(Status.OVERFLOW)) != 0,
        (status & halting) != 0,
        # The state's halted flag and step (from the first device, in exact 16-bit
        # halves), read here, before the all-reduce, and not after: XLA then updates
        # their donated buffers in place instead of copying them first.
        state.halted,
        jnp.where(index == 0, state.step // 65536, 0),
        jnp.where(index == 0, state.step % 65536, 0),
    ]
    if options.on_failure == "drop" and options.max_consecutive_drops is not None:
        # failing again, and max_consecutive_drops times in a row: counted here, in
        # the summed columns, so the verdict needs no reduction over the devices
        drops = state.monitor["drops"][index]
        summed.append(summed[0] & (drops + 1 >= options.max_consecutive_drops))
    row = part.row  # (skip, drop) the counters the verdict reads, gathered here (as above)
    if options.on_failure != "raise":
        row = {**row, "consecutive_skips": state.consecutive_skips}
    if options.on_failure == "drop":
        row["consecutive_drops"] = state.monitor["drops"][index]
    sent = health.onehot_rows(row, index, n, summed, jnp.concatenate(extra) if extra else None)
    return summed, sent


def received(
    options: Options,
    part: LocalPart,
    summed: list[jax.Array],
    grad_sums: PyTree,
    floats: list[jax.Array],
    gathered: jax.Array,
) -> Reduced:
    """What the all-reduce gathered, unpacked: the rows, the step-wide facts, the
    float model state averaged (over the devices kept, under ``drop``)."""
    n = options.n
    width = len(COLUMNS) + len(summed)
    rows = gathered[:, : len(COLUMNS)]  # every device's row, as packed
    counts = gathered[0, len(COLUMNS) : width]
    if options.on_failure == "drop":  # the mean over the devices not left out
        healthy = jnp.maximum(n - counts[0], 1)  # see update's ``mean``
        floats = [times_share(x, healthy) for x in floats]
    else:
        floats = [x / n for x in floats]
    model_state = with_floats(part.work.model_state, floats)
    seen = Seen(
        failed=counts[0] > 0,
        overflow=counts[1] > 0,
        halt=counts[2] > 0,
        halted=counts[3] > 0,
        step=counts[4].astype(jnp.int32) * 65536 + counts[5].astype(jnp.int32),
        failing=counts[0],
        repeats=counts[6] > 0 if len(summed) > 6 else None,
        skips=None if options.on_failure == "raise" else rows[0, _SKIPS].astype(jnp.int32),
        drops=rows[:, _DROPS].astype(jnp.int32) if options.on_failure == "drop" else None,
    )
    rest = gathered[:, width:]
    status = rows[:, COL["status"]].astype(jnp.int32)
    return Reduced(grad_sums, model_state, rows, seen, rest, status)


def compare_devices(
    options: Options,
    reduced: Reduced,
    part: LocalPart,
    ctx: Context | None,
    extras: dict[str, Any],
    repair: drop.Repair | None = None,
) -> tuple[jax.Array, Seen, dict[str, jax.Array], dict[str, Any]]:
    """What the gathered rows tell that no device knew alone: which replicas diverged
    (the fingerprints' minority; under ``drop``, ``repair`` found them before the
    local part) and which faults fired anywhere. Returns every device's status, the
    step-wide facts, the table's columns changed after the gather and the extras."""
    status, seen, rest = reduced.status, reduced.seen, reduced.rest
    columns: dict[str, jax.Array] = {}
    if options.on_failure == "drop":
        seen = seen._replace(left_out=drop.left_out(status))
    if repair is not None:
        added = jnp.where(repair.diverged, int(Status.DIVERGED), 0)
        status |= added
        seen = seen.add(added, int(halting_status(options)))
        columns["diverged_leaf"] = repair.first
        columns["repaired"] = repair.repaired
    if part.prints is not None:
        prints = part.prints
        diverged, first = cross_checks.minority(cross_checks.join16(rest[:, : 2 * prints.shape[0]]))
        added = jnp.where(diverged, int(Status.DIVERGED), 0)
        status |= added
        seen = seen.add(added, int(halting_status(options)))
        columns["diverged_leaf"] = first
    if ctx is not None:
        fired = jnp.any(rest[:, rest.shape[1] - len(options.injector.faults) :] > 0, axis=0)
        extras = dict(extras, fired=extras["fired"] | fired)
    return status, seen, columns, extras


def floats_of(tree: PyTree) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def with_floats(tree: PyTree, floats: list[jax.Array]) -> PyTree:
    """``tree`` with its float leaves replaced, in order, by ``floats``."""
    it = iter(floats)
    return jax.tree.map(lambda x: next(it) if jnp.issubdtype(x.dtype, jnp.inexact) else x, tree)


def replica_check(
    state: TrainState, sharded: Sequence[bool] | None = None
) -> tuple[jax.Array, jax.Array]:
    """This device's fingerprint of its own copy of params, optimizer state and model
    state, and its first non-finite parameter leaf (or -1). In the every-k-steps
    program only. ``sharded``: the leaves held as shards (fingerprint 0: a shard has
    no second copy to compare)."""
    leaves = jax.tree.leaves((state.params, state.opt_state, state.model_state))
    n_params = len(jax.tree.leaves(state.params))
    if sharded is None:
        return cross_checks.fingerprint(leaves), health.first_nonfinite(leaves[:n_params])[1]
    copies = cross_checks.without_shards(leaves, sharded)
    return cross_checks.fingerprint(copies), health.first_nonfinite(leaves[:n_params])[1]
