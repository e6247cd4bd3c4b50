"""A step's first state (``TrainStep.init``): its parameters checked, copied (the step
donates its state: the caller's arrays must survive it) and laid out, the optimizer
state made for them, and every field the step's options ask for."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep._src.core import Params
from jaxstep._src.core import PyTree
from jaxstep._src.core import TrainState
from jaxstep._src.core import validate
from jaxstep._src.core.names import keystrs
from jaxstep._src.program import Options
from jaxstep._src.program import drop_memory
from jaxstep._src.program import padding_of
from jaxstep._src.step._backends import Backend


def shards_nothing(options: Options, backend: Backend, state: TrainState) -> str | None:
    """What to tell a user whose ``shard_state`` rule shards no leaf of ``state`` (every
    leaf under ``shard_min_size``, or with no axis that divides by the devices): the
    state stays whole on every device and the step runs the replicated program. None:
    the rule shards a leaf (or the step has no ``shard_state``). A leaf is split over
    a group's devices (``n / replicas``), so that is the count it names."""
    plan = backend.plan(state)
    if plan is None or plan.sharded:
        return None
    k, m, devices = options.replicas, options.group_size, options.n
    if k > 1 and m == 1:  # replicas == n: a group of one device holds the whole state
        fewer = max(d for d in range(1, k) if devices % d == 0)
        return (
            f"shard_state={options.shard_state!r} with replicas={k} shards no leaf: each "
            f"of the {k} groups is 1 device, which holds the whole state (a group splits "
            "the state over its devices). The state stays whole on every device and the "
            "step runs the replicated program. To shard it, pass a replicas that leaves 2 "
            f"or more devices in a group (e.g. replicas={fewer}: groups of {devices // fewer}), "
            "or leave shard_state and replicas out"
        )
    over = f"the {devices} devices" if k == 1 else f"a group's {m} devices"
    names = keystrs(state.params, "params") + keystrs(state.opt_state, "opt_state")
    leaves = jax.tree.leaves(state.params) + jax.tree.leaves(state.opt_state)
    size, name = max((math.prod(np.shape(x)), n) for n, x in zip(names, leaves, strict=True))
    return (
        f"shard_state={options.shard_state!r} shards no leaf of this state: each is under "
        f"shard_min_size={options.shard_min_size} elements or has no axis that divides by "
        f"{over} (the largest, {name}, has {size} elements). The state "
        "stays whole on every device and the step runs the replicated program. To shard "
        f"the larger leaves, lower shard_min_size (e.g. make_train_step(..., "
        f"shard_min_size={min(size, options.shard_min_size) // 2})); or leave shard_state out"
    )


def padded_leaves(options: Options, backend: Backend, state: TrainState) -> str | None:
    """What to tell a user whose ``shard_rule`` puts a parameter on an axis that does
    not divide by a group's devices (lm1b's 2 heads over 8 devices under MaxText's
    rules): such a leaf is held padded with zeros to the next multiple, as after an
    exclusion, not refused. None: no leaf is (or the padding is an exclusion's, which
    says so itself)."""
    plan = backend.plan(state)
    if plan is None or options.kept is not None or not plan.pads:
        return None
    host = padding_of(options)
    assert host is not None  # plan.pads under a user's rule: the padding it needed
    names = keystrs(state.params, "params")
    rows = [
        f"{name} (shape {shape}, axis {a}: {pad[0]} -> {pad[1]})"
        for name, shape, a, pad in zip(
            names, host.param_shapes, plan.grads, plan.grad_pads, strict=True
        )
        if pad is not None and a is not None
    ]
    shown = "; ".join(rows[:4]) + (f"; and {len(rows) - 4} more" if len(rows) > 4 else "")
    over = (
        f"the {options.n} devices"
        if options.replicas == 1
        else f"a group's {options.group_size} devices"
    )
    return (
        f"shard_rule puts {len(rows)} parameter(s) on an axis that does not divide by "
        f"{over}: each is held padded with zeros to the next multiple along that axis, "
        f"as after an exclusion ({shown}). The padding never reaches the loss, a "
        "checkpoint or host_state, and an elementwise optimizer's update is exact "
        "(Adam, SGD, a global-norm clip); a factored second moment or a mean over a leaf "
        "sees the zeros. To avoid it, return an axis that divides (or None) for these "
        "leaves, or build the step on a device count whose group size divides them"
    )


def first_state(
    options: Options, backend: Backend, params: Params, model_state: PyTree, rng: jax.Array | None
) -> TrainState:
    """The first state of a step built with ``options`` (not placed yet, but for a
    sharded layout's parameters and optimizer state, made shard by shard on the
    devices: never whole on one).

    Raises:
      TypeError, ValueError: as ``TrainStep.init``.
    """
    validate.params(params)
    validate.trainable(params)
    validate.not_variables(params)
    if rng is not None:
        validate.key(rng)
    if model_state is not None:
        validate.model_state_leaves(model_state, options.has_aux)
        model_state = jax.tree.map(lambda x: jnp.array(x, copy=True), model_state)
    if options.shard_state is None:
        params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
        opt_state = options.optimizer.init(params)
    else:  # placed shard by shard (copies too), never whole on one device
        params, opt_state = backend.init_sharded(options.optimizer, params)
    n = options.n
    drops = options.on_failure == "drop"
    monitor: dict[str, Any] = {}
    if options.loss_spike:
        monitor["spike"] = options.loss_spike.init(n)
    if drops:
        monitor |= drop_memory(n)
    # Distinct arrays for every leaf: a donated buffer may appear only once.
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        rng=None if rng is None else jnp.array(rng, copy=True),
        halted=jnp.zeros((), bool),
        consecutive_skips=jnp.zeros((), jnp.int32),
        total_skips=jnp.zeros((), jnp.int32),
        monitor=monitor,
        model_state=model_state,
        loss_scale=None if options.loss_scale is None else options.loss_scale.init(),
        total_drops=jnp.zeros((), jnp.int32) if drops else None,
    )
