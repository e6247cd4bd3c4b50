"""Two copies that differ with no majority to tell which is bad (issue 45 items 2, 3
and 6): the twins of ``replicas=2`` (``shard_map``: ``replicas`` needs ``shard_state``)
and the two replicas of a step on two devices (both backends). The error names both
devices, claims no majority, does not call its state good and points to the last
verified checkpoint; ``fit(recover=jaxstep.Recover())`` goes back to it whenever
nothing is lost, and says how many batches would be otherwise."""

import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep._src.step import Runtime
from jaxstep.testing import assert_fails
from jaxstep.testing import corrupt_replica
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

MOMENT = "opt_state[0].mu['dense1']['kernel']"  # sharded: one twin under replicas=2
KERNEL = "params['dense1']['kernel']"  # whole on every device of a replicated step

#: (name, step options, the device corrupted, the pair that differs, the leaf)
PAIRS = {
    "twins-optimizer": (
        {"shard_state": "optimizer", "replicas": 2, "shard_min_size": 0},
        5,
        [1, 5],
        MOMENT,
    ),
    "twins-params": (
        {"shard_state": "params", "replicas": 2, "shard_min_size": 0},
        5,
        [1, 5],
        MOMENT,
    ),
    "two-shard_map": ({"backend": "shard_map", "devices": 2}, 1, [0, 1], KERNEL),
    "two-pmap": ({"backend": "pmap", "devices": 2}, 1, [0, 1], KERNEL),
}


def _step(options, **kw):
    options = dict(options)
    if "devices" in options:
        options["devices"] = jax.devices()[: options["devices"]]
    return jaxstep.make_train_step(loss_fn, optax.adam(1e-2), divergence_every=1, **options, **kw)


def _host(step, state):
    host = step.host_state(state)
    return [np.asarray(x) for x in jax.tree.leaves((host.params, host.opt_state))]


@pytest.mark.parametrize("case", list(PAIRS))
def test_a_pair_that_differs_names_both_claims_no_majority_and_no_good_state(case):
    options, bad, pair, leaf = PAIRS[case]
    step = _step(options)
    state = jaxstep.fit(step, step.init(init_params()), make_batches(1))
    corrupted = corrupt_replica(step, state, bad, leaf)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, corrupted, make_batches(2))
    err = assert_fails(info, device_id=pair, step=1, status=Status.DIVERGED, leaf=leaf)
    assert sorted(f.device_id for f in err.failures) == pair  # no healthy device blamed
    assert sorted(f.device_id for f in err.root_causes) == pair
    assert err.state_is_good is False
    text = str(err)
    headline = text.splitlines()[0]
    assert "majority" in headline and "diverged from the majority" not in text
    a, b = err.failures
    assert f"differs from its twin's on device {b.device_id}" in a.reason
    assert f"differs from its twin's on device {a.device_id}" in b.reason
    assert "no majority: either may be bad" in headline
    assert f"devices {pair[0]} and {pair[1]} hold the two copies" in text
    assert "no majority can tell which one is right" in text
    assert "the last good state" not in text and "NOT a good one" in text
    assert "latest verified checkpoint" in text
    assert "loses none" not in text  # error.batches are not to be trained on error.state
    # what the old message advised: resuming from error.state fails again at once
    with pytest.raises(jaxstep.TrainingWorkerError) as again:
        jaxstep.fit(step, err.state, make_batches(1))
    assert_fails(again, device_id=pair, step=1, status=Status.DIVERGED)


@pytest.mark.parametrize("case", ["twins-params", "two-pmap"])
def test_the_diagnosis_of_a_pair_that_differs_claims_no_majority(case):
    options, bad, pair, leaf = PAIRS[case]
    step = _step(options)
    state = jaxstep.fit(step, step.init(init_params()), make_batches(1))
    corrupted = corrupt_replica(step, state, bad, leaf)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, corrupted, make_batches(2), diagnose=True)
    err = assert_fails(info, device_id=pair, step=1, status=Status.DIVERGED, leaf=leaf)
    assert err.diagnosis.verdict == "diverged"
    said = str(err.diagnosis)
    assert f"devices {pair[0]} and {pair[1]}: their copies of the state differ" in said
    assert "majority's" not in said and "healthy copy" not in said
    assert "with no majority none can be trusted" in str(err)  # the hint stays


def _runs(options, tmp_path, recover, corrupt):
    """A first fit call saving its end (step 2, verified), the pair corrupted (or
    not) between the calls, and a second call under ``recover``."""
    batches = make_batches(4)
    _, bad, _, leaf = options
    saving = {"checkpoint_dir": tmp_path / str(corrupt), "checkpoint_every": 2}
    step = _step(options[0])
    state = jaxstep.fit(step, step.init(init_params()), batches[:2], **saving)
    if corrupt:
        state = corrupt_replica(step, state, bad, leaf)
    history = jaxstep.History()
    state = jaxstep.fit(step, state, batches[2:], history=history, recover=recover, **saving)
    return step, state, history


@pytest.mark.parametrize("rollback_batches", [None, 1])
@pytest.mark.parametrize("case", list(PAIRS))
def test_recover_rolls_a_pair_corrupted_between_calls_back_to_the_calls_checkpoint(
    case, rollback_batches, tmp_path
):
    recover = jaxstep.Recover(rollback_batches=rollback_batches)
    step, state, history = _runs(PAIRS[case], tmp_path, recover, corrupt=True)
    (record,) = history.recoveries
    assert (record.step, record.verdict, record.action) == (2, "diverged", "rolled back")
    assert sorted(record.device_ids) == PAIRS[case][2]
    assert record.detail == "restored the checkpoint of step 2; 1 batch(es) since it trained again"
    assert history.step == [2, 2, 3]
    clean_step, clean, _ = _runs(PAIRS[case], tmp_path, recover, corrupt=False)
    for x, y in zip(_host(step, state), _host(clean_step, clean), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("case", ["twins-params", "two-pmap"])
def test_a_rollback_that_would_lose_batches_says_how_many_and_how_to_keep_them(
    case, tmp_path, monkeypatch
):
    """Corrupted inside the call, before step 3: the checkpoint is step 2's, and
    without rollback_batches the batch of step 2 is not held."""
    options, bad, pair, leaf = PAIRS[case]
    step = _step(options)
    dispatch, corrupted = Runtime.dispatch, []

    def corrupting(runtime, state, batch, **kw):  # once, before step 3 is dispatched
        number, halted = runtime.read_first((state.step, state.halted))
        if not corrupted and int(number) == 3 and not bool(halted):
            corrupted.append(3)
            state = corrupt_replica(step, state, bad, leaf)
        return dispatch(runtime, state, batch, **kw)

    monkeypatch.setattr(Runtime, "dispatch", corrupting)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(
            step,
            step.init(init_params()),
            make_batches(5),
            recover=jaxstep.Recover(),
            checkpoint_dir=tmp_path,
            checkpoint_every=2,
        )
    assert corrupted == [3]
    err = assert_fails(info, device_id=pair, step=3, status=Status.DIVERGED, leaf=leaf)
    assert err.state_is_good is False
    text = str(err)
    assert (
        "not recovered: going back to the checkpoint of step 2 would lose 1 batch(es) "
        "(of step 2), not held: Recover(rollback_batches=1) holds them" in text
    )
