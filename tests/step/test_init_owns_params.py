"""step.init copies what it takes, under every layout: a fit never deletes the
caller's params (a second init of the same params, as a reference run or a notebook
cell run again, works), and an array a step did delete is refused in jaxstep's words."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstep
from tests.models import loss_fn
from tests.models import make_batches


def _big_params():
    """Leaves large enough to be sharded (shard_min_size=0 shards every leaf that divides)."""
    key = jax.random.key(0)
    return {
        "dense1": {"kernel": jax.random.normal(key, (3, 16)), "bias": jnp.zeros(16)},
        "dense2": {"kernel": jax.random.normal(key, (16, 1)), "bias": jnp.zeros(1)},
    }


@pytest.mark.parametrize("layout", [None, "optimizer", "params"])
def test_a_second_init_of_the_same_params_after_a_fit_works(layout):
    params = jax.device_put(_big_params())  # device arrays: what model.init returns
    kwargs = {} if layout is None else {"shard_state": layout, "shard_min_size": 0}
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), **kwargs)
    state = jaxstep.fit(step, step.init(params), make_batches(2))
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))
    again = jaxstep.fit(step, step.init(params), make_batches(2))  # the reference run
    for a, b in zip(
        jax.tree.leaves(step.host_state(state).params),
        jax.tree.leaves(step.host_state(again).params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_params_a_step_deleted_are_refused_naming_the_leaf_and_the_fix():
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2))
    state = step.init(_big_params())
    donated = state.params
    step(state, make_batches(1)[0])  # donates the state, its params included
    with pytest.raises(ValueError) as info:
        step.init(donated)
    message = str(info.value)
    assert message.startswith("parameter ['dense1']['bias'] is a deleted array")
    assert "step.host_state(state).params" in message


@pytest.mark.parametrize(
    "layout,backend",
    [(None, "shard_map"), ("optimizer", "shard_map"), ("params", "shard_map"), (None, "pmap")],
)
def test_place_state_copies_what_it_takes_so_a_fit_never_deletes_the_callers_state(layout, backend):
    # the documented move, other.place_state(step.host_state(state)): host_state's arrays
    # live on one device, and device_put onto the devices kept that buffer for it, so the
    # next fit donated (deleted) the caller's host copy
    kwargs = {"backend": backend}
    if layout is not None:
        kwargs |= {"shard_state": layout, "shard_min_size": 0}
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), **kwargs)
    state = jaxstep.fit(step, step.init(_big_params()), make_batches(1))
    host = step.host_state(state)
    other = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), **kwargs)
    jaxstep.fit(other, other.place_state(host), make_batches(2))
    assert not any(x.is_deleted() for x in jax.tree.leaves(host) if isinstance(x, jax.Array))
    assert int(host.step) == 1
