"""A shard_state whose rule shards no leaf (every leaf under shard_min_size: the sst2
and small lm1b configs) says so once, naming shard_min_size and the largest leaf, and
runs the replicated program: bit for bit the step without shard_state (it was 3e-8
off, at 0.95-1.02x the memory)."""

import warnings

import jax
import numpy as np
import optax
import pytest

import jaxstep
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches


@pytest.mark.parametrize("layout", ["optimizer", "params"])
def test_a_rule_that_shards_nothing_says_so_once_and_runs_the_replicated_program(layout):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), shard_state=layout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = step.init(init_params())
        step.init(init_params())  # once per step
    told = [str(w.message) for w in caught if "shards no leaf" in str(w.message)]
    assert len(told) == 1, [str(w.message) for w in caught]
    assert "shard_min_size=65536" in told[0]
    assert "params['dense1']['kernel'], has 24 elements" in told[0] or "has 24 elements" in told[0]
    assert [w.filename for w in caught if "shards no leaf" in str(w.message)] == [__file__]
    state = jaxstep.fit(step, state, make_batches(4))
    plain = jaxstep.make_train_step(loss_fn, optax.adam(1e-2))
    want = jaxstep.fit(plain, plain.init(init_params()), make_batches(4))
    for a, b in zip(
        jax.tree.leaves(step.host_state(state)),
        jax.tree.leaves(plain.host_state(want)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_hybrid_rule_that_shards_nothing_names_a_groups_devices_not_all_of_them():
    told = {}
    for replicas in (2, 8):
        step = jaxstep.make_train_step(
            loss_fn, optax.adam(1e-2), shard_state="params", replicas=replicas
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step.init(init_params())
        told[replicas] = [str(w.message) for w in caught]
    assert told[2] == [
        "shard_state='params' shards no leaf of this state: each is under "
        "shard_min_size=65536 elements or has no axis that divides by a group's 4 devices "
        "(the largest, params['dense1']['kernel'], has 24 elements). The state stays whole "
        "on every device and the step runs the replicated program. To shard the larger "
        "leaves, lower shard_min_size (e.g. make_train_step(..., shard_min_size=12)); or "
        "leave shard_state out"
    ]
    # A group of one device: every axis divides by 1, and no shard_min_size would help.
    assert told[8] == [
        "shard_state='params' with replicas=8 shards no leaf: each of the 8 groups is 1 "
        "device, which holds the whole state (a group splits the state over its devices). "
        "The state stays whole on every device and the step runs the replicated program. "
        "To shard it, pass a replicas that leaves 2 or more devices in a group (e.g. "
        "replicas=4: groups of 2), or leave shard_state and replicas out"
    ]
