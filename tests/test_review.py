"""Edge cases found in review: resuming with a fresh step, typed keys, iterators,
halting on parameters already non-finite, states that do not fit."""

import itertools
import pickle

import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep.testing import corrupt_replica
from tests.models import host_params
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches
from tests.models import rows_of


def _overflow(**kw):
    def loss(params, batch):
        return (params["w"] * batch["x"]).mean() * 1e10

    step = jaxstep.make_train_step(loss, optax.sgd(1e30), **kw)
    state = step.init({"w": np.ones(3, np.float32)})
    return step, state, [{"x": np.ones((8, 3), np.float32)}] * 12


@pytest.mark.parametrize(
    "policy,every,status,at",
    [
        ("raise", 1, Status.PARAM_NONFINITE, 1),  # the periodic check finds them
        ("raise", 4, Status.LOSS_NONFINITE, 1),  # the loss fails first, because of them
        ("skip", 4, Status.PARAM_NONFINITE, 4),  # skips cannot cure them: halts at the check
    ],
)
def test_committed_nonfinite_parameters_are_never_called_a_good_state(policy, every, status, at):
    step, state, batches = _overflow(divergence_every=every, on_failure=policy)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, batches)
    err = info.value
    assert status in err.status and err.step == at
    assert not err.state_is_good
    assert "NOT a good one" in str(err) and "verify_update=True" in str(err)
    assert "last good state" not in str(err)


def test_errors_with_typed_keys_pickle_and_divergence_recovers(backend):
    def loss(params, batch, rng):
        return loss_fn(params, batch) + 0.0 * jax.random.normal(rng, ())

    step = jaxstep.make_train_step(loss, optax.adam(1e-2), backend=backend, divergence_every=1)
    batches = make_batches(4)
    state = jaxstep.fit(step, step.init(init_params(), rng=jax.random.key(0)), batches[:1])
    state = corrupt_replica(step, state, jax.devices()[2].id, "params['dense1']['bias']")
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, batches[1:], diagnose=True)
    err = info.value
    assert err.status == Status.DIVERGED and err.device_id == jax.devices()[2].id
    assert err.diagnosis.verdict == "device"  # no replay: it would start from a good copy
    back = pickle.loads(pickle.dumps(err))
    assert back.device_id == err.device_id
    key = step.host_state(back.state).rng if backend == "pmap" else back.state.rng
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)


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


def test_num_steps_does_not_swallow_a_batch_of_a_shared_iterator():
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2))
    pulled = []
    source = (pulled.append(i) or b for i, b in enumerate(make_batches(6)))
    state = jaxstep.fit(step, step.init(init_params()), source, num_steps=2)
    state = jaxstep.fit(step, state, source, num_steps=2)
    assert pulled == [0, 1, 2, 3]
    assert int(np.asarray(state.step)) == 4
    assert list(itertools.islice(source, 1))  # batch 4 is still there


def test_a_state_from_a_differently_built_step_is_rejected(backend):
    plain = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    spiky = jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), backend=backend, loss_spike=jaxstep.LossSpike()
    )
    spiky.init(init_params())
    state = plain.init(init_params())
    with pytest.raises(ValueError, match="this state does not fit this step"):
        spiky(state, make_batches(1)[0])
    other = "pmap" if backend == "shard_map" else "shard_map"
    foreign = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=other)
    foreign.init(init_params())
    with pytest.raises(ValueError, match="this state does not fit this step"):
        foreign(state, make_batches(1)[0])
    jax.tree.map(np.asarray, host_params(plain, state))  # still usable


def test_bad_batches_are_rejected_under_step_timeout_and_when_empty():
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2))
    state = step.init(init_params())
    short = {k: v[:30] for k, v in make_batches(1)[0].items()}
    with pytest.raises(ValueError, match="does not divide by the 8 devices"):
        jaxstep.fit(step, state, [short], step_timeout=30.0)
    empty = {k: v[:0] for k, v in make_batches(1)[0].items()}
    with pytest.raises(ValueError, match="0 examples"):
        step(state, empty)
