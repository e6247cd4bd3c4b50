"""Injected faults are pinned exactly, and the replay tells data from device from
one-off."""

import chex
import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep._src.step import runtime_of
from jaxstep.testing import Fault
from tests.models import PER_DEVICE
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches
from tests.models import rows_of


def _fail(backend, faults, batches=None, *, diagnose=True, **kw):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend, faults=faults, **kw)
    batches = make_batches(5) if batches is None else batches
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), batches, diagnose=diagnose)
    return step, info.value, batches


def test_data_fault_follows_the_chunk_and_names_the_example(backend):
    dev = jax.devices()[3]
    fault = Fault("grad", dev.id, step=2, mode="data", leaf="['dense1']['bias']", example=1)
    _, err, _ = _fail(backend, [fault])
    assert (err.device_id, err.step, err.status) == (dev.id, 2, Status.GRAD_NONFINITE)
    assert err.leaf == "['dense1']['bias']"
    assert [f.device_id for f in err.failures] == [dev.id]
    assert err.diagnosis.verdict == "data"
    assert err.diagnosis.examples == (3 * PER_DEVICE + 1,)
    # rotated: device i holds chunk i+1, so chunk 3 ran on device 2
    assert err.diagnosis.replays == ((0, (dev.id,)), (1, (jax.devices()[2].id,)))
    assert "diagnosis: data:" in str(err)
    assert "what to try: the loss was finite but a gradient was not" in str(err)


def test_pre_split_batches_are_replayed_as_the_step_took_them(backend):
    """fit(presplit=True, diagnose=True): the replay takes the failing batch joined, as
    the step did (it was refused as a mistaken pre-split batch)."""
    dev = jax.devices()[3]
    fault = Fault("input", dev.id, step=1, mode="data", example=1)
    split = [
        {k: v.reshape(8, PER_DEVICE, *v.shape[1:]) for k, v in b.items()} for b in make_batches(3)
    ]
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend, faults=[fault])
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), split, presplit=True, diagnose=True)
    err = info.value
    assert (err.device_id, err.step, err.diagnosis.verdict) == (dev.id, 1, "data")
    assert err.diagnosis.examples == (3 * PER_DEVICE + 1,)
    assert err.batches[0] is split[1]  # handed back as given


def test_device_fault_stays_on_the_device(backend):
    dev = jax.devices()[6]
    _, err, _ = _fail(backend, [Fault("loss", dev.id, step=1, mode="device")])
    assert (err.device_id, err.step) == (dev.id, 1)
    assert err.status == Status.LOSS_NONFINITE | Status.GRAD_NONFINITE
    assert len(err.failures) == 1
    assert err.diagnosis.verdict == "device"
    assert err.diagnosis.replays == ((0, (dev.id,)), (1, (dev.id,)))
    assert err.diagnosis.examples == ()
    # what to try points at the chip, not at log/sqrt in loss_fn
    assert "what to try: the failure stayed on this device" in str(err)
    assert "look for log, sqrt" not in str(err)


def test_transient_fault_does_not_come_back(backend):
    dev = jax.devices()[0]
    _, err, _ = _fail(
        backend, [Fault("input", dev.id, step=3, mode="transient", value=np.inf, leaf="['x']")]
    )
    assert (err.device_id, err.step) == (dev.id, 3)
    assert Status.INPUT_NONFINITE in err.status
    assert err.leaf == "['x']"
    assert err.diagnosis.verdict == "transient"
    assert err.diagnosis.replays == ((0, ()),)
    assert "what to try: the step passed when run again" in str(err)
    assert "check the data pipeline" not in str(err)


def test_real_nan_in_the_data_is_diagnosed_as_data(backend):
    batches = make_batches(4)
    bad_row = rows_of(5).start + 2
    batches[2]["y"][bad_row, 0] = np.nan
    _, err, _ = _fail(backend, [], batches)
    assert err.device_id == jax.devices()[5].id and err.step == 2
    assert err.leaf == "['y']"
    assert err.diagnosis.verdict == "data"
    assert err.diagnosis.examples == (bad_row,)


def test_diagnose_on_its_own_leaves_the_state_alone(backend):
    dev = jax.devices()[4]
    step, err, batches = _fail(
        backend, [Fault("grad", dev.id, step=1, mode="data", example=3)], diagnose=False
    )
    assert err.diagnosis is None
    before = jax.tree.map(np.asarray, step.host_state(err.state).params)
    result = jaxstep.diagnose(step, err, batches[1])
    assert result.verdict == "data" and result.examples == (4 * PER_DEVICE + 3,)
    after = jax.tree.map(np.asarray, step.host_state(err.state).params)
    chex.assert_trees_all_equal(before, after)
    assert err.leaf == "['dense1']['bias']"  # the first leaf (pytree order) by default


def test_param_fault_is_pinned_on_its_device(backend):
    dev = jax.devices()[2]
    fault = Fault("param", dev.id, step=1, leaf="['dense2']['bias']")
    _, err, _ = _fail(backend, [fault], verify_update=True)
    assert (err.device_id, err.step, err.status) == (dev.id, 1, Status.PARAM_NONFINITE)
    assert err.leaf == "['dense2']['bias']"
    assert [f.device_id for f in err.failures] == [dev.id]
    assert err.diagnosis.verdict == "device"


def test_fault_validation():
    with pytest.raises(ValueError, match="unknown fault kind 'disk'"):
        Fault("disk", 0, 1)
    with pytest.raises(ValueError, match="unknown fault mode"):
        Fault("grad", 0, 1, mode="sometimes")
    with pytest.raises(ValueError, match="NaN or Inf"):
        Fault("grad", 0, 1, value=1.0)
    with pytest.raises(ValueError, match="verify_update=True"):
        jaxstep.make_train_step(loss_fn, optax.sgd(0.1), faults=[Fault("param", 0, 1)])
    far = jaxstep.make_train_step(
        loss_fn, optax.sgd(0.1), faults=[Fault("grad", 0, 1, mode="data", example=9)]
    )
    with pytest.raises(ValueError, match=r"example 9, but each device's chunk has 4 rows"):
        far(far.init(init_params()), make_batches(1)[0])
    with pytest.raises(ValueError, match="not among the step's devices"):
        jaxstep.make_train_step(loss_fn, optax.sgd(0.1), faults=[Fault("grad", 999, 1)])
    step = jaxstep.make_train_step(
        loss_fn, optax.sgd(0.1), faults=[Fault("grad", 0, 1, leaf="['nope']")]
    )
    # refused at init, before anything runs, listing the leaves there are
    with pytest.raises(ValueError, match=r"names leaf \"\['nope'\]\", which does not exist"):
        step.init(init_params())


def test_faults_injected_nowhere_cost_nothing_in_the_program():
    batch = make_batches(1)[0]
    plain = jaxstep.make_train_step(loss_fn, optax.adam(1e-2))
    state = plain.init(init_params())
    lowered = plain.lower(state, batch)
    assert "callback" not in lowered.as_text()
    # no extra inputs either: the state, the batch and the chunk each device holds
    # (one int: a replay that moves the chunks moves their random keys with them)
    assert lowered.in_tree.num_leaves == len(jax.tree.leaves(state)) + len(batch) + 1
    faulty = jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), faults=[Fault("grad", 0, step=10**6, mode="transient")]
    )
    state = faulty.init(init_params())
    assert faulty.lower(state, batch).in_tree.num_leaves == len(jax.tree.leaves(state)) + 6


LEAVES = [
    "['dense1']['bias']",
    "['dense1']['kernel']",
    "['dense2']['bias']",
    "['dense2']['kernel']",
]


def test_diagnosis_lists_the_one_gradient_leaf_a_nan_reached(backend):
    batches = make_batches(4)
    batches[1]["poison"][rows_of(2)] = 1.0  # an inf in dense2.kernel's gradient only
    _, err, _ = _fail(backend, (), batches)
    dev = jax.devices()[2]
    assert (err.device_id, err.step, err.status) == (dev.id, 1, Status.GRAD_NONFINITE)
    assert [f.device_id for f in err.failures] == [dev.id]
    assert err.leaf == "['dense2']['kernel']"
    assert err.diagnosis.verdict == "data"
    assert err.diagnosis.grad_leaves == ("['dense2']['kernel']",)
    assert (
        f"on replay 1 of 4 gradient leaves are non-finite on device {dev.id} "
        "(['dense2']['kernel']); the other 3 stay finite" in str(err)
    )


def _sqrt_at_zero(params, batch):
    """A finite loss whose backward pass makes a NaN at the output on the rows with
    pos == 0 (d sqrt(u) at u = 0 is inf, times 0): every gradient leaf is NaN."""
    h = jax.numpy.tanh(batch["x"] @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    pred = h @ params["dense2"]["kernel"] + params["dense2"]["bias"]
    fit_term = jax.numpy.mean((pred - batch["y"]) ** 2)
    return fit_term + jax.numpy.mean(jax.numpy.sqrt(pred**2 * batch["pos"]))


def test_a_nan_born_at_the_output_is_shown_to_reach_every_gradient_leaf(backend):
    step = jaxstep.make_train_step(_sqrt_at_zero, optax.adam(1e-2), backend=backend)
    batches = make_batches(4)
    batches[2]["pos"][rows_of(5)] = 0.0  # finite input, finite loss
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), batches, diagnose=True)
    err, dev = info.value, jax.devices()[5]
    assert (err.device_id, err.step, err.status) == (dev.id, 2, Status.GRAD_NONFINITE)
    assert [f.device_id for f in err.failures] == [dev.id]
    assert err.leaf == LEAVES[0]  # the first in tree order, not where it arose
    assert "the leaf named is the first non-finite one in the parameters' tree order" in str(err)
    assert err.diagnosis.verdict == "data"
    assert err.diagnosis.grad_leaves == tuple(LEAVES)
    assert f"on replay every gradient leaf is non-finite on device {dev.id} (4 of 4)" in str(err)


def test_diagnosis_of_an_injected_gradient_fault_names_its_leaf(backend):
    dev = jax.devices()[6]
    fault = Fault("grad", dev.id, step=1, mode="device", leaf="['dense1']['kernel']")
    _, err, _ = _fail(backend, [fault])
    assert err.diagnosis.verdict == "device"
    assert err.diagnosis.grad_leaves == ("['dense1']['kernel']",)


def test_a_replay_order_moves_the_chunks_as_the_rotation_does_and_is_checked(backend):
    dev = jax.devices()[3]
    fault = Fault("input", dev.id, step=1, mode="data")
    step, err, batches = _fail(backend, [fault], diagnose=False)
    order = jaxstep.distributed.local_rotation(step.devices, 1)
    assert order.tolist() == [1, 2, 3, 4, 5, 6, 7, 0]  # one process: (i + 1) % n
    tables = [
        step.table(runtime_of(step).replay(err.state, batches[1], **how))
        for how in ({"rotation": 1}, {"order": order}, {"order": [0, 1, 2, 4, 3, 5, 6, 7]})
    ]
    np.testing.assert_array_equal(tables[0].status, tables[1].status)
    assert np.flatnonzero(tables[0].status).tolist() == [2]  # chunk 3 now on device 2
    assert np.flatnonzero(tables[2].status).tolist() == [4]  # chunks 3 and 4 swapped
    with pytest.raises(ValueError, match="must be a permutation of the 8 device positions"):
        runtime_of(step).replay(err.state, batches[1], order=[0, 0, 1, 2, 3, 4, 5, 6])
