"""fit and its data source: it pulls only the batches it trains, so an iterator it
shares with its caller loses none."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstep
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches


def test_num_steps_does_not_swallow_a_batch_of_a_shared_iterator():
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2))
    pulled = []
    source = (pulled.append(i) or b for i, b in enumerate(make_batches(6)))
    state = jaxstep.fit(step, step.init(init_params()), source, num_steps=2)
    state = jaxstep.fit(step, state, source, num_steps=2)
    assert pulled == [0, 1, 2, 3]
    assert int(np.asarray(state.step)) == 4
    assert list(itertools.islice(source, 1))  # batch 4 is still there


def test_history_as_arrays_holds_each_aux_scalar(backend):
    def loss(params, batch):
        value = loss_fn(params, batch)
        return value, {"mean_y": jnp.mean(batch["y"]), "twice": 2.0 * value}

    step = jaxstep.make_train_step(loss, optax.sgd(0.1), backend=backend, has_aux=True)
    history = jaxstep.History()
    batches = make_batches(3)
    jaxstep.fit(step, step.init(init_params()), batches, history=history)
    arrays = history.as_arrays()
    np.testing.assert_allclose(
        arrays["metrics/mean_y"], [np.mean(b["y"]) for b in batches], rtol=1e-5
    )
    np.testing.assert_allclose(arrays["metrics/twice"], 2 * np.asarray(history.loss), rtol=1e-5)


def test_fit_takes_presplit_batches_and_warns_when_a_batch_looks_presplit(backend):
    def loss(params, batch):
        return jnp.mean((batch["x"] * params["w"] - batch["y"]) ** 2)

    n = len(jax.devices())
    rng = np.random.default_rng(0)
    flat = [
        {"x": rng.normal(size=(n * 4, 1)).astype(np.float32), "y": np.ones((n * 4, 1), np.float32)}
        for _ in range(3)
    ]
    split = [jax.tree.map(lambda x: x.reshape(n, 4, 1), b) for b in flat]
    step = jaxstep.make_train_step(loss, optax.sgd(0.1), backend=backend)
    a = jaxstep.fit(step, step.init({"w": jnp.zeros(())}), flat)
    b = jaxstep.fit(step, step.init({"w": jnp.zeros(())}), split, presplit=True)
    np.testing.assert_array_equal(
        np.asarray(step.host_state(a).params["w"]), np.asarray(step.host_state(b).params["w"])
    )
    fresh = jaxstep.make_train_step(loss, optax.sgd(0.1), backend=backend)
    with pytest.warns(UserWarning, match=r"presplit=True"):
        jaxstep.fit(fresh, fresh.init({"w": jnp.zeros(())}), split[:1])
