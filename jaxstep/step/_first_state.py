"""A step's first state (``TrainStep.init``): its parameters checked, copied (the step
donates its state: the caller's arrays must survive it) and laid out, the optimizer
state made for them, and every field the step's options ask for."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxstep.core import Params
from jaxstep.core import PyTree
from jaxstep.core import TrainState
from jaxstep.core import validate
from jaxstep.program import Options
from jaxstep.program import drop_memory
from jaxstep.step._backends import Backend


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
