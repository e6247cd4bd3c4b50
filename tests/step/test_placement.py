"""Batches placed the way the JAX tutorials place them train as host batches do: a
mesh from ``jax.make_mesh`` (Explicit axes, any axis name) or an Auto mesh of
another name, ``NamedSharding(mesh, P(name))``. Both backends."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxstep


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


@pytest.mark.parametrize("types", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_a_batch_placed_on_the_users_mesh_trains_like_a_host_batch(backend, types):
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("batch",), axis_types=(types,))
    rng = np.random.default_rng(0)
    host = [
        {"x": rng.normal(size=(4 * n, 3)).astype(np.float32), "y": np.ones(4 * n, np.float32)}
        for _ in range(3)
    ]
    placed = [jax.device_put(b, NamedSharding(mesh, P("batch"))) for b in host]
    step = jaxstep.make_train_step(_loss, optax.sgd(0.1), backend=backend)
    a = jaxstep.fit(step, step.init({"w": jnp.zeros(3)}), host)
    b = jaxstep.fit(step, step.init({"w": jnp.zeros(3)}), placed)
    np.testing.assert_array_equal(
        np.asarray(step.host_state(a).params["w"]), np.asarray(step.host_state(b).params["w"])
    )
