"""make_train_step(shard_state="optimizer" | "params"): the sharding rule, and every
per-device check keeping its meaning when the state is sharded over the devices (the
device, leaf and example of a failure, err.state, drop, micro-batches, loss scaling,
the replica checks, verify_update, the fault kit)."""

import itertools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxstep
from jaxstep import Status
from jaxstep._src.program import DEFAULT_SHARD_MIN_SIZE
from jaxstep._src.program import Plan
from jaxstep._src.program import shard_axis
from jaxstep.testing import Fault
from jaxstep.testing import assert_fails
from jaxstep.testing import assert_matches_reference
from jaxstep.testing import corrupt_replica
from tests.models import PER_DEVICE
from tests.models import host_params
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

LAYOUTS = ("optimizer", "params")


def _step(layout, **kw):
    """The tests' MLP with every leaf the rule can shard sharded (its leaves are small)."""
    kw = {"shard_min_size": 0, "divergence_every": None, **kw}
    return jaxstep.make_train_step(loss_fn, optax.adam(1e-2), shard_state=layout, **kw)


def _spec(x):
    return x.sharding.spec


def _close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def test_the_rule_shards_each_leaf_along_its_largest_dividing_axis():
    assert shard_axis((512, 784), 8, 0) == 1  # both divide: the larger
    assert shard_axis((256, 256), 8, 0) == 0  # a tie: the first
    assert shard_axis((129, 128), 8, 0) == 1  # only one divides
    assert shard_axis((7, 9), 8, 0) is None  # none divides: replicated
    assert shard_axis((1024,), 8, 2**16) is None  # fewer elements than shard_min_size
    assert shard_axis((256, 256), 8, 2**16) == 0  # not fewer: sharded
    step = _step("params")
    state = step.init(init_params())
    # dense1: kernel (3, 8), bias (8,); dense2: kernel (8, 1), bias (1,) (no dividing axis)
    want = {"dense1": {"kernel": P(None, "devices"), "bias": P("devices")}}
    want["dense2"] = {"kernel": P("devices"), "bias": P()}
    assert jax.tree.map(_spec, state.params) == want
    assert jax.tree.map(_spec, state.opt_state[0].mu) == want  # Adam's moments alike
    assert _spec(state.opt_state[0].count) == P() and _spec(state.step) == P()
    # the default shard_min_size keeps these small leaves whole; "optimizer" the params
    default = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), shard_state="params").options
    assert default.shard_min_size == DEFAULT_SHARD_MIN_SIZE
    assert Plan.of(default, state).params == (None,) * 4
    zero1 = _step("optimizer").init(init_params())
    assert all(_spec(x) == P() for x in jax.tree.leaves(zero1.params))
    assert jax.tree.map(_spec, zero1.opt_state[0].nu) == want
    # global arrays with their logical shapes: device_get gives the whole parameters
    np.testing.assert_array_equal(
        jax.device_get(state.params)["dense1"]["kernel"], init_params()["dense1"]["kernel"]
    )


def test_shard_state_is_refused_under_pmap_and_an_unknown_value_lists_the_choices():
    with pytest.raises(ValueError, match="shard_state='params' needs backend='shard_map'"):
        jaxstep.make_train_step(loss_fn, optax.sgd(0.1), backend="pmap", shard_state="params")
    with pytest.raises(ValueError, match=r"unknown shard_state 'zero3'.*'optimizer'.*'params'"):
        jaxstep.make_train_step(loss_fn, optax.sgd(0.1), shard_state="zero3")
    with pytest.raises(TypeError, match="shard_min_size must be an int >= 0"):
        jaxstep.make_train_step(loss_fn, optax.sgd(0.1), shard_state="params", shard_min_size=-1)
    step = _step("optimizer")
    assert step.options.shard_state == "optimizer" and step.options.shard_min_size == 0
    assert "shard_state='optimizer'" in repr(step)
    assert jaxstep.make_train_step(loss_fn, optax.sgd(0.1)).options.shard_state is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_equals_the_replicated_step_and_the_fault_kit_works(layout):
    batches = make_batches(4)
    assert_matches_reference(_step(layout), init_params(), batches, rtol=1e-6, atol=1e-6)
    # an optax transform with a view of the whole tree: the update runs on global arrays
    clip = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    kw = {"divergence_every": 2}
    step = jaxstep.make_train_step(loss_fn, clip, shard_state=layout, shard_min_size=0, **kw)
    state = jaxstep.fit(step, step.init(init_params()), batches)
    replicated = jaxstep.make_train_step(loss_fn, clip, **kw)
    reference = jaxstep.fit(replicated, replicated.init(init_params()), batches)
    _close(host_params(step, state), host_params(replicated, reference), 1e-6)
    # the kit: a loss spike on one device, named by assert_fails
    faulty = _step(
        layout,
        loss_spike=jaxstep.LossSpike(window=4, warmup=2, sigmas=100.0),
        faults=[Fault("loss", 2, step=3, value=1e4)],
    )
    assert_fails(
        lambda: jaxstep.fit(faulty, faulty.init(init_params()), batches),
        device_id=2,
        step=3,
        status=Status.LOSS_SPIKE,
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_nan_row_is_named_with_its_device_leaf_and_example_and_the_run_resumes_exactly(
    layout, tmp_path
):
    dev = jax.devices()[3]
    batches = make_batches(5)
    faulty = _step(
        layout, faults=[Fault("input", dev.id, step=2, mode="data", example=1, leaf="['x']")]
    )
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(
            faulty, faulty.init(init_params()), batches, diagnose=True, checkpoint_dir=tmp_path
        )
    err = info.value
    assert_fails(err, device_id=dev.id, step=2, leaf="['x']", has_status=Status.INPUT_NONFINITE)
    assert err.diagnosis.verdict == "data" and err.diagnosis.examples == (3 * PER_DEVICE + 1,)
    # err.state: the clean run stopped before step 2, shard by shard
    clean = _step(layout)
    before = jaxstep.fit(clean, clean.init(init_params()), batches[:2])
    for got, want in zip(jax.tree.leaves(err.state), jax.tree.leaves(before), strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
        for a, b in zip(got.addressable_shards, want.addressable_shards, strict=True):
            np.testing.assert_array_equal(a.data, b.data)
    # the emergency save restores it; the rest trained after the fix ends where the
    # clean run ends
    saved = jaxstep.restore(clean, err.checkpoint)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(jax.device_get(a), jax.device_get(b))
    rest = batches[2 + len(err.batches) :]
    ended = jaxstep.fit(clean, err.state, itertools.chain(err.batches, rest))
    whole = jaxstep.fit(clean, clean.init(init_params()), batches)
    for a, b in zip(jax.tree.leaves(ended), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(jax.device_get(a), jax.device_get(b))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("leaf", ["['dense1']['kernel']", "['dense2']['bias']"])
def test_a_gradient_fault_on_one_leaf_of_one_device_names_that_device_and_leaf(layout, leaf):
    # dense1.kernel is sharded, dense2.bias (1,) replicated: each path is checked
    dev = jax.devices()[5]
    step = _step(layout, faults=[Fault("grad", dev.id, step=1, leaf=leaf)])
    batches = make_batches(3)
    err = assert_fails(
        lambda: jaxstep.fit(step, step.init(init_params()), batches),
        device_id=dev.id,
        step=1,
        status=Status.GRAD_NONFINITE,
        leaf=leaf,
    )
    assert [f.device_id for f in err.failures] == [dev.id]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_drop_equals_the_replicated_drop(layout):
    # step 1: a NaN input row on device 3 (told by its forward); step 3: a gradient that
    # alone turns infinite on device 6 (its step runs again without it)
    batches = make_batches(5)
    batches[3]["poison"][6 * PER_DEVICE] = 1.0
    faults = [Fault("input", jax.devices()[3].id, step=1)]
    kw = {"on_failure": "drop", "faults": faults}
    step = _step(layout, **kw)
    history = jaxstep.History()
    state = jaxstep.fit(step, step.init(init_params()), batches, history=history)
    assert history.dropped[1] == (3,) and history.dropped[3] == (6,)
    replicated = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), divergence_every=None, **kw)
    reference = jaxstep.fit(replicated, replicated.init(init_params()), batches)
    _close(host_params(step, state), host_params(replicated, reference), 1e-7)


def _tables(layout, batches):
    devices = jax.devices()
    faults = [
        Fault("input", devices[1].id, step=2, example=3, leaf="['x']"),  # micro-batch 1
        Fault("loss", devices[4].id, step=5, value=1e3),  # its gradients overflow
        Fault("param", devices[6].id, step=6, leaf="['dense1']['kernel']"),
    ]
    step = jaxstep.make_train_step(
        loss_fn,
        optax.adam(1e-2),
        shard_state=layout,
        shard_min_size=0,
        divergence_every=None,
        on_failure="skip",
        microbatches=2,
        loss_scale=jaxstep.DynamicLossScale(scale=2.0**127),  # overflows at first
        verify_update=True,
        faults=faults,
    )
    state, tables = step.init(init_params()), []
    for batch in batches:
        state, out = step(state, batch)
        tables.append(step.table(out))
    return host_params(step, state), tables


@pytest.mark.parametrize("layout", LAYOUTS)
def test_micro_batches_loss_scaling_and_verify_update_keep_their_meaning(layout):
    batches = make_batches(7)
    params, tables = _tables(layout, batches)
    want_params, want = _tables(None, batches)
    for got, expected in zip(tables, want, strict=True):
        for column in ("status", "microbatch", "param_leaf", "grad_leaf", "input_leaf"):
            np.testing.assert_array_equal(getattr(got, column), getattr(expected, column))
        assert got.skipped == expected.skipped
    status = [t.status for t in tables]
    assert np.flatnonzero(status[0]).tolist() == [5, 7] and set(status[0][[5, 7]]) == {
        Status.OVERFLOW
    }
    assert np.flatnonzero(status[2]).tolist() == [1] and tables[2].microbatch[1] == 1
    assert status[5][4] == Status.OVERFLOW
    assert np.flatnonzero(status[6]).tolist() == [6] and status[6][6] == Status.PARAM_NONFINITE
    _close(params, want_params, 1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replica_checks_where_a_replica_exists(layout):
    step = _step(layout, divergence_every=2)
    state = step.init(init_params())
    # dense2.bias is replicated under both layouts: a corrupted copy is DIVERGED
    corrupted = corrupt_replica(step, state, jax.devices()[2].id, "['dense2']['bias']")
    _, out = step(corrupted, make_batches(1)[0])
    (failure,) = step.failures(step.table(out))
    assert (failure.device_id, failure.status) == (jax.devices()[2].id, Status.DIVERGED)
    assert failure.leaf == "params['dense2']['bias']"
    # a sharded leaf has one owner: nothing to corrupt, and the kit says so
    name = "['dense1']['kernel']" if layout == "params" else "opt_state[0].mu['dense1']['kernel']"
    with pytest.raises(ValueError, match=r"no replica to corrupt.*The replicated leaves are"):
        corrupt_replica(step, step.init(init_params()), 0, name)


def test_a_gathered_copy_that_differs_on_one_device_is_diverged_under_params(monkeypatch):
    # A bad link or bad memory on device 2: every parameter it gathers arrives one ulp
    # off. The shards agree (each has one owner); only the gathered copies tell, and the
    # device whose copy differs from the majority is named, with the leaf.
    gather = jax.lax.all_gather

    def off_on_device_2(x, axis_name, **kw):
        full = gather(x, axis_name, **kw)
        bad = jax.lax.axis_index(axis_name) == 2
        return jax.numpy.where(bad, jax.numpy.nextafter(full, full + 1), full)

    step = _step("params", divergence_every=1)
    state = step.init(init_params())
    monkeypatch.setattr(jax.lax, "all_gather", off_on_device_2)
    _, out = step(state, make_batches(1)[0])  # traced with the faulty gather
    monkeypatch.undo()
    (failure,) = step.failures(step.table(out))
    assert (failure.device_id, failure.status) == (jax.devices()[2].id, Status.DIVERGED)
    assert failure.leaf.startswith("params['dense1']")
    assert failure.step == 0
