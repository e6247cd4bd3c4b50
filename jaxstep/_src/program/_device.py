"""A device's own part of the step, before any collective: the loss and gradients of
its chunk (or of each micro-batch of it, in a ``lax.scan``) and their health. Pure
functions of the frozen :class:`~jaxstep._src.program._options.Options` the step was built with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxstep._src.core import Batch
from jaxstep._src.core import PyTree
from jaxstep._src.core import Status
from jaxstep._src.core import TrainState
from jaxstep._src.core import WeightedLoss
from jaxstep._src.core import health
from jaxstep._src.core import validate
from jaxstep._src.program._faults import Armed
from jaxstep._src.program._options import Options


def loss(options: Options, *args: Any, model_state: PyTree = None) -> tuple[jax.Array, PyTree]:
    """``loss_fn(*args[, model_state=...])`` as ``(loss, aux)`` (an injected loss fault
    is applied to what the differentiation returns: :meth:`Injector.after_loss`)."""
    kwargs = {} if model_state is None else {"model_state": model_state}
    value, aux = validate.loss_output(options.loss_fn(*args, **kwargs), options.has_aux)
    validate.aux_leaves(aux)  # at trace time
    if isinstance(value, WeightedLoss):
        value = _global_mean_share(value, options.axis_name)
    return value, aux


def _global_mean_share(loss: WeightedLoss, axis: str) -> jax.Array:
    """This device's share of the global weighted mean: ``sum * n / total weight``, so
    that the mean over the ``n`` devices (the step's all-reduce) is ``sum of sums /
    total weight``. The weights' scalar all-reduce is the only collective before the
    checks; a total of 0 (nothing counts anywhere) gives 0, not 0/0."""
    total = jax.lax.psum(loss.weight.astype(loss.sum.dtype), axis)
    n = jax.lax.psum(1, axis)
    scale = jnp.where(total > 0, n / jnp.where(total > 0, total, 1), 0)
    return loss.sum * jax.lax.stop_gradient(scale).astype(loss.sum.dtype)


class DeviceWork(NamedTuple):
    """One device's (or one micro-batch's) work before the collective."""

    grads: PyTree
    model_state: PyTree  # the new model state, or None
    status: jax.Array  # Status bits
    input_leaf: jax.Array
    grad_squares: jax.Array  # the sum of squares of every gradient leaf
    grad_leaf: jax.Array  # the first non-finite gradient leaf, or -1
    model_state_leaf: jax.Array
    check_failed: jax.Array  # (n_checks,) bool
    loss: jax.Array
    aux: PyTree
    #: under ``shard_state="params"``, at a replica-check step: the fingerprints of the
    #: parameters this device gathered, and its first non-finite one (None otherwise)
    prints: jax.Array | None = None
    param_leaf: jax.Array | None = None

    @property
    def forward_failed(self) -> jax.Array:
        """Whether this device failed in what the forward pass alone tells (input, loss,
        model state, a user check): known before its gradients are."""
        return (
            (self.input_leaf >= 0)
            | ~jnp.isfinite(self.loss)
            | (self.model_state_leaf >= 0)
            | health.any_true(self.check_failed)
        )


#: ``work_fn(options, state, batch, key, model_state, faults) -> (DeviceWork, check names)``
WorkFn = Callable[..., tuple["DeviceWork", tuple[str, ...]]]


def device_work(
    options: Options,
    state: TrainState,
    batch: Batch,
    key: jax.Array | None,
    model_state: PyTree,
    faults: Armed,
    *,
    input_apart: bool = False,
) -> tuple[DeviceWork, tuple[str, ...]]:
    """Loss, gradients and health of one (micro-)batch on this device, before any
    collective. Returns the work and the names of the user checks. ``input_apart``:
    the input is checked in a reduction of its own, not in the gradients' (a sharded
    layout's ``drop`` leaves a device out by what its forward pass tells, before its
    gradients are all made)."""
    batch = faults.input(batch)
    scaler, scale = options.loss_scale, state.loss_scale

    def loss_fn(*args: Any) -> tuple[jax.Array, PyTree]:
        value, aux = loss(options, *args, model_state=model_state)
        if scaler is None or scale is None:
            return value, (value, aux)
        scaled = scaler.scale_loss(scale, value)
        return scaled, (value, aux)

    validate.rng_for(options.loss_fn, key is not None)  # at trace time only
    args = (state.params, batch) if key is None else (state.params, batch, key)
    (_, (value, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(*args)
    # on the scaled gradients: they overflow as a real spike's would
    value, grads = faults.after_loss(value, grads)
    if scaler is not None and scale is not None:
        grads = scaler.unscale(scale, grads)
    checks, aux = validate.checks(aux)
    new_ms, aux = validate.model_state(aux, model_state)
    if input_apart:
        in_leaf = health.first_nonfinite(jax.tree.leaves(batch))[1]
        squares, grad_leaf, _ = health.gradient_health(jax.tree.leaves(grads))
    else:  # the input is checked in the gradients' reduction: one kernel for both
        squares, grad_leaf, in_leaf = health.gradient_health(
            jax.tree.leaves(grads), jax.tree.leaves(batch)
        )
    in_bad, grad_bad = in_leaf >= 0, ~jnp.isfinite(squares)
    ms_bad, ms_leaf = health.first_nonfinite(jax.tree.leaves(new_ms))
    check_failed = ~jnp.stack(list(checks.values())) if checks else jnp.zeros((0,), bool)
    status = status_bits(options, in_bad, value, grad_bad, ms_bad, check_failed)
    work = DeviceWork(
        grads, new_ms, status, in_leaf, squares, grad_leaf, ms_leaf, check_failed, value, aux
    )
    return work, tuple(checks)


def status_bits(
    options: Options,
    in_bad: jax.Array,
    value: jax.Array,
    grad_bad: jax.Array,
    ms_bad: jax.Array,
    check_failed: jax.Array,
) -> jax.Array:
    """A device's Status bits from its input, loss, gradient, model-state and user
    checks. With a loss scale, non-finite gradients from a finite input and loss are an
    overflow of the scaled values: the scale backs off, nothing failed."""
    grad_flag: Any = int(Status.GRAD_NONFINITE)
    if options.loss_scale is not None:
        overflow = ~in_bad & jnp.isfinite(value)
        grad_flag = jnp.where(overflow, int(Status.OVERFLOW), int(Status.GRAD_NONFINITE))
    return (
        jnp.where(in_bad, int(Status.INPUT_NONFINITE), 0)
        | jnp.where(jnp.isfinite(value), 0, int(Status.LOSS_NONFINITE))
        | jnp.where(grad_bad, grad_flag, 0)
        | jnp.where(ms_bad, int(Status.MODEL_STATE_NONFINITE), 0)
        | jnp.where(health.any_true(check_failed), int(Status.CHECK_FAILED), 0)
    ).astype(jnp.int32)


def microbatched_work(
    options: Options,
    state: TrainState,
    batch: Batch,
    key: jax.Array | None,
    faults: Armed,
    microbatches: int,
    work_fn: WorkFn | None = None,
    *,
    scattered: bool = False,
) -> tuple[DeviceWork, jax.Array, tuple[str, ...]]:
    """:func:`device_work` over ``microbatches`` equal slices of the chunk in a ``lax.scan``:
    gradients averaged, the model state threaded through, and the health of the
    first failing micro-batch (also returned, or -1). ``work_fn``: what runs on each
    slice in place of ``device_work``; ``scattered``: its gradients leave it
    reduce-scattered (``shard_state="params"``), so the mean's health is the
    micro-batches' own (their mean squared norm)."""
    work_fn = device_work if work_fn is None else work_fn
    if microbatches == 1:
        work, found = work_fn(options, state, batch, key, state.model_state, faults)
        return work, jnp.where(work.status != 0, 0, -1).astype(jnp.int32), found
    rows = jax.tree.leaves(batch)[0].shape[0]
    size = rows // microbatches
    parts = jax.tree.map(lambda x: x.reshape(microbatches, size, *x.shape[1:]), batch)
    names: tuple[str, ...] = ()

    def one(
        carry: tuple[PyTree, PyTree], xs: tuple[Batch, jax.Array]
    ) -> tuple[tuple[PyTree, PyTree], DeviceWork]:
        nonlocal names
        total, model_state = carry
        part, m = xs
        sub = None if key is None else jax.random.fold_in(key, m)
        work, names = work_fn(options, state, part, sub, model_state, faults.rows(m * size, size))
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
    if not scattered:
        # the first failing micro-batch's finiteness; the norm is the mean gradient's
        squares, leaf, _ = health.gradient_health(jax.tree.leaves(grads))
    else:  # reduce-scattered gradients: the micro-batches' mean squared local norm
        squares, leaf = jnp.mean(each.grad_squares), jnp.array(-1, jnp.int32)
    status, input_leaf = at(each.status), at(each.input_leaf)
    work = DeviceWork(
        grads=grads,
        model_state=model_state,
        status=status,
        input_leaf=input_leaf,
        grad_squares=jnp.where(jnp.isfinite(at(each.grad_squares)), squares, jnp.inf),
        grad_leaf=health.earliest(at(each.grad_leaf), leaf),
        model_state_leaf=at(each.model_state_leaf),
        check_failed=at(each.check_failed),
        loss=jnp.mean(each.loss),
        aux=jax.tree.map(_mean_or_last, each.aux),
        prints=None if each.prints is None else each.prints[0],
        param_leaf=None if each.param_leaf is None else each.param_leaf[0],
    )
    return work, first, names


def _mean_or_last(x: jax.Array) -> jax.Array:
    return jnp.mean(x, axis=0) if jnp.issubdtype(x.dtype, jnp.inexact) else x[-1]


def example_failed(
    options: Options,
    state: TrainState,
    example: Batch,
    chunk: jax.Array,
    row: jax.Array,
) -> jax.Array:
    """Whether one example fails on its own (input, loss, gradient, model state or a
    user check), as if it were row ``row`` of chunk ``chunk`` at ``state.step``: the
    replay diagnosis maps this over the examples of a failing chunk. Collectives in
    the model see a one-example axis (the caller binds ``axis_name``)."""
    example = jax.tree.map(lambda x: x[None], example)
    work, grads, faults = _replayed(options, state, example, jnp.int32(-1), chunk, row[None])
    bad = (work.status & ~int(Status.OVERFLOW)) != 0
    if faults:  # an injected gradient fault is checked like a real one
        bad |= health.first_nonfinite(jax.tree.leaves(grads))[0]
    return bad


def grad_leaves_finite(
    options: Options,
    state: TrainState,
    chunk_batch: Batch,
    device_id: jax.Array,
    chunk: jax.Array,
) -> jax.Array:
    """Whether each gradient leaf (``(n_leaves,)`` bool, in tree order) is finite for
    the rows of chunk ``chunk`` as device ``device_id`` ran them at ``state.step``
    (the whole chunk in one pass, micro-batches or not; faults bound to that device
    or to those rows fire): which layers a non-finite gradient reached, for the
    replay diagnosis. Collectives in the model see a one-chunk axis (the caller binds
    ``axis_name``)."""
    rows = jnp.arange(jax.tree.leaves(chunk_batch)[0].shape[0])
    _, grads, _ = _replayed(options, state, chunk_batch, device_id, chunk, rows)
    return jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])


def _replayed(
    options: Options,
    state: TrainState,
    batch: Batch,
    device_id: jax.Array,
    chunk: jax.Array,
    rows: jax.Array,
) -> tuple[DeviceWork, PyTree, Armed]:
    """:func:`device_work` for rows the diagnosis replays away from the step: the key and
    the faults they had as rows ``rows`` of chunk ``chunk`` on device ``device_id``
    (-1: faults bound to a device do not fire). Returns the work, its gradients with
    any injected gradient fault applied, and the faults."""
    faults = options.arm(state.step, chunk, rows, None, device_id=device_id)
    key = None
    if state.rng is not None:
        key = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), chunk)
    work, _ = device_work(options, state, batch, key, state.model_state, faults)
    return work, faults.grads(work.grads), faults
