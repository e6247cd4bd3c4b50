"""A user's shard_rule that puts a parameter on an axis that does not divide by a
group's devices (lm1b's 2 heads over 8 devices under MaxText's rules): the leaf is held
padded with zeros to the next multiple, as after an exclusion, and the log says so;
the run is the replicated one, a fault is named by device, step and leaf, and a
checkpoint holds the logical arrays (issue 45, item 8)."""

import logging
import warnings

import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep.testing import Fault
from jaxstep.testing import assert_fails
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

LAYOUTS = ("optimizer", "params")


def rows(path, shape):
    """Every parameter along its first axis: dense1's kernel (3, 8) has 3 rows."""
    return 0


def _step(layout, replicas=1, **kw):
    return jaxstep.make_train_step(
        loss_fn,
        optax.adam(1e-2),
        shard_state=layout,
        shard_rule=rows,
        shard_min_size=0,
        replicas=replicas,
        divergence_every=None,
        **kw,
    )


def _host(step, state):
    host = step.host_state(state)
    return [np.asarray(x) for x in jax.tree.leaves((host.params, host.opt_state))]


def _replicated(batches):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), divergence_every=None)
    return step, jaxstep.fit(step, step.init(init_params()), batches)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_leaf_the_rule_cannot_divide_is_held_padded_and_trains_as_replicated(
    layout, replicas, caplog, tmp_path
):
    step = _step(layout, replicas)
    m = 8 // replicas
    with caplog.at_level(logging.WARNING, logger="jaxstep"):
        state = step.init(init_params())
        step.init(init_params())  # said once a step
    said = [r.getMessage() for r in caplog.records if "held padded" in r.getMessage()]
    assert len(said) == 1
    over = "the 8 devices" if replicas == 1 else "a group's 4 devices"
    assert f"on an axis that does not divide by {over}" in said[0]
    assert f"params['dense1']['kernel'] (shape (3, 8), axis 0: 3 -> {m})" in said[0]
    mu = state.opt_state[0].mu["dense1"]["kernel"]
    assert mu.shape == (m, 8) and {s.data.shape for s in mu.addressable_shards} == {(1, 8)}
    kernel = state.params["dense1"]["kernel"]
    assert kernel.shape == ((m, 8) if layout == "params" else (3, 8))
    batches = make_batches(3)
    state = jaxstep.fit(step, state, batches)
    host = step.host_state(state)
    assert jax.tree.map(np.shape, host.params) == jax.tree.map(np.shape, init_params())
    plain, want = _replicated(batches)
    for got, expected in zip(_host(step, state), _host(plain, want), strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    adam = state.opt_state[0]  # the padded rows' moments (and parameters) stay 0
    for tree in (adam.mu, adam.nu) + ((state.params,) if layout == "params" else ()):
        assert not np.asarray(tree["dense1"]["kernel"])[3:].any()
    # a checkpoint holds the logical arrays: onto the replicated step and back, bitwise
    jaxstep.save(step, state, tmp_path)
    written = _host(step, state)
    for other in (plain, step):
        restored = jaxstep.restore(other, tmp_path)
        for a, b in zip(_host(other, restored), written, strict=True):
            assert np.shape(a) == np.shape(b) and np.array_equal(a, b)
    jaxstep.fit(step, restored, make_batches(1, seed=3))  # and trains on


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_fault_under_a_padded_rule_names_the_device_step_and_leaf(layout):
    fault = Fault("grad", device_id=6, step=1, leaf="['dense1']['kernel']")
    step = _step(layout, faults=[fault])
    state = jaxstep.fit(step, step.init(init_params()), make_batches(1))
    good = _host(step, state)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, make_batches(2, seed=4), diagnose=False)
    err = assert_fails(info, device_id=6, step=1, leaf="['dense1']['kernel']")
    assert err.status & Status.GRAD_NONFINITE
    assert [f.device_id for f in err.failures] == [6]  # no healthy device blamed
    for a, b in zip(_host(step, err.state), good, strict=True):  # the last good state
        assert np.array_equal(a, b)


def test_an_exclusion_from_a_padded_rule_pads_for_the_devices_left():
    step = _step("params")
    state = jaxstep.fit(step, step.init(init_params()), make_batches(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = step.exclude_devices([5], state)
    kernel = state.params["dense1"]["kernel"]
    assert kernel.shape == (7, 8) and {s.data.shape for s in kernel.addressable_shards} == {(1, 8)}
    seven = [{k: v[: 7 * (v.shape[0] // 8)] for k, v in b.items()} for b in make_batches(2, seed=2)]
    state = jaxstep.fit(step, state, seven)
    host = step.host_state(state)
    assert jax.tree.map(np.shape, host.params) == jax.tree.map(np.shape, init_params())
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(host.params))
