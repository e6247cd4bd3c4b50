"""A run that ends normally leaves its last state on disk (verified), a restarted job
told the run's total (``until_step``) trains only what is left and never overshoots,
and ``jaxstep.save`` writes a state that ``jaxstep.restore`` and ``resume=True`` read."""

import warnings

import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep._src.checkpoint import Store
from jaxstep.testing import corrupt_replica
from tests.models import init_params
from tests.models import loss_fn
from tests.sources import callable_source


def _step(backend):
    return jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend, divergence_every=3)


def _equal(step, a, b):
    for x, y in zip(
        jax.tree.leaves(step.host_state(a)), jax.tree.leaves(step.host_state(b)), strict=True
    ):
        np.testing.assert_array_equal(
            np.asarray(jax.random.key_data(x) if _is_key(x) else x),
            np.asarray(jax.random.key_data(y) if _is_key(y) else y),
        )


def _is_key(x):
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _meta(directory, number):
    store = Store(directory)
    try:
        return store.meta(number)
    finally:
        store.close()


def test_a_run_that_ends_normally_leaves_its_last_state_on_disk(tmp_path, backend):
    step = _step(backend)
    source = callable_source(5)
    state = jaxstep.fit(
        step, step.init(init_params()), source, checkpoint_dir=tmp_path, checkpoint_every=3
    )
    store = Store(tmp_path)
    assert store.steps() == [0, 3, 5]  # the periodic ones, and the last state
    store.close()
    meta = _meta(tmp_path, 5)
    assert meta["verified"] and "at the end of fit" in meta["verified_by"]
    assert meta["data"]["index"] == 5  # every batch pulled was trained
    _equal(step, state, jaxstep.restore(step, tmp_path))
    # nothing is written twice: a last state at a checkpoint step is that checkpoint
    again = jaxstep.fit(step, state, callable_source(6), checkpoint_dir=tmp_path, resume=True)
    assert Store(tmp_path).steps() == [3, 5, 6]  # keep=3
    assert int(step.host_state(again).step) == 6


def test_a_restarted_job_with_until_step_stops_at_the_runs_total(tmp_path, backend):
    step = _step(backend)
    whole = jaxstep.fit(step, step.init(init_params()), callable_source(20), until_step=8)
    assert int(step.host_state(whole).step) == 8

    # the job runs 5 steps, then is restarted (the same command, resume=True)
    first = jaxstep.fit(
        step,
        step.init(init_params()),
        callable_source(20),
        num_steps=5,
        until_step=8,
        checkpoint_dir=tmp_path,
        checkpoint_every=3,
    )
    assert int(step.host_state(first).step) == 5
    command = {"checkpoint_dir": tmp_path, "checkpoint_every": 3, "resume": True}
    resumed = jaxstep.fit(
        step, step.init(init_params()), callable_source(20), until_step=8, **command
    )
    assert int(step.host_state(resumed).step) == 8  # not 13: it trained what was left
    _equal(step, resumed, whole)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a job restarted once more: nothing left, no warning
        done = jaxstep.fit(
            step, step.init(init_params()), callable_source(20), until_step=8, **command
        )
    assert int(step.host_state(done).step) == 8


def test_an_until_step_the_state_is_past_is_told_at_the_users_line(tmp_path):
    step = _step("shard_map")
    command = {"checkpoint_dir": tmp_path, "checkpoint_every": 5}
    ten = jaxstep.fit(step, step.init(init_params()), callable_source(20), num_steps=10, **command)
    said = "fit(until_step=8) starts at step 10, {}, already past the step it should end at: "
    said += (
        "nothing is trained and the state is returned as given. until_step is the step a "
        "run ends at (counted from 0), not a number of steps: to train 8 more steps pass "
        "num_steps=8; to go on past step 10, an until_step above it"
    )
    for keywords, where in [
        ({}, "the state's step"),
        ({"resume": True, **command}, "the step of the checkpoint resume=True restored"),
    ]:
        start = ten if not keywords else step.init(init_params())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            same = jaxstep.fit(step, start, callable_source(20), until_step=8, **keywords)
        assert [str(w.message) for w in caught] == [said.format(where)]
        assert caught[0].filename == __file__  # the user's line
        assert int(step.host_state(same).step) == 10


@pytest.mark.parametrize("value", [-1, "8"])
def test_until_step_must_be_a_step(value):
    step = _step("shard_map")
    error = ValueError if isinstance(value, int) else TypeError
    with pytest.raises(error, match="until_step must be an int >= 0 or None"):
        jaxstep.fit(step, step.init(init_params()), callable_source(2), until_step=value)


@pytest.mark.parametrize("layout", [None, "params"])
def test_save_writes_what_restore_and_resume_read_back(tmp_path, layout):
    kw = {} if layout is None else {"shard_state": layout, "shard_min_size": 0}
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), **kw)
    state = jaxstep.fit(step, step.init(init_params()), callable_source(3))
    where = jaxstep.save(step, state, tmp_path)
    assert where == str(tmp_path / "3")
    meta = _meta(tmp_path, 3)
    assert meta["verified"] and meta["data"] is None  # no data position: saved outside fit
    other = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend="pmap")
    _equal(other, jaxstep.restore(other, tmp_path), other.place_state(step.host_state(state)))
    # resume=True from it with a callable source goes on at batch 3 (its step)
    resumed = jaxstep.fit(
        step, step.init(init_params()), callable_source(5), checkpoint_dir=tmp_path, resume=True
    )
    straight = jaxstep.fit(step, step.init(init_params()), callable_source(5))
    _equal(step, resumed, straight)


@pytest.mark.parametrize("replicas", [1, 2])
def test_save_of_a_state_whose_copies_differ_names_the_devices_and_the_way_out(tmp_path, replicas):
    kw = {} if replicas == 1 else {"shard_state": "params", "shard_min_size": 0}
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), replicas=replicas, **kw)
    state = jaxstep.fit(step, step.init(init_params()), callable_source(3))
    bad = corrupt_replica(step, state, jax.devices()[5].id, "['dense1']['kernel']")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        where = jaxstep.save(step, bad, tmp_path)
    if replicas == 1:
        what = "device 5 holds a copy that a majority of the devices does not"
        fix = (
            "To write one they resume from, save a state whose copies agree, e.g. "
            "jaxstep.replica_state(step, state, 0) (device 0's copy, the majority's)"
        )
    else:  # devices 1 and 5 hold the two copies of a block: no majority
        what = "devices 1 and 5 hold copies that differ, and no majority tells which is right"
        fix = "Go on from the latest verified checkpoint (jaxstep.restore(step, checkpoint_dir))"
    assert [str(w.message) for w in caught] == [
        f"jaxstep.save: the copies of the state differ: {what} (first in "
        f"params['dense1']['kernel']). The checkpoint of step 3 is written to {where} but "
        "marked not verified: jaxstep.restore and fit(..., resume=True) pass over it "
        f"(restore(..., at=3) reads it, with a warning). {fix}"
    ]
    assert caught[0].filename == __file__  # the user's line
    assert not _meta(tmp_path, 3)["verified"]
    if replicas == 1:  # the way out it names writes a verified checkpoint, silently
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jaxstep.save(step, jaxstep.replica_state(step, bad, 0), tmp_path / "again")
        assert _meta(tmp_path / "again", 3)["verified"]


def test_a_position_saved_while_rows_were_carried_resumes_carrying_them():
    """A checkpoint a run wrote after a device left it, at a batch's first row: the
    resume carries rows too (its batches need not divide by the devices left)."""
    from jaxstep._src.checkpoint._position import Cursor
    from jaxstep._src.checkpoint._position import Position
    from jaxstep._src.loop._carry import Carry
    from jaxstep._src.loop._resplit import carry_for
    from jaxstep._src.step import runtime_of

    at = Position(6, "sequence", rows=0, carried=True)
    assert Position.from_json(at.to_json()) == at
    assert Position.from_json({"index": 6, "kind": "sequence"}).carried is False  # older
    seven = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), devices=jax.devices()[:7])
    runtime = runtime_of(seven)
    assert carry_for(runtime, 6, Cursor(0), False) is None
    carry = carry_for(runtime, 6, Cursor(0), False, carried=True)
    assert isinstance(carry, Carry) and (carry.unit, carry.resumed.rows, carry.start) == (7, 0, 6)
