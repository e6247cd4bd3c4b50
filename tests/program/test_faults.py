"""A fault injected on one chosen device at one chosen step is pinned on exactly that
device, step, status and tensor; healthy devices are never blamed."""

import chex
import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from tests.models import host_params
from tests.models import init_params
from tests.models import loss_fn
from tests.models import loss_with_checks
from tests.models import make_batches
from tests.models import rows_of


def _run(backend, batches, *, devices=None, loss=loss_fn, has_aux=False):
    step = jaxstep.make_train_step(
        loss, optax.adam(1e-2), backend=backend, devices=devices, has_aux=has_aux
    )
    state = step.init(init_params())
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, batches)
    return step, info.value


def _state_after(backend, batches, num):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    state = jaxstep.fit(step, step.init(init_params()), batches, num_steps=num)
    return host_params(step, state), int(np.asarray(step.host_state(state).step))


@pytest.mark.parametrize("position,bad_step", [(5, 3), (0, 0)])
def test_nan_input_names_device_step_and_leaf(backend, position, bad_step):
    batches = make_batches(6)
    batches[bad_step]["x"][rows_of(position).start + 1, 2] = np.nan
    step, err = _run(backend, batches)
    dev = jax.devices()[position]
    assert err.device_id == dev.id
    assert err.step == bad_step
    assert err.status == Status.INPUT_NONFINITE | Status.LOSS_NONFINITE | Status.GRAD_NONFINITE
    assert err.leaf == "['x']"
    assert [f.device_id for f in err.failures] == [dev.id]
    assert str(err).startswith(f"training worker on device {dev.id} failed: non-finite input")
    assert f"at step {bad_step}" in str(err)
    # the last good state is the state after step bad_step - 1
    want, want_step = _state_after(backend, batches, bad_step)
    got = host_params(step, err.state)
    assert int(np.asarray(step.host_state(err.state).step)) == want_step == bad_step
    chex.assert_trees_all_equal(got, want)
    assert not bool(np.any(np.asarray(err.state.halted)))


def test_nonfinite_loss_from_data(backend):
    batches = make_batches(5)
    batches[2]["pos"][rows_of(6)][0] = -1.0  # log(-1) = nan on device 6 only
    _, err = _run(backend, batches)
    assert err.device_id == jax.devices()[6].id
    assert err.step == 2
    assert Status.LOSS_NONFINITE in err.status
    assert Status.INPUT_NONFINITE not in err.status
    assert err.reason.startswith("non-finite loss")
    assert len(err.failures) == 1


def test_infinite_gradient_in_one_named_leaf(backend):
    batches = make_batches(5)
    batches[4]["poison"][rows_of(3)] = 1.0
    _, err = _run(backend, batches)
    assert err.device_id == jax.devices()[3].id
    assert err.step == 4
    assert err.status == Status.GRAD_NONFINITE
    assert err.leaf == "['dense2']['kernel']"
    assert err.reason == "non-finite gradient in ['dense2']['kernel']"
    assert len(err.failures) == 1


def test_permuted_devices_name_the_device_not_its_position(backend):
    devices = jax.devices()
    order = [devices[i] for i in (7, 2, 5, 0, 1, 6, 3, 4)]
    batches = make_batches(3)
    batches[1]["x"][rows_of(2)] = np.inf  # position 2 -> devices[5]
    _, err = _run(backend, batches, devices=order)
    assert err.device_id == devices[5].id != 2
    assert err.step == 1
    assert [f.device_id for f in err.failures] == [devices[5].id]


def test_two_failing_devices_are_both_listed_root_cause_first(backend):
    batches = make_batches(4)
    batches[2]["x"][rows_of(6).start, 0] = np.nan
    batches[2]["poison"][rows_of(1)] = 1.0
    _, err = _run(backend, batches)
    ids = [f.device_id for f in err.failures]
    # device 6's non-finite input comes before device 1's gradient in the chain
    assert ids == [jax.devices()[6].id, jax.devices()[1].id]
    assert err.device_id == jax.devices()[6].id
    assert [f.status for f in err.failures] == [
        Status.INPUT_NONFINITE | Status.LOSS_NONFINITE | Status.GRAD_NONFINITE,
        Status.GRAD_NONFINITE,
    ]
    assert "likely follows" not in str(err)  # device 1's loss was finite: its own fault
    assert all(f.step == 2 for f in err.failures)
    assert f"device {jax.devices()[1].id}" in str(err)


def test_failing_user_check_is_named(backend):
    batches = make_batches(4)
    batches[3]["y"][rows_of(4)][1] = 1e4  # finite, but fails the 'y_bounded' check
    _, err = _run(backend, batches, loss=loss_with_checks, has_aux=True)
    assert err.device_id == jax.devices()[4].id
    assert err.step == 3
    assert err.status == Status.CHECK_FAILED
    assert "'y_bounded'" in err.reason
    assert len(err.failures) == 1


def _overflowing_step(backend, **kw):
    # A finite gradient and an absurd learning rate overflow the float32 parameters.
    def loss(params, batch):
        return (params["w"] * batch["x"]).mean() * 1e10

    step = jaxstep.make_train_step(loss, optax.sgd(1e30), backend=backend, **kw)
    state = step.init({"w": np.ones(3, np.float32)})
    batches = [{"x": np.ones((8, 3), np.float32)}] * 3
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, batches)
    return step, info.value


def test_verify_update_keeps_nonfinite_parameters_out(backend):
    step, err = _overflowing_step(backend, verify_update=True)
    assert err.status == Status.PARAM_NONFINITE
    assert err.leaf == "['w']"
    assert err.step == 0
    # the update is the same on every replica, so every device reports it
    assert [f.device_id for f in err.failures] == [d.id for d in jax.devices()]
    np.testing.assert_array_equal(host_params(step, err.state)["w"], np.ones(3))


def test_nonfinite_parameters_are_caught_at_the_next_check(backend):
    # Without verify_update the overflowing update is committed; the parameter check
    # at the start of the next checked step names the leaf on every device.
    _, err = _overflowing_step(backend, divergence_every=1)
    assert err.step == 1
    assert Status.PARAM_NONFINITE in err.status
    assert err.leaf == "['w']"
    assert len(err.failures) == 8
    assert "error.state" in str(err)


def test_a_fresh_step_reports_failures_of_a_state_it_did_not_build(backend):
    first = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    batches = make_batches(4)
    state = jaxstep.fit(first, first.init(init_params()), batches[:2])
    second = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    batches[3]["poison"][rows_of(6)] = 1.0
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(second, state, batches[2:])
    err = info.value
    assert (err.device_id, err.step, err.leaf) == (jax.devices()[6].id, 3, "['dense2']['kernel']")
