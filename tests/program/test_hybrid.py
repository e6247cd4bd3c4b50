"""make_train_step(shard_state=..., replicas=k): the state sharded inside each of k
groups of consecutive devices and whole in each group (hybrid sharding, HSDP), every
shard's twins compared by the replica check, and a rule of the user's."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxstep
from jaxstep import Status
from jaxstep.testing import Fault
from jaxstep.testing import assert_fails
from jaxstep.testing import corrupt_replica
from tests.models import PER_DEVICE
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

LAYOUTS = ("optimizer", "params")
KERNEL = "params['dense1']['kernel']"  # (3, 8): sharded along its axis 1
MOMENT = "opt_state[0].mu['dense1']['kernel']"


def _step(layout, replicas, **kw):
    kw = {"shard_min_size": 0, "divergence_every": None, **kw}
    return jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), shard_state=layout, replicas=replicas, **kw
    )


def _host(step, state):
    host = step.host_state(state)
    return [np.asarray(x) for x in jax.tree.leaves((host.params, host.opt_state))]


@pytest.fixture(scope="module")
def replicated():
    """The replicated step's run over the batches every test here trains on."""
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), divergence_every=None)
    return _host(step, jaxstep.fit(step, step.init(init_params()), make_batches(4)))


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_groups_of_devices_train_as_the_replicated_step(layout, replicas, replicated):
    step = _step(layout, replicas)
    state = step.init(init_params())
    m = 8 // replicas  # the devices a shard is split over
    moment = state.opt_state[0].mu["dense1"]["kernel"]
    assert moment.sharding.spec == P(None, "fsdp")
    assert {s.data.shape for s in moment.addressable_shards} == {(3, 8 // m)}
    # the devices at the same place in every group hold the same block: twins
    for j in range(m):
        blocks = [s for s in moment.addressable_shards if step.devices.index(s.device) % m == j]
        assert len(blocks) == replicas and len({str(s.index) for s in blocks}) == 1
    kernel = state.params["dense1"]["kernel"]
    whole = layout == "optimizer"
    assert kernel.sharding.is_fully_replicated == whole
    got = _host(step, jaxstep.fit(step, state, make_batches(4)))
    for x, y in zip(got, replicated, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_nan_row_is_named_by_device_leaf_and_example_under_groups(layout):
    dev = jax.devices()[6]
    fault = Fault("input", dev.id, step=2, mode="data", example=3, leaf="['x']")
    step = _step(layout, 2, faults=[fault])
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), make_batches(4), diagnose=True)
    err = assert_fails(info, device_id=dev.id, step=2, leaf="['x']")
    assert err.status & Status.INPUT_NONFINITE
    assert err.diagnosis.verdict == "data" and err.diagnosis.examples == (6 * PER_DEVICE + 3,)


@pytest.mark.parametrize("leaf", [KERNEL, MOMENT])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_shard_that_differs_from_its_twins_is_named_with_four_groups(layout, leaf):
    if layout == "optimizer" and leaf == KERNEL:
        pytest.skip("the optimizer layout keeps parameters whole: test_shard_state's case")
    step = _step(layout, 4, divergence_every=1)
    state = jaxstep.fit(step, step.init(init_params()), make_batches(1))
    runtime = jaxstep._src.step.runtime_of(step)
    assert runtime.replicas_agree(state)
    bad = corrupt_replica(step, state, jax.devices()[5].id, leaf)
    assert not runtime.replicas_agree(bad)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, bad, make_batches(2))
    assert_fails(info, device_id=5, step=1, status=Status.DIVERGED, leaf=leaf)
    assert "agrees with the majority" in str(info.value)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_twins_that_differ_are_both_named_and_no_majority_is_claimed(layout):
    step = _step(layout, 2, divergence_every=1)
    state = jaxstep.fit(step, step.init(init_params()), make_batches(1))
    bad = corrupt_replica(step, state, jax.devices()[5].id, MOMENT)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, bad, make_batches(2))
    err = assert_fails(info, device_id=[1, 5], step=1, status=Status.DIVERGED, leaf=MOMENT)
    assert "devices 1 and 5 hold the two copies of a shard" in str(err)
    assert "no majority can tell which one is right" in str(err)


@pytest.mark.parametrize("leaf", [KERNEL, MOMENT])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_drop_repairs_a_shard_from_its_twins_once_bit_for_bit(layout, leaf):
    batches = make_batches(5)

    def run(corrupt):
        step = _step(layout, 4, divergence_every=1, on_failure="drop")
        state = jaxstep.fit(step, step.init(init_params()), batches[:1])
        if corrupt:
            state = corrupt_replica(step, state, jax.devices()[5].id, leaf, ulps=4)
        history = jaxstep.History()
        state = jaxstep.fit(step, state, batches[1:], history=history)
        return step, state, history

    _, clean, _ = run(False)
    step, state, history = run(True)
    assert history.repaired == [(5,), (), (), ()]
    assert np.asarray(step.host_state(state).monitor["repairs"]).tolist() == [0] * 5 + [1, 0, 0]
    assert jaxstep._src.step.runtime_of(step).replicas_agree(state)
    for x, y in zip(_host(step, state), _host(step, clean), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_rule_of_the_users_says_where_each_parameter_is_split():
    asked = []

    def rule(path, shape):
        asked.append(path)
        return 0 if path == "['dense2']['kernel']" else None  # (8, 1): its rows

    step = _step("params", 2, shard_rule=rule)
    state = step.init(init_params())
    assert state.params["dense2"]["kernel"].sharding.spec == P("fsdp")
    assert state.params["dense1"]["kernel"].sharding.is_fully_replicated
    assert state.opt_state[0].nu["dense2"]["kernel"].sharding.spec == P("fsdp")  # mirrors
    assert state.opt_state[0].count.sharding.is_fully_replicated
    assert set(asked) == {
        "['dense1']['bias']",
        "['dense1']['kernel']",
        "['dense2']['bias']",
        "['dense2']['kernel']",
    }  # parameters alone
    plain = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), divergence_every=None)
    want = _host(plain, jaxstep.fit(plain, plain.init(init_params()), make_batches(2)))
    got = _host(step, jaxstep.fit(step, state, make_batches(2)))
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


def test_shard_min_size_keeps_small_leaves_whole_under_a_rule_of_the_users_too():
    """A user's rule (and jaxstep.flax.shard_rule) that names every leaf leaves those
    under shard_min_size whole, as the default rule does (issue 45, item 9): a small
    leaf is neither split nor refused for a size that does not divide."""
    every = lambda path, shape: 0  # noqa: E731  (dense1's kernel: 3 rows, 24 elements)
    step = jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), shard_state="params", shard_rule=every, shard_min_size=25
    )
    with pytest.warns(UserWarning, match=r"shards no leaf.*shard_min_size=25"):
        state = step.init(init_params())  # every leaf is under 25 elements
    assert state.params["dense1"]["kernel"].sharding.is_fully_replicated  # 3 rows: whole
    state = _step("params", 1, shard_rule=every, shard_min_size=24).init(init_params())
    assert state.params["dense1"]["kernel"].shape == (8, 8)  # 24 elements: split, padded
    assert state.params["dense2"]["kernel"].sharding.is_fully_replicated  # 8: whole
    columns = lambda path, shape: 1 if shape == (3, 8) else 0  # noqa: E731
    state = _step("params", 1, shard_rule=columns, shard_min_size=9).init(init_params())
    assert state.params["dense1"]["kernel"].sharding.spec == P(None, "devices")  # 24 elements
    assert state.opt_state[0].mu["dense1"]["kernel"].sharding.spec == P(None, "devices")
    for small in (("dense1", "bias"), ("dense2", "kernel"), ("dense2", "bias")):  # 8, 8, 1
        assert state.params[small[0]][small[1]].sharding.is_fully_replicated
        assert state.opt_state[0].mu[small[0]][small[1]].sharding.is_fully_replicated


def test_a_rule_that_returns_no_axis_of_the_leaf_is_refused_naming_it():
    """(An axis that does not divide by the group is held padded:
    tests/step/test_rule_padded.py.)"""
    params = init_params()
    step = _step("params", 1, shard_rule=lambda path, shape: 1)
    with pytest.raises(
        ValueError, match=r"returned axis 1, which a leaf of shape \(8,\) does not have"
    ):
        step.init(params)
    step = _step("params", 1, shard_rule=lambda path, shape: "rows")
    with pytest.raises(TypeError, match=r"returned 'rows'; return an axis \(an int\) or None"):
        step.init(params)


def test_replicas_that_cannot_form_groups_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match=r"replicas=3 does not divide the 8 devices.*1, 2, 4, 8"):
        _step("params", 3)
    with pytest.raises(ValueError, match=r"replicas=2 needs shard_state"):
        jaxstep.make_train_step(loss_fn, optax.adam(1e-2), replicas=2)
    with pytest.raises(TypeError, match=r"replicas must be an int >= 1"):
        _step("params", 0)
    with pytest.raises(ValueError, match=r"shard_rule needs shard_state"):
        jaxstep.make_train_step(loss_fn, optax.adam(1e-2), shard_rule=lambda p, s: None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_exclusion_leaves_the_devices_group_out_and_stays_sharded(layout):
    step = _step(layout, 2)
    state = step.init(init_params())
    with pytest.warns(UserWarning, match=r"device 6.*group.*4, 5, 6, 7"):
        smaller = step.exclude_devices([6], state)
    assert [d.id for d in step.devices] == [0, 1, 2, 3]
    assert step.options.replicas == 1
    moment = smaller.opt_state[0].mu["dense1"]["kernel"]
    assert {s.data.shape for s in moment.addressable_shards} == {(3, 2)}  # still 1/4
    plain = jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), divergence_every=None, devices=jax.devices()[:4]
    )
    want = _host(plain, jaxstep.fit(plain, plain.init(init_params()), make_batches(2)))
    got = _host(step, jaxstep.fit(step, smaller, make_batches(2)))
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


def test_recover_goes_back_to_the_checkpoint_when_two_twins_differ(tmp_path):
    batches = make_batches(4)

    def run(corrupt):
        saving = {"checkpoint_dir": tmp_path / str(corrupt), "checkpoint_every": 2}
        step = _step("params", 2, divergence_every=1)
        state = jaxstep.fit(step, step.init(init_params()), batches[:2], **saving)
        if corrupt:  # after the run's end was saved (verified)
            state = corrupt_replica(step, state, jax.devices()[5].id, MOMENT)
        history = jaxstep.History()
        recover = jaxstep.Recover(rollback_batches=2)
        state = jaxstep.fit(step, state, batches[2:], history=history, recover=recover, **saving)
        return step, state, history

    step, state, history = run(True)
    (record,) = history.recoveries
    assert (record.step, record.verdict, record.action) == (2, "diverged", "rolled back")
    assert sorted(record.device_ids) == [1, 5]
    clean_step, clean, _ = run(False)
    for x, y in zip(_host(step, state), _host(clean_step, clean), strict=True):
        np.testing.assert_array_equal(x, y)
