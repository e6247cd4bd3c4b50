"""The devices of a model group inside the body (``make_train_step(model_parallel=m)``).

The body is manual over the data axis and leaves the model axis to XLA, and there a
host callback is refused ("callbacks are only supported ... when all mesh axes are
partitioned manually", JAX 0.10) and ``axis_index(MODEL_AXIS)`` is unbound. A
``shard_map`` nested inside it, manual over the model axis (on the context's abstract
mesh), binds both: each device of the group runs the callback with its own model
position. That is the heartbeat's route (a group's devices each beat, so the hung
one is named) and the ``stall`` fault's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

#: the mesh axis a model group's devices lie along (``make_train_step(model_parallel=m)``):
#: name it in ``jax.lax.with_sharding_constraint(x, P(None, MODEL_AXIS))``
MODEL_AXIS = "model"


def each_chip(model_parallel: int, call: Callable[..., jax.Array], *args: Any) -> jax.Array:
    """``call(chip, *args)`` (an int32 scalar) on every device of this unit, ``chip``
    its model position (0 with no model axis: the device itself), inside the body;
    the least of the results (every device's call is waited for)."""
    if model_parallel == 1:
        return call(jnp.int32(0), *args)

    def one(*a: Any) -> jax.Array:
        return call(jax.lax.axis_index(MODEL_AXIS), *a)[None]

    out = jax.shard_map(
        one,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=P(),
        out_specs=P(MODEL_AXIS),
        axis_names=frozenset({MODEL_AXIS}),
        check_vma=False,
    )(*args)
    return jnp.min(out)


__all__ = ["MODEL_AXIS", "each_chip"]
