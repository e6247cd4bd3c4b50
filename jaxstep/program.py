"""The per-device program: what every device runs inside ``shard_map`` / ``pmap``.

check the local input, loss and gradients -> one all-reduce of (gradients, health
rows) -> the same verdict on every device -> the optimizer update under ``lax.cond``.
Pure functions over an immutable :class:`Program`; nothing here touches host state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

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
from jaxstep.scaling import DynamicLossScale
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
    microbatches: int = 1
    loss_scale: DynamicLossScale | None = None

    @property
    def n(self) -> int:
        return len(self.device_ids)


def loss(
    program: Program, *args: Any, ctx: Context | None, model_state: Any = None
) -> tuple[jax.Array, Any]:
    """``loss_fn(*args[, model_state=...])`` as ``(loss, aux)``, with an injected loss
    fault applied."""
    kwargs = {} if model_state is None else {"model_state": model_state}
    value, aux = validate.loss_output(program.loss_fn(*args, **kwargs), program.has_aux)
    if ctx is not None:
        value = program.faults.loss(value, ctx)
    return value, aux


class Local(NamedTuple):
    """One device's (or one micro-batch's) work before the collective."""

    grads: Any
    model_state: Any  # the new model state, or None
    status: jax.Array  # Status bits
    input_leaf: jax.Array
    grad_squares: jax.Array  # (n_param_leaves,) each leaf's sum of squares
    model_state_leaf: jax.Array
    check_failed: jax.Array  # (n_checks,) bool
    loss: jax.Array
    aux: Any


def local(
    program: Program,
    state: TrainState,
    batch: Any,
    key: jax.Array | None,
    model_state: Any,
    ctx: Context | None,
) -> tuple[Local, tuple[str, ...]]:
    """Loss, gradients and health of one (micro-)batch on this device, before any
    collective. Returns the work and the names of the user checks."""
    if ctx is not None:
        batch = program.faults.input(batch, ctx)
    in_bad, in_leaf = health.first_nonfinite(jax.tree.leaves(batch))
    scale = None if state.loss_scale is None else state.loss_scale.scale

    def loss_fn(*args: Any) -> tuple[jax.Array, Any]:
        value, aux = loss(program, *args, ctx=ctx, model_state=model_state)
        scaled = value if scale is None else value * scale.astype(value.dtype)
        return scaled, (value, aux)

    args = (state.params, batch) if key is None else (state.params, batch, key)
    (_, (value, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(*args)
    if scale is not None:
        grads = jax.tree.map(lambda g: (g / scale.astype(g.dtype)).astype(g.dtype), grads)
    checks, aux = validate.checks(aux)
    new_ms, aux = validate.model_state(aux, model_state)
    squares = health.leaf_sum_of_squares(jax.tree.leaves(grads))
    grad_bad = jnp.any(~jnp.isfinite(squares))
    ms_bad, ms_leaf = health.first_nonfinite(jax.tree.leaves(new_ms))
    check_failed = ~jnp.stack(list(checks.values())) if checks else jnp.zeros((0,), bool)
    # With a loss scale, non-finite gradients from a finite input and loss are an
    # overflow of the scaled values: the scale backs off, nothing failed.
    grad_flag: Any = int(Status.GRAD_NONFINITE)
    if scale is not None:
        overflow = ~in_bad & jnp.isfinite(value)
        grad_flag = jnp.where(overflow, int(Status.OVERFLOW), int(Status.GRAD_NONFINITE))
    status = (
        jnp.where(in_bad, int(Status.INPUT_NONFINITE), 0)
        | jnp.where(jnp.isfinite(value), 0, int(Status.LOSS_NONFINITE))
        | jnp.where(grad_bad, grad_flag, 0)
        | jnp.where(ms_bad, int(Status.MODEL_STATE_NONFINITE), 0)
        | jnp.where(jnp.any(check_failed), int(Status.CHECK_FAILED), 0)
    ).astype(jnp.int32)
    work = Local(grads, new_ms, status, in_leaf, squares, ms_leaf, check_failed, value, aux)
    return work, tuple(checks)


def microbatched(
    program: Program,
    state: TrainState,
    batch: Any,
    key: jax.Array | None,
    ctx: Context | None,
    microbatches: int,
) -> tuple[Local, jax.Array, tuple[str, ...]]:
    """:func:`local` over ``microbatches`` equal slices of the chunk in a ``lax.scan``:
    gradients averaged, the model state threaded through, and the health of the
    first failing micro-batch (also returned, or -1)."""
    if microbatches == 1:
        work, found = local(program, state, batch, key, state.model_state, ctx)
        return work, jnp.where(work.status != 0, 0, -1).astype(jnp.int32), found
    rows = jax.tree.leaves(batch)[0].shape[0]
    size = rows // microbatches
    parts = jax.tree.map(lambda x: x.reshape(microbatches, size, *x.shape[1:]), batch)
    names: tuple[str, ...] = ()

    def one(carry: tuple[Any, Any], xs: tuple[Any, jax.Array]) -> tuple[Any, Any]:
        nonlocal names
        total, model_state = carry
        part, m = xs
        sub = None if key is None else jax.random.fold_in(key, m)
        sub_ctx = None if ctx is None else ctx._replace(rows=m * size + jnp.arange(size))
        work, names = local(program, state, part, sub, model_state, sub_ctx)
        total = jax.tree.map(jnp.add, total, work.grads)
        return (total, work.model_state), work._replace(grads=None, model_state=None)

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    (total, model_state), each = jax.lax.scan(
        one, (zeros, state.model_state), (parts, jnp.arange(microbatches))
    )
    grads = jax.tree.map(lambda g: g / microbatches, total)
    first = health.first_true(each.status != 0)
    pick = jnp.maximum(first, 0)
    at = lambda x: x[pick]  # noqa: E731  the first failing micro-batch's value
    work = Local(
        grads=grads,
        model_state=model_state,
        status=at(each.status),
        input_leaf=at(each.input_leaf),
        # the first failing micro-batch's finiteness; the norm is the mean gradient's
        grad_squares=jnp.where(
            jnp.isfinite(at(each.grad_squares)),
            health.leaf_sum_of_squares(jax.tree.leaves(grads)),
            jnp.inf,
        ),
        model_state_leaf=at(each.model_state_leaf),
        check_failed=at(each.check_failed),
        loss=jnp.mean(each.loss),
        aux=jax.tree.map(_mean_or_last, each.aux),
    )
    return work, first, names


def _mean_or_last(x: jax.Array) -> jax.Array:
    return jnp.mean(x, axis=0) if jnp.issubdtype(x.dtype, jnp.inexact) else x[-1]


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

    # 1. input, 2. loss and gradients, 3. local health: all before any collective.
    key = None
    if state.rng is not None:
        key = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), index)
    work, microbatch, check_names = microbatched(
        program, state, batch, key, ctx, program.microbatches
    )
    grads, squares = work.grads, work.grad_squares
    status = work.status | jnp.minimum(token, 0)  # keeps an injected stall ahead
    if ctx is not None:
        grads = program.faults.tree("grad", grads, ctx)
        # an injected gradient fault is checked like a real one
        injected = health.leaf_sum_of_squares(jax.tree.leaves(grads))
        squares = jnp.where(jnp.isfinite(injected), squares, injected)
        grad_flag = int(Status.GRAD_NONFINITE)
        status |= jnp.where(jnp.any(~jnp.isfinite(injected)), grad_flag, 0)
    grad_bad = ~jnp.isfinite(squares)
    row = {
        "input_leaf": work.input_leaf,
        "grad_leaf": health.first_true(grad_bad),
        "param_leaf": -1,
        "diverged_leaf": -1,
        "model_state_leaf": work.model_state_leaf,
        "microbatch": microbatch,
        "check": health.first_true(work.check_failed),
        "loss": work.loss,
        "grad_norm": jnp.sqrt(jnp.sum(squares)),
    }
    prints = None
    if replicas:
        prints, param_leaf = replica_check(state)
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
    # the float model state, the fingerprints and the fault flags ride in the
    # gradients' all-reduce.
    parts = [health.pack_row(row)]
    if prints is not None:
        parts.append(monitors.split16(prints))
    if ctx is not None:
        parts.append(program.faults.fire_flags(ctx).astype(jnp.float32))
    mine = (jnp.arange(n) == index)[:, None]
    floats = _floats(work.model_state)
    grads, floats, gathered = jax.lax.psum(
        (grads, floats, jnp.where(mine, jnp.concatenate(parts), 0)), axis
    )
    grads = jax.tree.map(lambda g: g / n, grads)
    model_state = _with_floats(work.model_state, jax.tree.map(lambda x: x / n, floats))
    rows_ = gathered[:, : len(COLUMNS)]  # every device's row, as packed
    rest = gathered[:, len(COLUMNS) :]
    status = rows_[:, COL["status"]].astype(jnp.int32)
    columns: dict[str, jax.Array] = {}  # the table's columns changed after the gather
    if prints is not None:
        diverged, first = monitors.minority(monitors.join16(rest[:, : 2 * prints.shape[0]]))
        status |= jnp.where(diverged, int(Status.DIVERGED), 0)
        columns["diverged_leaf"] = first
    if ctx is not None:
        fired = jnp.any(rest[:, rest.shape[1] - len(program.faults.faults) :] > 0, axis=0)
        extras = dict(extras, fired=extras["fired"] | fired)

    # 5.-8. the verdict, the same on every device, and the update it allows.
    losses = rows_[:, COL["loss"]]
    new_state, status, columns = update(
        program, state, losses, status, columns, grads, model_state, ctx, mine
    )
    table = health.to_table(rows_, {**columns, "status": status})
    metrics = {"loss": jnp.mean(losses)}
    info = StepInfo(checks=check_names)
    return new_state, StepOutput(metrics=metrics, health=table, aux=work.aux, info=info), extras


def _floats(tree: Any) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def _with_floats(tree: Any, floats: list[jax.Array]) -> Any:
    """``tree`` with its float leaves replaced, in order, by ``floats``."""
    it = iter(floats)
    return jax.tree.map(lambda x: next(it) if jnp.issubdtype(x.dtype, jnp.inexact) else x, tree)


def replica_check(state: TrainState) -> tuple[jax.Array, jax.Array]:
    """This device's fingerprint of its own copy of params, optimizer state and model
    state, and its first non-finite parameter leaf (or -1). In the every-k-steps
    program only."""
    leaves = jax.tree.leaves((state.params, state.opt_state, state.model_state))
    n_params = len(jax.tree.leaves(state.params))
    return monitors.fingerprint(leaves), health.first_nonfinite(leaves[:n_params])[1]


def update(
    program: Program,
    state: TrainState,
    losses: jax.Array,
    status: jax.Array,
    columns: dict[str, jax.Array],
    grads: Any,
    model_state: Any,
    ctx: Context | None,
    mine: jax.Array,
) -> tuple[TrainState, jax.Array, dict[str, jax.Array]]:
    """Decides, then updates. By default everything the verdict needs is known
    before the update, so a ``lax.cond`` skips it on failure: no second pass over
    the state and no extra memory. ``verify_update=True`` also checks the new
    parameters before committing them (one more pass, and a second collective).
    Returns the new state, every device's status and the table columns to write."""

    def apply(operands: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        params, opt_state, _ = operands
        updates, opt_state = program.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, model_state

    old = (state.params, state.opt_state, state.model_state)
    columns = dict(columns)
    if program.verify_update:
        new = apply(old)
        checked = new[0] if ctx is None else program.faults.tree("param", new[0], ctx)
        leaf = health.first_nonfinite(jax.tree.leaves(checked))[1]
        leaves = jax.lax.psum(jnp.where(mine[:, 0], leaf, 0), program.axis_name)
        # After a bad gradient every replica's update is bad too: that is the
        # gradient's fault, so parameters are blamed only when nothing else failed.
        bad = (leaves >= 0) & jnp.all(status == 0)
        columns["param_leaf"] = jnp.where(bad, leaves, -1)
        status = status | jnp.where(bad, int(Status.PARAM_NONFINITE), 0)
    status, ok, fields, verdict_columns = verdict(program, state, losses, status)
    if program.verify_update:
        params, opt_state, model_state = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
    else:
        params, opt_state, model_state = jax.lax.cond(ok, apply, lambda operands: operands, old)
    new_state = dataclasses.replace(
        state, params=params, opt_state=opt_state, model_state=model_state, **fields
    )
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
    overflow = jnp.any((status & int(Status.OVERFLOW)) != 0)
    failed = jnp.any((status & ~int(Status.OVERFLOW)) != 0)
    scaler = program.loss_scale
    if scaler is not None:  # an overflow at the minimum scale cannot be skipped away
        failed |= overflow & scaler.at_minimum(state.loss_scale)
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
    rescaled = overflow & ~failed & ~state.halted  # skipped on every device, not a failure
    ok = ~failed & ~overflow & ~state.halted
    halted = state.halted | halt_now
    if spike is not None:
        monitor = {"spike": spike.update(state.monitor["spike"], losses, ok)}
    consecutive = jnp.where(ok, 0, state.consecutive_skips + skipped).astype(jnp.int32)
    columns = {
        "step": state.step,
        "halted": halted,
        "skipped": skipped | rescaled,
        "consecutive_skips": consecutive,
        "failed": failed,
    }
    fields = {
        "step": state.step + (ok | skipped | rescaled),
        "halted": halted,
        "consecutive_skips": consecutive,
        "total_skips": state.total_skips + skipped,
        "monitor": monitor,
    }
    if scaler is not None:
        fields["loss_scale"] = scaler.update(state.loss_scale, rescaled, ok)
    return status, ok, fields, columns


def example_failed(
    program: Program,
    state: TrainState,
    example: Any,
    chunk: jax.Array,
    row: jax.Array,
) -> jax.Array:
    """Whether one example fails on its own (input, loss, gradient, model state or a
    user check), as if it were row ``row`` of chunk ``chunk`` at ``state.step``: the
    replay diagnosis maps this over the examples of a failing chunk. Collectives in
    the model see a one-example axis (the caller binds ``axis_name``)."""
    example = jax.tree.map(lambda x: x[None], example)
    ctx = None
    if program.faults:
        fired = jnp.zeros(len(program.faults.faults), bool)
        ctx = Context(state.step, jnp.int32(-1), chunk, row[None], fired)
    key = None
    if state.rng is not None:
        key = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), chunk)
    work, _ = local(program, state, example, key, state.model_state, ctx)
    bad = (work.status & ~int(Status.OVERFLOW)) != 0
    if ctx is not None:
        grads = program.faults.tree("grad", work.grads, ctx)
        bad |= health.first_nonfinite(jax.tree.leaves(grads))[0]
    return bad
