"""The per-device program: what every device runs inside ``shard_map`` / ``pmap``.

check the local input, loss and gradients -> one all-reduce of (gradients, health
rows) -> the same verdict on every device -> the optimizer update under ``lax.cond``.
Pure functions over an immutable :class:`Program`; nothing here touches host state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.experimental import io_callback

from jaxstep import health
from jaxstep import monitors
from jaxstep import validate
from jaxstep.faults import Context
from jaxstep.faults import Injector
from jaxstep.health import COL
from jaxstep.health import COLUMNS
from jaxstep.health import Status
from jaxstep.monitors import LossSpike
from jaxstep.state import StepInfo
from jaxstep.state import StepOutput
from jaxstep.state import TrainState

# Failures that skipping a step cannot cure: they halt under either policy.
ALWAYS_HALT = Status.DIVERGED | Status.HUNG

#: ``beat(position, step, status) -> status``: a host callback telling the host that a
#: device finished its local part (``fit(step_timeout=...)``).
Beat = Callable[[Any, Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything the per-device program depends on, fixed when the step is built."""

    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    has_aux: bool
    on_failure: str
    max_consecutive_skips: int | None
    loss_spike: LossSpike | None
    verify_update: bool
    faults: Injector
    device_ids: tuple[int, ...]
    axis_name: str

    @property
    def n(self) -> int:
        return len(self.device_ids)


def loss(program: Program, *args: Any, ctx: Context | None) -> tuple[jax.Array, Any]:
    """``loss_fn(*args)`` as ``(loss, aux)``, with an injected loss fault applied."""
    value, aux = validate.loss_output(program.loss_fn(*args), program.has_aux)
    if ctx is not None:
        value = program.faults.loss(value, ctx)
    return value, aux


def loss_args(program: Program, state: TrainState, batch: Any, index: Any) -> tuple[Any, ...]:
    """The arguments of ``loss_fn`` on the device at ``index`` (its key folded in)."""
    args: tuple[Any, ...] = (state.params, batch)
    if state.rng is not None:
        args += (jax.random.fold_in(jax.random.fold_in(state.rng, state.step), index),)
    return args


def body(
    program: Program,
    state: TrainState,
    batch: Any,
    extras: dict[str, Any],
    *,
    beat: Beat | None,
    replicas: bool,
) -> tuple[TrainState, StepOutput, dict[str, Any]]:
    """One device's step. ``replicas``: the every-``divergence_every``-th variant that
    also fingerprints this device's copy of the state; ``beat``: call it once the
    local part is done (before the collective)."""
    axis, n = program.axis_name, program.n
    index = jax.lax.axis_index(axis)
    ctx, token = None, jnp.zeros((), jnp.int32)
    rows = jax.tree.leaves(batch)[0].shape[0]
    if program.faults:
        ctx = Context(
            step=state.step,
            device_id=jnp.asarray(program.device_ids, jnp.int32)[index],
            chunk=extras["chunk"].reshape(-1)[0],
            rows=jnp.arange(rows),
            fired=extras["fired"],
        )
        program.faults.check_rows(rows)
        token = program.faults.stall(ctx, token)
        batch = program.faults.input(batch, ctx)

    # 1. input, 2. loss and gradients, 3. local health: all before any collective.
    in_bad, in_leaf = health.first_nonfinite(jax.tree.leaves(batch))

    def loss_fn(*args: Any) -> tuple[jax.Array, Any]:
        return loss(program, *args, ctx=ctx)

    args = loss_args(program, state, batch, index)
    (value, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(*args)
    checks, aux = validate.checks(aux)
    if ctx is not None:
        grads = program.faults.tree("grad", grads, ctx)
    squares = health.leaf_sum_of_squares(jax.tree.leaves(grads))
    grad_bad = ~jnp.isfinite(squares)
    status = (
        jnp.where(in_bad, int(Status.INPUT_NONFINITE), 0)
        | jnp.where(jnp.isfinite(value), 0, int(Status.LOSS_NONFINITE))
        | jnp.where(jnp.any(grad_bad), int(Status.GRAD_NONFINITE), 0)
        | jnp.minimum(token, 0)  # keeps an injected stall ahead of the collective
    )
    check_failed = ~jnp.stack(list(checks.values())) if checks else None
    if check_failed is not None:
        status |= jnp.where(jnp.any(check_failed), int(Status.CHECK_FAILED), 0)
    row = {
        "input_leaf": in_leaf,
        "grad_leaf": health.first_true(grad_bad),
        "param_leaf": -1,
        "diverged_leaf": -1,
        "check": -1 if check_failed is None else health.first_true(check_failed),
        "loss": value,
        "grad_norm": jnp.sqrt(jnp.sum(squares)),
    }
    prints = None
    if replicas:
        prints, param_leaf = replica_check(program, state)
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

    # 4. the first collective: the health rows (one-hot, so the sum is a gather),
    # the fingerprints and the fault flags ride in the gradients' all-reduce.
    parts = [health.pack_row(row)]
    if prints is not None:
        parts.append(monitors.split16(prints))
    if ctx is not None:
        parts.append(program.faults.fire_flags(ctx).astype(jnp.float32))
    mine = (jnp.arange(n) == index)[:, None]
    grads, gathered = jax.lax.psum((grads, jnp.where(mine, jnp.concatenate(parts), 0)), axis)
    grads = jax.tree.map(lambda g: g / n, grads)
    rows = gathered[:, : len(COLUMNS)]  # every device's row, as packed
    rest = gathered[:, len(COLUMNS) :]
    status = rows[:, COL["status"]].astype(jnp.int32)
    columns: dict[str, jax.Array] = {}  # the table's columns changed after the gather
    if prints is not None:
        diverged, first = monitors.minority(monitors.join16(rest[:, : 2 * prints.shape[0]]))
        status |= jnp.where(diverged, int(Status.DIVERGED), 0)
        columns["diverged_leaf"] = first
    if ctx is not None:
        fired = jnp.any(rest[:, rest.shape[1] - len(program.faults.faults) :] > 0, axis=0)
        extras = dict(extras, fired=extras["fired"] | fired)

    # 5.-8. the verdict, the same on every device, and the update it allows.
    losses = rows[:, COL["loss"]]
    new_state, status, columns = update(program, state, losses, status, columns, grads, ctx, mine)
    table = health.to_table(rows, {**columns, "status": status})
    metrics = {"loss": jnp.mean(losses)}
    info = StepInfo(checks=tuple(checks))
    return new_state, StepOutput(metrics=metrics, health=table, aux=aux, info=info), extras


def replica_check(program: Program, state: TrainState) -> tuple[jax.Array, jax.Array]:
    """This device's fingerprint of its own copy of params and optimizer state, and
    its first non-finite parameter leaf (or -1). In the every-k-steps program only."""
    leaves = jax.tree.leaves((state.params, state.opt_state))
    n_params = len(jax.tree.leaves(state.params))
    return monitors.fingerprint(leaves), health.first_nonfinite(leaves[:n_params])[1]


def update(
    program: Program,
    state: TrainState,
    losses: jax.Array,
    status: jax.Array,
    columns: dict[str, jax.Array],
    grads: Any,
    ctx: Context | None,
    mine: jax.Array,
) -> tuple[TrainState, jax.Array, dict[str, jax.Array]]:
    """Decides, then updates. By default everything the verdict needs is known
    before the update, so a ``lax.cond`` skips it on failure: no second pass over
    the state and no extra memory. ``verify_update=True`` also checks the new
    parameters before committing them (one more pass, and a second collective).
    Returns the new state, every device's status and the table columns to write."""

    def apply(operands: tuple[Any, Any]) -> tuple[Any, Any]:
        params, opt_state = operands
        updates, opt_state = program.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    columns = dict(columns)
    if program.verify_update:
        new_params, new_opt_state = apply((state.params, state.opt_state))
        checked = new_params if ctx is None else program.faults.tree("param", new_params, ctx)
        leaf = health.first_nonfinite(jax.tree.leaves(checked))[1]
        leaves = jax.lax.psum(jnp.where(mine[:, 0], leaf, 0), program.axis_name)
        # After a bad gradient every replica's update is bad too: that is the
        # gradient's fault, so parameters are blamed only when nothing else failed.
        bad = (leaves >= 0) & jnp.all(status == 0)
        columns["param_leaf"] = jnp.where(bad, leaves, -1)
        status = status | jnp.where(bad, int(Status.PARAM_NONFINITE), 0)
    status, ok, fields, verdict_columns = verdict(program, state, losses, status)
    if program.verify_update:
        params, opt_state = jax.tree.map(
            lambda a, b: jnp.where(ok, a, b),
            (new_params, new_opt_state),
            (state.params, state.opt_state),
        )
    else:
        params, opt_state = jax.lax.cond(
            ok, apply, lambda operands: operands, (state.params, state.opt_state)
        )
    new_state = dataclasses.replace(state, params=params, opt_state=opt_state, **fields)
    return new_state, status, {**columns, **verdict_columns}


def verdict(
    program: Program, state: TrainState, losses: jax.Array, status: jax.Array
) -> tuple[jax.Array, jax.Array, dict[str, Any], dict[str, jax.Array]]:
    """(every device's status, ok to update, the new state's other fields, the
    step-wide verdict columns of the table)."""
    monitor = state.monitor
    spike = program.loss_spike
    if spike is not None:
        spiked = spike.check(state.monitor["spike"], losses) & (status == 0)
        status = status | jnp.where(spiked, int(Status.LOSS_SPIKE), 0)
    failed = jnp.any(status != 0)
    # Skipping cannot repair a diverged replica, nor parameters that are already
    # non-finite (found by the periodic check; verify_update never commits them).
    halting = ALWAYS_HALT if program.verify_update else ALWAYS_HALT | Status.PARAM_NONFINITE
    must_halt = jnp.any((status & int(halting)) != 0)
    if program.on_failure == "skip":
        limit = program.max_consecutive_skips
        halt_now = must_halt
        if limit is not None:
            halt_now |= failed & (state.consecutive_skips + 1 >= limit)
        skipped = failed & ~halt_now & ~state.halted
    else:
        halt_now = failed
        skipped = jnp.array(False)
    ok = ~failed & ~state.halted
    halted = state.halted | halt_now
    if spike is not None:
        monitor = {"spike": spike.update(state.monitor["spike"], losses, ok)}
    consecutive = jnp.where(ok, 0, state.consecutive_skips + skipped).astype(jnp.int32)
    columns = {
        "step": state.step,
        "halted": halted,
        "skipped": skipped,
        "consecutive_skips": consecutive,
    }
    fields = {
        "step": state.step + (ok | skipped),
        "halted": halted,
        "consecutive_skips": consecutive,
        "total_skips": state.total_skips + skipped,
        "monitor": monitor,
    }
    return status, ok, fields, columns


def example_failed(
    program: Program,
    params: Any,
    rng: jax.Array | None,
    step: jax.Array,
    example: Any,
    chunk: jax.Array,
    row: jax.Array,
) -> jax.Array:
    """Whether one example fails on its own (input, loss, gradient or a user check),
    as if it were row ``row`` of chunk ``chunk`` at ``step``: the replay diagnosis
    runs this over the examples of a failing chunk (``jax.vmap``)."""
    example = jax.tree.map(lambda x: x[None], example)
    faults = program.faults
    ctx = None
    if faults:
        ctx = Context(step, jnp.int32(-1), chunk, row[None], jnp.zeros(len(faults.faults), bool))
        example = faults.input(example, ctx)
    bad_input, _ = health.first_nonfinite(jax.tree.leaves(example))
    args: tuple[Any, ...] = (params, example)
    if rng is not None:
        args += (jax.random.fold_in(jax.random.fold_in(rng, step), chunk),)

    def loss_fn(*a: Any) -> tuple[jax.Array, Any]:
        return loss(program, *a, ctx=ctx)

    (value, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(*args)
    if ctx is not None:
        grads = faults.tree("grad", grads, ctx)
    checks, _ = validate.checks(aux)
    bad = bad_input | ~jnp.isfinite(value) | health.first_nonfinite(jax.tree.leaves(grads))[0]
    for ok in checks.values():
        bad |= ~ok
    return bad
