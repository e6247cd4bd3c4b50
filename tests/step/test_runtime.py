"""One owner for a step's runtime: a TrainStep is a face over its Runtime, nothing
outside their two modules touches their insides (counted during a run that uses every
part of fit), leaving a device out builds a new runtime, the names the step answered to
before point to their replacements, and a batch reaches the devices as jax.device_put
would place it, by a plan made once per layout."""

import collections
import sys
import warnings

import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep._src.step import Runtime
from jaxstep._src.step import TrainStep
from jaxstep._src.step import runtime_of
from jaxstep.testing import Fault
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

OWNERS = {TrainStep: "step/_train_step.py", Runtime: "step/_runtime.py"}


@pytest.fixture
def private_accesses(monkeypatch):
    """Every read or write of a private attribute of a TrainStep or a Runtime, by the
    file of the code that made it, outside the class's own module."""
    found: collections.Counter = collections.Counter()
    for cls, owner in OWNERS.items():
        get, put = cls.__getattribute__, cls.__setattr__

        def watched_get(self, name, get=get, owner=owner, cls=cls):
            if name.startswith("_") and not name.startswith("__"):
                where = sys._getframe(1).f_code.co_filename
                if not where.endswith(owner):
                    found[(cls.__name__, where, name)] += 1
            return get(self, name)

        def watched_set(self, name, value, put=put, owner=owner, cls=cls):
            if name.startswith("_") and not name.startswith("__"):
                where = sys._getframe(1).f_code.co_filename
                if not where.endswith(owner):
                    found[(cls.__name__, where, name)] += 1
            put(self, name, value)

        monkeypatch.setattr(cls, "__getattribute__", watched_get)
        monkeypatch.setattr(cls, "__setattr__", watched_set)
    return found


def test_no_code_outside_the_owners_touches_a_steps_or_runtimes_insides(tmp_path, private_accesses):
    """A run with checkpoints and prefetch under recover (a quarantine and an
    exclusion), then drop, the automatic replay, host_state/place_state and the
    testing kit: 0 private accesses from outside step/_train_step.py and
    step/_runtime.py (the same count found 194 from step/driving.py before)."""
    devices = jax.devices()
    faults = [
        Fault("input", devices[2].id, step=3, mode="data"),
        Fault("grad", devices[5].id, step=6, mode="device"),
    ]
    step = jaxstep.make_train_step(loss_fn, optax.sgd(0.1), faults=faults, divergence_every=2)
    history = jaxstep.History()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = jaxstep.fit(
            step,
            step.init(init_params()),
            make_batches(9),
            checkpoint_dir=tmp_path,
            checkpoint_every=2,
            recover=jaxstep.Recover(),
            history=history,
        )
    assert [(r.verdict, r.action) for r in history.recoveries] == [
        ("data", "quarantined"),
        ("device", "excluded"),
    ]
    assert len(step.devices) == 7  # the loop adopted the recovery's runtime
    drop = jaxstep.make_train_step(
        loss_fn, optax.sgd(0.1), on_failure="drop", faults=[Fault("loss", devices[1].id, 1)]
    )
    jaxstep.fit(drop, drop.init(init_params()), make_batches(3))
    replayed = jaxstep.make_train_step(
        loss_fn, optax.sgd(0.1), faults=[Fault("input", devices[3].id, 1, mode="data")]
    )
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(replayed, replayed.init(init_params()), make_batches(3), diagnose=True)
    assert info.value.diagnosis.verdict == "data"
    moved = step.place_state(replayed.host_state(info.value.state))
    jaxstep.testing.assert_replicas_equal(step, moved)
    jaxstep.testing.corrupt_replica(step, moved, devices[3].id, "['dense1']['kernel']")
    jaxstep.restore(step, tmp_path)
    assert int(step.host_state(state).step) == 9
    assert not private_accesses, dict(private_accesses)


def test_leaving_a_device_out_builds_a_new_runtime_and_leaves_the_old_one_as_it_was(backend):
    step = jaxstep.make_train_step(loss_fn, optax.sgd(0.1), backend=backend)
    state = step.init(init_params())
    before = runtime_of(step)
    state, _ = step(state, make_batches(1)[0])
    rows = {k: v[:28] for k, v in make_batches(1)[0].items()}  # 7 devices x 4 rows
    smaller = step.exclude_devices([jax.devices()[7].id], state)
    after = runtime_of(step)
    assert after is not before and len(before.devices) == 8 and len(after.devices) == 7
    assert after.origin == before.devices  # the devices the step was built with
    smaller, out = step(smaller, rows)
    assert int(step.table(out).step) == 1 and not step.table(out).failed
    runtime, again = before.without([jax.devices()[6].id], state)  # the old one still works
    assert [d.id for d in runtime.devices] == [d.id for d in jax.devices()[:6]] + [7]
    assert int(runtime.read_first(again.step)) == 1
    assert runtime_of(step) is after  # and building one changed nothing of the step


@pytest.mark.parametrize("name", ["backend", "stacked", "first_copy", "local_copy"])
def test_a_name_removed_from_the_face_says_where_it_went(backend, name):
    step = jaxstep.make_train_step(loss_fn, optax.sgd(0.1), backend=backend)
    state = step.init(init_params())
    with pytest.warns(DeprecationWarning, match=rf"step\.{name} was removed .* use step\."):
        moved = getattr(step, name)
    if name == "backend":
        assert moved == backend
    elif name == "stacked":
        assert moved is (backend == "pmap")
    elif name == "first_copy":
        assert int(moved(state.step)) == 0
    else:
        np.testing.assert_array_equal(
            moved(state.params, 3)["dense1"]["kernel"], init_params()["dense1"]["kernel"]
        )
    with pytest.raises(AttributeError, match="'TrainStep' object has no attribute 'nope'"):
        step.nope  # noqa: B018


def test_compile_replicas_is_check_replicas_with_a_warning_and_the_same_program(backend):
    """``replicas`` is make_train_step's number of groups; the replica-check variant's
    keyword is ``check_replicas`` (one word, one meaning), the old one kept a release."""
    step = jaxstep.make_train_step(loss_fn, optax.sgd(0.1), backend=backend)
    state = step.init(init_params())
    batch = make_batches(1)[0]
    checked = step.compile(state, batch, check_replicas=True)
    with pytest.warns(DeprecationWarning, match=r"step\.compile\(check_replicas=\.\.\.\)"):
        old = step.compile(state, batch, replicas=True)
    assert old is checked  # the cached program of the same variant
    assert step.compile(state, batch) is not checked
    with pytest.raises(TypeError, match=r"unexpected keywords \['beat'\]"):
        step.compile(state, batch, beat=True)


@pytest.mark.parametrize(
    "dtype", [np.float32, np.int32, np.float64, np.int64, np.bool_], ids=lambda d: d.__name__
)
def test_a_host_batch_lands_as_jax_device_put_places_it(backend, dtype):
    """The placement plan (one batched transfer a leaf) against jax.device_put: the same
    values, sharding and dtype on every device; a dtype that changes on the way
    (float64 without x64) goes through jax.device_put itself."""
    step = jaxstep.make_train_step(loss_fn, optax.sgd(0.1), backend=backend)
    runtime = runtime_of(step)
    x = (np.arange(64 * 3).reshape(64, 3) % 7).astype(dtype)
    placed = runtime.backend.place_batch({"x": x})["x"]
    reference = jax.device_put(x, runtime.backend.placement.split)
    assert placed.sharding == reference.sharding and placed.dtype == reference.dtype
    assert placed.shape == (64, 3) and placed.committed
    for a, b in zip(placed.addressable_shards, reference.addressable_shards, strict=True):
        assert a.device == b.device and a.index == b.index
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    # the step trains on it exactly as on the batch jax.device_put placed
    assert runtime.backend.place_batch({"x": reference})["x"] is reference
