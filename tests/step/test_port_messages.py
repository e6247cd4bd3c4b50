"""Messages a port from the Flax examples meets: an axis name the step does not bind,
a bare-array batch, boxed (partitioned) params, a whole variables dict as params.
Both backends."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep.testing import Fault


def test_a_model_axis_the_step_does_not_bind_names_the_fix(backend):
    def loss(params, batch):
        mean = jax.lax.pmean(jnp.mean(batch["x"]), "batch")  # BatchNorm(axis_name="batch")
        return jnp.mean((batch["x"] * params["w"] - mean) ** 2)

    step = jaxstep.make_train_step(loss, optax.sgd(0.1), backend=backend)
    state = step.init({"w": jnp.ones(())})
    with pytest.raises(ValueError, match=r"make_train_step\(\.\.\., axis_name='batch'\)"):
        step(state, {"x": np.ones((16,), np.float32)})
    fixed = jaxstep.make_train_step(loss, optax.sgd(0.1), backend=backend, axis_name="batch")
    fixed(fixed.init({"w": jnp.ones(())}), {"x": np.ones((16,), np.float32)})


def test_a_bare_array_batch_is_named_batch(backend):
    dev = jax.devices()[2].id
    step = jaxstep.make_train_step(
        lambda p, x: jnp.mean((x * p["w"]) ** 2),
        optax.sgd(0.1),
        backend=backend,
        faults=[Fault("input", device_id=dev, step=1)],
    )
    state = step.init({"w": jnp.ones(())})
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, [np.ones((16,), np.float32)] * 3)
    assert info.value.leaf == "batch"
    assert "non-finite input in batch" in str(info.value)


def test_boxed_params_are_named_without_value(backend):
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp"))
            return nn.Dense(1, kernel_init=init)(x)

    model = Model()
    params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    assert isinstance(params["Dense_0"]["kernel"], nn.LogicallyPartitioned)

    def loss(p, batch):
        return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    dev = jax.devices()[1].id
    step = jaxstep.make_train_step(
        loss,
        optax.sgd(0.1),
        backend=backend,
        faults=[Fault("grad", device_id=dev, step=0, leaf="['Dense_0']['kernel']")],
    )
    batch = {"x": np.ones((16, 3), np.float32), "y": np.ones((16, 1), np.float32)}
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(params), [batch])
    assert info.value.leaf == "['Dense_0']['kernel']"
    assert ".value" not in str(info.value)


def test_a_whole_variables_dict_as_params_warns():
    step = jaxstep.make_train_step(lambda p, b: jnp.mean(b), optax.adamw(1e-3))
    variables = {
        "params": {"w": np.ones(3, np.float32)},
        "batch_stats": {"mean": np.zeros(3, np.float32)},
    }
    with pytest.warns(UserWarning, match=r"whole Flax variables dict.*batch_stats.*linen_split"):
        step.init(variables)


def test_a_state_prints_as_a_summary(backend):
    step = jaxstep.make_train_step(
        lambda p, x: jnp.mean(x @ p["w"]), optax.adam(1e-3), backend=backend
    )
    state = step.init({"w": jnp.ones((100, 100))})
    text = repr(state)
    assert len(text) < 300, text
    assert "step=0" in text and "params=<1 leaf, 39.1 KB, float32>" in text
    assert "halted=False" in text and "on 8 devices" in text
    new, _ = step(state, np.ones((16, 100), np.float32))
    assert "donated" in repr(state)
    assert "step=1" in repr(new)


def test_a_step_prints_its_devices_backend_policy_and_options(backend):
    def my_loss(p, x):
        return jnp.mean(x * p["w"])

    step = jaxstep.make_train_step(my_loss, optax.sgd(0.1), backend=backend, microbatches=2)
    text = repr(step)
    assert text.startswith(f"TrainStep(my_loss, backend={backend!r}, devices=8 [")
    assert "on_failure='raise'" in text and "axis_name='devices'" in text
    assert "microbatches=2" in text and "loss_spike" not in text
