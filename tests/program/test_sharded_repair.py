"""Under on_failure="drop" a diverged replica is repaired inside the step, once, under
every layout: the repaired copy is what the update starts from (under a sharded layout
the repair happened inside the shard_map while the update ran on the old arrays: the
corrupt copy survived, was "repaired" again at every step, and under "optimizer" the
device owning the bad slice gathered its bits onto every device)."""

import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep.testing import assert_replicas_equal
from jaxstep.testing import corrupt_replica
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

#: a leaf each layout keeps whole on every device (a replica to corrupt)
REPLICATED = {
    None: "params['dense1']['kernel']",
    "optimizer": "params['dense1']['kernel']",  # params stay whole; its slice is device 0's
    "params": "params['dense2']['bias']",  # (1,) divides by no device count
}


def _step(layout):
    kw = {} if layout is None else {"shard_state": layout, "shard_min_size": 0}
    return jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), on_failure="drop", divergence_every=1, **kw
    )


def _host(step, state):
    return jax.tree.map(np.asarray, step.host_state(state))


@pytest.mark.parametrize("layout", [None, "optimizer", "params"])
def test_a_replica_corrupted_between_fit_calls_is_repaired_once_and_the_run_ends_clean(layout):
    batches = make_batches(6)
    clean_step = _step(layout)
    clean = jaxstep.fit(clean_step, clean_step.init(init_params()), batches[:2])
    clean = jaxstep.fit(clean_step, clean, batches[2:])

    step = _step(layout)
    state = jaxstep.fit(step, step.init(init_params()), batches[:2])
    bad = jax.devices()[0]
    state = corrupt_replica(step, state, bad.id, REPLICATED[layout], ulps=1)
    history = jaxstep.History()
    state = jaxstep.fit(step, state, batches[2:], history=history)

    assert history.repaired == [(bad.id,), (), (), ()]  # once, at the first step
    assert_replicas_equal(step, state.params)  # one copy left of every replicated leaf
    host, want = _host(step, state), _host(clean_step, clean)
    for a, b in zip(jax.tree.leaves(host.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    for a, b in zip(jax.tree.leaves(host.opt_state), jax.tree.leaves(want.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    repairs = np.asarray(host.monitor["repairs"])
    assert repairs.tolist() == [1] + [0] * 7  # the repair is in the state's memory
