"""assert_fails blames the root cause only: the devices a collective in the model
carried a failure to are not blamed, several devices are given in any order, and a
status may be required in part. Both backends where a step runs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep.testing import Fault
from jaxstep.testing import assert_fails
from tests.flax.test_flax_models import _imagenet_step
from tests.flax.test_flax_models import _images
from tests.flax.test_flax_models import _rows


def test_a_nan_input_spread_by_batchnorm_blames_its_device_alone(backend):
    step, params, model_state = _imagenet_step(backend, "batch")
    state = step.init(params, model_state=model_state, rng=jax.random.key(1))
    batches = _images(3)
    batches[2]["image"][_rows(3).start + 1, 4, 4, 0] = np.nan
    dev3 = jax.devices()[3].id
    err = assert_fails(
        lambda: jaxstep.fit(step, state, batches),
        device_id=dev3,
        step=2,
        has_status=Status.INPUT_NONFINITE,
        leaf="['image']",
    )
    assert len(err.failures) == len(jax.devices())  # every device failed ...
    assert [f.device_id for f in err.root_causes] == [dev3]  # ... one is to blame
    with pytest.raises(AssertionError, match=r"follow from device .*not blamed.*not blamed"):
        assert_fails(err, device_id=jax.devices()[0].id, step=2)
    with pytest.raises(AssertionError, match=r"without Status\.CHECK_FAILED"):
        assert_fails(err, device_id=dev3, step=2, has_status=Status.CHECK_FAILED)


def test_several_devices_are_given_in_any_order_and_each_is_needed(backend):
    two, five = jax.devices()[2].id, jax.devices()[5].id
    step = jaxstep.make_train_step(
        lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optax.sgd(0.1),
        backend=backend,
        faults=[Fault("grad", device_id=d, step=1) for d in (five, two)],
    )
    batch = {"x": np.ones((16, 3), np.float32), "y": np.ones((16,), np.float32)}
    state = step.init({"w": np.zeros(3, np.float32)})
    err = assert_fails(lambda: jaxstep.fit(step, state, [batch] * 3), device_id=[five, two], step=1)
    assert_fails(err, device_id=[two, five], step=1, has_status=Status.GRAD_NONFINITE)
    with pytest.raises(AssertionError, match=f"blamed, but should be healthy: {five}"):
        assert_fails(err, device_id=two, step=1)
