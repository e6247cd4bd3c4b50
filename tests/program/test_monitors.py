"""Silent replica divergence and loss spikes."""

import chex
import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep.testing import assert_replicas_equal
from jaxstep.testing import corrupt_replica
from jaxstep.testing import replicas
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches
from tests.models import rows_of


def _step(backend, **kw):
    return jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend, **kw)


@pytest.mark.parametrize(
    "leaf", ["params['dense2']['kernel']", "opt_state[0].mu['dense1']['bias']"]
)
def test_one_ulp_on_one_replica_is_caught_and_named(backend, leaf):
    step = _step(backend, divergence_every=1)
    batches = make_batches(6)
    state = jaxstep.fit(step, step.init(init_params()), batches[:3])
    assert leaf in step.names["state"]
    healthy = replicas(step, (state.params, state.opt_state))[0]
    dev = jax.devices()[6]
    state = corrupt_replica(step, state, dev.id, leaf, ulps=1)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, batches[3:])
    err = info.value
    assert (err.device_id, err.step, err.status, err.leaf) == (dev.id, 3, Status.DIVERGED, leaf)
    assert [f.device_id for f in err.failures] == [dev.id]
    assert "rebuilt from the copy on device" in str(err)
    # the error's state comes from a healthy replica, on every device
    assert_replicas_equal(step, err.state)
    chex.assert_trees_all_equal(replicas(step, (err.state.params, err.state.opt_state))[0], healthy)
    jaxstep.fit(step, err.state, batches[3:])  # and trains on


def test_divergence_is_checked_every_k_steps_and_halts_under_skip(backend):
    step = _step(backend, divergence_every=4, on_failure="skip")
    batches = make_batches(10)
    state = jaxstep.fit(step, step.init(init_params()), batches[:5])
    dev = jax.devices()[1]
    # Large enough not to be rounded away by the updates of steps 5..7 before the check:
    # a one-ulp difference can heal itself, and then there is nothing left to catch.
    state = corrupt_replica(step, state, dev.id, "params['dense1']['kernel']", ulps=1 << 12)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, batches[5:])
    err = info.value
    assert (err.device_id, err.step, err.status) == (dev.id, 8, Status.DIVERGED)


def test_divergence_check_off():
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), divergence_every=None)
    batches = make_batches(4)
    state = jaxstep.fit(step, step.init(init_params()), batches[:2])
    state = corrupt_replica(step, state, jax.devices()[3].id, "params['dense1']['bias']")
    jaxstep.fit(step, state, batches[2:])  # nothing notices: that is what the check is for


def _spiky_batches(n, spike_step, position, nan_step=None):
    batches = make_batches(n, seed=3)
    batches[spike_step]["y"][rows_of(position)] *= 1e3
    if nan_step is not None:
        batches[nan_step]["x"][rows_of(0).start, 0] = np.nan
    return batches


def test_loss_spike_on_one_device(backend):
    step = _step(backend, loss_spike=jaxstep.LossSpike(window=16, warmup=8))
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), _spiky_batches(30, 20, 4))
    err = info.value
    assert (err.device_id, err.step, err.status) == (jax.devices()[4].id, 20, Status.LOSS_SPIKE)
    assert [f.device_id for f in err.failures] == [jax.devices()[4].id]
    assert err.reason == "loss spike"


def test_loss_spike_under_skip_with_a_nan_that_must_not_poison_the_window(backend):
    spike = jaxstep.LossSpike(window=16, warmup=8)
    step = _step(backend, loss_spike=spike, on_failure="skip")
    history = jaxstep.History()
    state = jaxstep.fit(
        step, step.init(init_params()), _spiky_batches(30, 20, 4, nan_step=12), history=history
    )
    status = history.as_arrays()["status"]
    assert np.flatnonzero(history.skipped).tolist() == [12, 20]
    assert status[12, 0] & Status.INPUT_NONFINITE
    assert status[20].tolist() == [0, 0, 0, 0, int(Status.LOSS_SPIKE), 0, 0, 0]
    assert int(np.asarray(step.host_state(state).total_skips)) == 2
    window = np.asarray(step.host_state(state).monitor["spike"]["losses"])
    assert np.all(np.isfinite(window))
    spike_loss = history.as_arrays()["device_loss"][20, 4]
    assert spike_loss > 1e3 and window.max() < 10  # the spike never entered the window
    assert int(np.asarray(step.host_state(state).monitor["spike"]["count"])) == 28


def test_loss_spike_validation():
    with pytest.raises(ValueError, match="warmup"):
        jaxstep.LossSpike(window=8, warmup=16)
    with pytest.raises(TypeError, match="LossSpike"):
        jaxstep.make_train_step(loss_fn, optax.sgd(0.1), loss_spike=6.0)


def test_two_replicas_that_disagree_are_both_named(backend):
    devices = jax.devices()[:2]
    step = _step(backend, divergence_every=1, devices=devices)
    batches = make_batches(4)
    state = jaxstep.fit(step, step.init(init_params()), batches[:1])
    state = corrupt_replica(step, state, devices[1].id, "params['dense1']['bias']")
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, batches[1:])
    err = info.value
    assert [f.device_id for f in err.failures] == [d.id for d in devices]
    assert all(f.status == Status.DIVERGED and f.step == 1 for f in err.failures)
    assert "no majority" in str(err)
    assert err.state is not None
