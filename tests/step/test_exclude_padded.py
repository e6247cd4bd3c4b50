"""An exclusion under shard_state keeps the state sharded: a leaf whose axis no longer
divides by the devices left is padded to a multiple (each device holds ceil(rows / n)
of it), never made whole, and the padding reaches no loss, optimizer moment,
checkpoint or host_state. On 8 fake devices, one or two left out."""

import warnings

import jax
import numpy as np
import optax
import pytest

import jaxstep
import jaxstep.testing
from jaxstep import Status
from jaxstep.testing import Fault
from jaxstep.testing import assert_fails
from tests.models import PER_DEVICE
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

LAYOUTS = ("optimizer", "params")


def _step(layout, **kw):
    kw = {"shard_min_size": 0, "divergence_every": None, **kw}
    return jaxstep.make_train_step(loss_fn, optax.adam(1e-2), shard_state=layout, **kw)


def _rows(batches, n):
    """``batches`` cut to ``n`` devices' rows (a global batch the devices left divide)."""
    return [{k: v[: n * PER_DEVICE] for k, v in b.items()} for b in batches]


def _host(step, state):
    host = step.host_state(state)
    return [np.asarray(x) for x in jax.tree.leaves((host.params, host.opt_state))]


def _replicated(devices, batches):
    """A replicated step's run on ``devices`` over ``batches``, on the host."""
    step = jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), devices=devices, divergence_every=None
    )
    return _host(step, jaxstep.fit(step, step.init(init_params()), batches))


def _excluded(step, state, device_id):
    """``step.exclude_devices([device_id], state)``, its warning (tested above) quiet."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return step.exclude_devices([device_id], state)


def _without(*ids):
    return [d for d in jax.devices() if d.id not in ids]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_leaf_that_no_longer_divides_stays_sharded_padded_and_trains_as_replicated(layout):
    step = _step(layout)
    state = step.init(init_params())
    with pytest.warns(UserWarning, match=r"no longer divide over 7 devices and stay sharded"):
        state = step.exclude_devices([5], state)
    # dense1's kernel (3, 8) was split along its 8 columns: 2 a device of 14 now
    mu = state.opt_state[0].mu["dense1"]["kernel"]
    assert mu.shape == (3, 14) and {s.data.shape for s in mu.addressable_shards} == {(3, 2)}
    kernel = state.params["dense1"]["kernel"]
    if layout == "params":
        assert {s.data.shape for s in kernel.addressable_shards} == {(3, 2)}
    else:  # ZeRO-1: the parameters stay whole, with their own shape
        assert kernel.shape == (3, 8) and kernel.sharding.is_fully_replicated
    batches = _rows(make_batches(3), 7)
    state = jaxstep.fit(step, state, batches)
    # the user never sees the padding; the run equals a replicated one on the 7 devices
    host = step.host_state(state)
    assert jax.tree.map(np.shape, host.params) == jax.tree.map(np.shape, init_params())
    want = _replicated(_without(5), batches)
    for got, expected in zip(_host(step, state), want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    # the padded columns' Adam moments stay 0 (and the padded parameters, under FSDP)
    adam = state.opt_state[0]
    for tree in (adam.mu, adam.nu) + ((state.params,) if layout == "params" else ()):
        assert not np.asarray(tree["dense1"]["kernel"])[:, 8:].any()
        assert not np.asarray(tree["dense2"]["kernel"])[8:].any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_padded_state_is_written_and_restored_with_its_logical_shapes(layout, tmp_path):
    step = _step(layout)
    state = _excluded(step, step.init(init_params()), 5)
    state = jaxstep.fit(step, state, _rows(make_batches(2), 7), checkpoint_dir=tmp_path)
    written = step.host_state(state)
    # onto a step of all 8 devices (nothing padded) and back onto the 7 (padded again)
    for other in (_step(layout), step):
        restored = jaxstep.restore(other, tmp_path)
        host = other.host_state(restored)
        for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(written), strict=True):
            assert np.shape(a) == np.shape(b) and np.array_equal(a, b)
    assert restored.opt_state[0].mu["dense1"]["kernel"].shape == (3, 14)
    jaxstep.fit(step, restored, _rows(make_batches(1, seed=3), 7))  # and trains on


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_nan_row_after_an_exclusion_is_named_by_device_leaf_and_example(layout):
    dev = jax.devices()[6]
    fault = Fault("input", dev.id, step=1, mode="data", example=2, leaf="['x']")
    step = _step(layout, faults=[fault])
    state = _excluded(step, step.init(init_params()), 5)
    state = jaxstep.fit(step, state, _rows(make_batches(1), 7))
    good = [np.asarray(x) for x in jax.tree.leaves(step.host_state(state))]
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, _rows(make_batches(2, seed=4), 7), diagnose=True)
    err = assert_fails(info, device_id=dev.id, step=1, leaf="['x']")
    assert err.status & Status.INPUT_NONFINITE
    position = [d.id for d in step.devices].index(dev.id)  # 5: device 5 left
    assert err.diagnosis.verdict == "data"
    assert err.diagnosis.examples == (position * PER_DEVICE + 2,)
    last_good = step.host_state(err.state)  # the state before the failing step, logical
    for a, b in zip(jax.tree.leaves(last_good), good, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_second_exclusion_pads_again_for_the_devices_left(layout):
    step = _step(layout)
    state = _excluded(step, step.init(init_params()), 5)
    state = jaxstep.fit(step, state, _rows(make_batches(1), 7))
    state = _excluded(step, state, 6)
    mu = state.opt_state[0].mu["dense1"]["kernel"]
    assert mu.shape == (3, 12) and {s.data.shape for s in mu.addressable_shards} == {(3, 2)}
    state = jaxstep.fit(step, state, _rows(make_batches(2, seed=2), 6))
    first = _rows(make_batches(1), 7)
    reference = jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), devices=_without(5), divergence_every=None
    )
    half = jaxstep.fit(reference, reference.init(init_params()), first)
    half = _excluded(reference, half, 6)
    want = _host(reference, jaxstep.fit(reference, half, _rows(make_batches(2, seed=2), 6)))
    for got, expected in zip(_host(step, state), want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


def test_a_rule_of_the_users_is_kept_padded_after_an_exclusion():
    def rows_first(path, shape):  # the kernels along their first axis where it is 8
        return 0 if shape[0] == 8 else None

    step = _step("params", shard_rule=rows_first)
    state = step.init(init_params())
    with pytest.warns(UserWarning, match=r"params\['dense2'\]\['kernel'\]"):
        state = step.exclude_devices([0], state)
    kernel = state.params["dense2"]["kernel"]  # (8, 1) along its rows: 2 a device of 14
    assert {s.data.shape for s in kernel.addressable_shards} == {(2, 1)}
    assert state.params["dense1"]["kernel"].sharding.is_fully_replicated  # the rule's None
    batches = _rows(make_batches(2), 7)
    state = jaxstep.fit(step, state, batches)
    for got, expected in zip(_host(step, state), _replicated(_without(0), batches), strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_excluded_step_inits_and_quarantines_a_row_like_any_step(layout):
    dev = jax.devices()[6]
    fault = Fault("input", dev.id, step=1, mode="data", example=2, leaf="['x']")
    step = _step(layout, faults=[fault])
    _excluded(step, step.init(init_params()), 5)
    state = step.init(init_params())  # a new state for the step on 7: laid out padded
    assert state.opt_state[0].mu["dense1"]["kernel"].shape == (3, 14)
    history = jaxstep.History()
    state = jaxstep.fit(
        step, state, _rows(make_batches(3), 7), recover=jaxstep.Recover(), history=history
    )
    (quarantined,) = history.recoveries
    assert (quarantined.step, quarantined.action) == (1, "quarantined")
    position = [d.id for d in step.devices].index(dev.id)
    assert quarantined.examples == (position * PER_DEVICE + 2,)
    assert int(state.step) == 3
    # the parameters alone, read from each device (the testing kit's reads): logical
    copies = jaxstep.testing.replicas(step, state.params)
    want = jax.tree.map(np.shape, init_params())
    assert all(jax.tree.map(np.shape, copy) == want for copy in copies)


def test_a_factored_optimizer_state_follows_its_padded_parameter():
    # adafactor keeps a row and a column second moment of a matrix: each takes the
    # shape the optimizer builds for the padded parameter
    params = {"w": np.random.default_rng(0).normal(size=(256, 136)).astype(np.float32)}

    def loss(p, batch):
        return ((batch["x"] @ p["w"]).mean() - batch["y"].mean()) ** 2

    step = jaxstep.make_train_step(
        loss,
        optax.adafactor(1e-2),
        shard_state="params",
        shard_min_size=0,
        divergence_every=None,
    )
    with pytest.warns(UserWarning, match="no longer divide over 7 devices"):
        state = step.exclude_devices([7], step.init(params))
    assert state.params["w"].shape == (259, 136)  # along its 256 rows: 37 a device
    rng = np.random.default_rng(1)
    batches = [{"x": rng.normal(size=(14, 256)).astype(np.float32), "y": np.ones(14)}] * 2
    state = jaxstep.fit(step, state, batches)
    host = step.host_state(state)
    assert host.params["w"].shape == (256, 136) and np.isfinite(host.params["w"]).all()
    factored = [np.shape(x) for x in jax.tree.leaves(host.opt_state)]
    assert (256,) in factored and (136,) in factored
