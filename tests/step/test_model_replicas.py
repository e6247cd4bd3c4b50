"""Replica groups over model groups (``make_train_step(model_parallel=2, replicas=2,
shard_state=...)``, issue 46): the mesh ``(replicas, data, model)`` over the devices in
order, model fastest. Eight devices make four model groups of two, and two replica
groups of two model groups: a sharded leaf is split over the model groups of a
replica group (and over the model axis where the model rule says), whole in each
replica group, so every block has one twin: the model group at the same place in the
other replica group (devices 0, 1 and 4, 5; 2, 3 and 6, 7)."""

import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxstep
from jaxstep import Status
from jaxstep.testing import Fault
from jaxstep.testing import assert_fails
from jaxstep.testing import corrupt_replica
from tests.step.test_model_parallel import WIDE
from tests.step.test_model_parallel import _host
from tests.step.test_model_parallel import _wide
from tests.step.test_model_parallel import _wide_batches
from tests.step.test_model_parallel import _wide_loss
from tests.step.test_model_parallel import _wide_step

D, M = "fsdp", jaxstep.MODEL_AXIS  # the state mesh's axis inside a replica group, the model's


def _step(layout, **kw):
    return _wide_step(layout, replicas=2, **kw)


@pytest.mark.parametrize("layout", ["optimizer", "params"])
def test_each_leaf_splits_over_both_axes_whole_in_each_replica_group(layout):
    """Ten steps equal the replicated step's within 1e-5, the layout kept at each."""
    batches = _wide_batches(10)
    plain = jaxstep.make_train_step(_wide_loss, optax.adam(1e-2), divergence_every=None)
    want = plain.host_state(jaxstep.fit(plain, plain.init(_wide()), batches)).params
    step = _step(layout, divergence_every=2)
    state = step.init(_wide())
    for _ in range(2):
        mu = state.opt_state[0].mu
        assert mu["w1"].sharding.mesh.axis_names == ("data", D, M)
        assert (mu["w1"].sharding.spec, mu["w2"].sharding.spec) == (P(D, M), P(M, D))
        # a block a device: w1 (16, 32) halved over a replica group's 2 model groups,
        # its columns halved over each group's 2 devices; device 4 holds device 0's
        blocks = {s.device.id: s for s in mu["w1"].addressable_shards}
        assert blocks[0].data.shape == (8, 16) and blocks[0].index == blocks[4].index
        assert blocks[2].index != blocks[0].index
        params = state.params["w1"].sharding.spec
        assert params == (P(D, M) if layout == "params" else P(None, M))
        state, _ = step(state, batches[0])
    state = jaxstep.fit(step, step.init(_wide()), batches)
    got = step.host_state(state).params
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["optimizer", "params"])
def test_a_gradient_fault_names_its_model_group_and_no_other(layout):
    step = _step(layout, faults=[Fault("grad", device_id=5, step=2, leaf="['w2']")])
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(_wide()), _wide_batches(4), diagnose=False)
    err = assert_fails(info, device_id=4, step=2, status=Status.GRAD_NONFINITE, leaf="['w2']")
    assert err.group == (4, 5) and [f.group for f in err.failures] == [(4, 5)]
    assert int(err.state.step) == 2
    assert err.state.opt_state[0].mu["w1"].sharding.spec == P(D, M)


def test_diagnosis_names_the_chip_a_fault_follows():
    step = _step("params", faults=[Fault("grad", device_id=3, step=1, mode="device")])
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(_wide()), _wide_batches(3), diagnose=True)
    err = info.value
    assert err.group == (2, 3) and err.diagnosis.verdict == "device"
    assert err.diagnosis.chip == 3 and "it follows device 3" in str(err.diagnosis)


@pytest.mark.parametrize(
    ("layout", "leaf", "named"),
    [
        # a block of both axes: its twin is model group 0, 1, and with two a pair of
        # twins that differ has no majority: both are named
        ("params", "params['w1']", [(0, 1), (4, 5)]),
        # device 5's copy of a block the model axis does not split (b2 over the data
        # axis): the group's copies are every device's, read before the body
        ("params", "params['b2']", [(0, 1), (4, 5)]),
        ("optimizer", "opt_state[0].mu['w2']", [(0, 1), (4, 5)]),
        # ZeRO-1's parameters are whole over the data axis: four copies, one odd
        ("optimizer", "params['w1']", [(4, 5)]),
        ("optimizer", "params['b2']", [(4, 5)]),
    ],
)
def test_a_corrupted_device_is_named_by_its_group_among_its_twins(layout, leaf, named):
    step = _step(layout, divergence_every=2)
    batches = _wide_batches(4)
    state, _ = step(step.init(_wide()), batches[0])
    state, _ = step(state, batches[1])  # step 2 checks the copies
    bad = corrupt_replica(step, state, 5, leaf)
    from jaxstep._src.step import runtime_of

    # the check a checkpoint's save runs sees it too
    index = step.names["state"].index(leaf)
    groups = [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert runtime_of(step).differing(bad) == {groups.index(g): index for g in named}
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, bad, batches[2:])
    firsts = [g[0] for g in named]  # every group named, and no other
    err = assert_fails(info, device_id=firsts, step=2, status=Status.DIVERGED)
    assert [f.group for f in err.failures] == named and err.leaf == leaf


def test_recover_excludes_the_whole_replica_group_and_goes_on_as_a_clean_run():
    """A device fault on device 3: its model group goes, and with it its replica group
    (devices 0-3: a replica group holds one whole copy of the sharded state). The run
    goes on on devices 4-7, the state split over both axes as before, and ends where a
    clean run moved onto them after step 2 does, bit for bit."""
    batches = _wide_batches(6)
    step = _step("params", faults=[Fault("grad", device_id=3, step=2, mode="device")])
    history = jaxstep.History()
    with pytest.warns(UserWarning, match=r"devices 0, 1, 2, 3\): a group holds one whole copy"):
        state = jaxstep.fit(
            step, step.init(_wide()), batches, recover=jaxstep.Recover(), history=history
        )
    [record] = history.recoveries
    assert (record.step, record.verdict, record.action) == (2, "device", "excluded")
    assert record.detail.startswith("model group(s) of devices 0, 1, 2, 3 excluded")
    assert [tuple(d.id for d in g) for g in step.options.groups] == [(4, 5), (6, 7)]
    assert state.params["w1"].sharding.spec == P("devices", M)
    assert {d.id for d in state.params["w1"].sharding.device_set} == {4, 5, 6, 7}
    clean = _step("params")
    first = jaxstep.fit(clean, clean.init(_wide()), batches[:2])
    with pytest.warns(UserWarning, match="leaves with its group"):
        smaller, moved = clean.without_devices([2], first)
    want = jaxstep.fit(smaller, moved, batches[2:])
    for x, y in zip(_host(step, state), _host(smaller, want), strict=True):
        np.testing.assert_array_equal(x, y)


def test_drop_leaves_a_failing_groups_chunk_out_of_the_mean():
    fault = Fault("loss", device_id=7, step=1, mode="transient")
    step = _step("params", on_failure="drop", faults=[fault])
    history = jaxstep.History()
    state = jaxstep.fit(step, step.init(_wide()), _wide_batches(4), history=history)
    assert int(state.step) == 4 and history.dropped == [(), (6,), (), ()]


def test_a_checkpoint_restores_bitwise_onto_either_axis_alone_and_back(tmp_path):
    step = _step("params", divergence_every=None)
    state = jaxstep.fit(step, step.init(_wide()), _wide_batches(2))
    jaxstep.save(step, state, tmp_path / "both")
    want = _host(step, state)
    others = (
        jaxstep.make_train_step(_wide_loss, optax.adam(1e-2)),
        _wide_step("params"),
        jaxstep.make_train_step(
            _wide_loss, optax.adam(1e-2), shard_state="params", shard_min_size=0, replicas=2
        ),
        _step("optimizer"),
    )
    for other in others:
        restored = jaxstep.restore(other, tmp_path / "both")
        for x, y in zip(_host(other, restored), want, strict=True):
            np.testing.assert_array_equal(x, y)
    jaxstep.save(others[0], jaxstep.restore(others[0], tmp_path / "both"), tmp_path / "plain")
    back = jaxstep.restore(step, tmp_path / "plain")
    assert back.opt_state[0].mu["w1"].sharding.spec == P(D, M)
    for x, y in zip(_host(step, back), want, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("model_parallel", [1, 2])
def test_a_step_timeout_trains_as_without_one_and_names_every_device_when_hung(model_parallel):
    """Under replicas the step's program spans two meshes, where JAX lowers no host
    callback: fit(step_timeout=...) compiled nothing before (a ValueError from JAX).
    It trains now, bit for bit as without the watchdog, and a hang names every device
    with the reason (no heartbeat tells which one)."""

    def make():
        return jaxstep.make_train_step(
            _wide_loss,
            optax.adam(1e-2),
            model_parallel=model_parallel,
            model_rule=(lambda path, shape: WIDE.get(path)) if model_parallel > 1 else None,
            shard_state="params",
            shard_min_size=0,
            replicas=2,
        )

    step, again = make(), make()
    batches = _wide_batches(3)
    watched = jaxstep.fit(step, step.init(_wide()), batches, step_timeout=60.0)
    plain = jaxstep.fit(again, again.init(_wide()), batches)
    for x, y in zip(_host(step, watched), _host(again, plain), strict=True):
        np.testing.assert_array_equal(x, y)
    from jaxstep._src.loop._watchdog import hung
    from jaxstep._src.step import runtime_of

    err = hung(runtime_of(step), 3, 1.5)
    assert [f.device_id for f in err.failures] == [d.id for d in step.devices]
    assert "which device hung is not known: a step with replicas > 1" in str(err)


def test_a_stall_fault_under_replicas_is_refused_naming_why():
    with pytest.raises(ValueError, match="needs a host callback inside the step"):
        _step("params", faults=[Fault("stall", device_id=3, step=1, seconds=1.0)])


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("layout", ["optimizer", "params"])
def test_the_model_rule_is_asked_about_global_shapes_only(tmp_path, layout, replicas):
    """Inside the step a sharded leaf is its block along the data axis, a shape the rule
    was never asked about: a rule that checks its shapes (``jaxstep.flax.model_rule``
    refuses one it was not built for) is asked about the global ones only, on every
    program: the replica check, drop's repair, the save's check, the FSDP gathers."""
    known = {f"['{k}']": v.shape for k, v in _wide().items()}
    asked = []

    def strict(path, shape):
        asked.append((path, tuple(shape)))
        if tuple(shape) != known[path]:
            raise ValueError(f"asked about {path} of shape {shape}")
        return WIDE.get(path)

    step = jaxstep.make_train_step(
        _wide_loss,
        optax.adam(1e-2),
        model_parallel=2,
        model_rule=strict,
        shard_state=layout,
        shard_min_size=0,
        replicas=replicas,
        divergence_every=1,
        on_failure="drop",
    )
    state = jaxstep.fit(step, step.init(_wide()), _wide_batches(3))
    jaxstep.save(step, state, tmp_path / "ckpt")  # its check compares every copy
    assert int(jaxstep.restore(step, tmp_path / "ckpt").step) == 3
    assert asked and all(shape == known[path] for path, shape in asked)


@pytest.mark.parametrize("replicas", [1, 2])
def test_drop_repairs_a_whole_leafs_copy_under_fsdp_and_the_run_goes_on_as_clean(replicas):
    """FSDP x TP with b1 and b2 under shard_min_size (whole over the data axis): device
    5's copy of b1 corrupted is repaired from the majority before the local part, and
    the step's later comparison (the gathered copies, where a bad link shows) reads the
    repaired copies, not the fingerprints taken before the repair: the run equals the
    clean one."""

    def make():
        return jaxstep.make_train_step(
            _wide_loss,
            optax.adam(1e-2),
            model_parallel=2,
            model_rule=lambda path, shape: WIDE.get(path),
            shard_state="params",
            shard_min_size=100,
            replicas=replicas,
            divergence_every=2,
            on_failure="drop",
        )

    batches = _wide_batches(4)
    step, clean = make(), make()
    state, _ = step(step.init(_wide()), batches[0])
    state, _ = step(state, batches[1])
    assert state.params["b1"].sharding.spec == P(M)  # whole over the data axis
    bad = corrupt_replica(step, state, 5, "['b1']")
    history = jaxstep.History()
    state = jaxstep.fit(step, bad, batches[2:], history=history)
    assert history.repaired == [(4,), ()]
    want = jaxstep.fit(clean, clean.init(_wide()), batches)
    for x, y in zip(_host(step, state), _host(clean, want), strict=True):
        np.testing.assert_array_equal(x, y)
