"""Tests of mymodel's training on 8 fake CPU devices, under both jaxstep backends.

Needs only `pip install jaxstep`: its pytest plugin gives the session fake CPU devices
(`--jaxstep-devices N`, default 8) and the `jaxstep_devices` and `jaxstep_backend`
fixtures. No conftest.py.
"""

import jaxstep
import optax
import pytest
from jaxstep import Status
from jaxstep.testing import Fault
from jaxstep.testing import assert_fails
from jaxstep.testing import assert_matches_reference
from jaxstep.testing import assert_replicas_equal

from mymodel import init_params
from mymodel import loss_fn
from mymodel import make_batches

PER_DEVICE = 2


def test_training_matches_a_single_device_reference(jaxstep_backend, jaxstep_devices):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=jaxstep_backend)
    batches = make_batches(3, PER_DEVICE * len(jaxstep_devices))
    state = assert_matches_reference(step, init_params(), batches)
    assert_replicas_equal(step, state)


def test_a_nan_gradient_is_pinned_on_its_device_step_and_leaf(jaxstep_backend, jaxstep_devices):
    bad = jaxstep_devices[5]
    step = jaxstep.make_train_step(
        loss_fn,
        optax.adam(1e-2),
        backend=jaxstep_backend,
        faults=[Fault("grad", device_id=bad.id, step=2, leaf="['w2']")],
    )
    batches = make_batches(4, PER_DEVICE * len(jaxstep_devices))
    err = assert_fails(
        lambda: jaxstep.fit(step, step.init(init_params()), batches),
        device_id=bad.id,
        step=2,
        status=Status.GRAD_NONFINITE,
        leaf="['w2']",
    )
    assert_replicas_equal(step, err.state)  # the last good state, the same everywhere


def test_a_nan_in_the_data_names_the_device_and_input_leaf(jaxstep_backend, jaxstep_devices):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=jaxstep_backend)
    batches = make_batches(3, PER_DEVICE * len(jaxstep_devices))
    batches[1]["x"][3 * PER_DEVICE, 0] = float("nan")  # a row of devices[3]'s chunk
    assert_fails(
        lambda: jaxstep.fit(step, step.init(init_params()), batches),
        device_id=jaxstep_devices[3].id,
        step=1,
        status=Status.INPUT_NONFINITE | Status.LOSS_NONFINITE | Status.GRAD_NONFINITE,
        leaf="['x']",
    )


def test_a_misnamed_fault_leaf_is_reported_at_init(jaxstep_devices):
    step = jaxstep.make_train_step(
        loss_fn,
        optax.sgd(0.1),
        faults=[Fault("grad", device_id=jaxstep_devices[0].id, step=0, leaf="['w3']")],
    )
    with pytest.raises(ValueError, match=r"names leaf \"\['w3'\]\", which does not exist"):
        step.init(init_params())
