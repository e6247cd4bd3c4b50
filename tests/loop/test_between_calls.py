"""A replica corrupted between two fit calls (issue 45 item 6, docs/recovery.md):
rolled back to the checkpoint the first call saved its end to, whatever
``rollback_batches`` (the failing step's own batch is all a rollback to it trains
again), and repaired from the majority when the first call saved nothing. Both lose
nothing: the run ends bit for bit as one never corrupted, the healthy seven not blamed."""

import chex
import jax
import optax
import pytest

import jaxstep
from jaxstep.testing import corrupt_replica
from tests.models import host_params
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

LEAF = "params['dense2']['kernel']"


def _step(backend):
    return jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend, divergence_every=1)


@pytest.mark.parametrize("rollback_batches", [None, 2])
@pytest.mark.parametrize("saved", [False, True])
def test_a_replica_corrupted_between_calls_is_rolled_back_when_saved_else_repaired(
    backend, tmp_path, saved, rollback_batches
):
    batches = make_batches(6)
    clean_step = _step(backend)
    clean = jaxstep.fit(clean_step, clean_step.init(init_params()), batches)
    step = _step(backend)
    checkpoints = {"checkpoint_dir": tmp_path, "checkpoint_every": 2}
    state = jaxstep.fit(
        step, step.init(init_params()), batches[:3], **(checkpoints if saved else {})
    )
    bad = jax.devices()[6]
    state = corrupt_replica(step, state, bad.id, LEAF, ulps=1)
    history = jaxstep.History()
    recover = jaxstep.Recover(rollback_batches=rollback_batches)
    state = jaxstep.fit(step, state, batches[3:], history=history, recover=recover, **checkpoints)
    (record,) = history.recoveries
    action = "rolled back" if saved else "repaired"
    assert (record.step, record.verdict, record.action) == (3, "diverged", action)
    assert record.device_ids == (bad.id,)  # the healthy seven are not blamed
    if saved:
        assert record.detail == (
            "restored the checkpoint of step 3; 1 batch(es) since it trained again"
        )
    assert history.step == [3, 3, 4, 5]
    jaxstep.testing.assert_replicas_equal(step, state)
    chex.assert_trees_all_equal(host_params(step, state), host_params(clean_step, clean))
