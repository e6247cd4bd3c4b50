"""A model axis inside the checked step (``make_train_step(model_parallel=m,
model_rule=...)``, issue 46): the parameters split over each model group as the rule
says, the numbers a hand-written 2-D GSPMD step's, and the group the unit that checks
itself: a fault on any of its devices names the group (``err.device_id`` its first,
``err.group`` all), and no healthy group is blamed."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxstep
from jaxstep import Status
from jaxstep.testing import Fault
from jaxstep.testing import assert_fails
from jaxstep.testing import corrupt_replica
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

#: Megatron's MLP split: dense1's columns (and bias), dense2's rows, over a group
DIMS = {
    "['dense1']['kernel']": 1,
    "['dense1']['bias']": 0,
    "['dense2']['kernel']": 0,
}


def megatron(path, shape):
    return DIMS.get(path)


def _step(m=2, **kw):
    kw.setdefault("divergence_every", None)
    return jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), model_parallel=m, model_rule=megatron, **kw
    )


def _host(step, state):
    return [np.asarray(x) for x in jax.tree.leaves(step.host_state(state).params)]


def test_the_state_is_split_over_each_model_group_as_the_rule_says():
    step = _step()
    assert [d.id for d in step.devices] == [0, 2, 4, 6]  # each group's first device
    assert [tuple(d.id for d in g) for g in step.options.groups] == [
        (0, 1),
        (2, 3),
        (4, 5),
        (6, 7),
    ]
    state = step.init(init_params())
    for _ in range(2):  # the update keeps the layout (the next step reuses its program)
        assert state.params["dense1"]["kernel"].sharding.spec == P(None, jaxstep.MODEL_AXIS)
        assert state.params["dense1"]["bias"].sharding.spec == P(jaxstep.MODEL_AXIS)
        assert state.params["dense2"]["kernel"].sharding.spec == P(jaxstep.MODEL_AXIS)
        assert state.params["dense2"]["bias"].sharding.spec == P()
        mu = state.opt_state[0].mu  # Adam's moments mirror their parameters
        assert mu["dense1"]["kernel"].sharding.spec == P(None, jaxstep.MODEL_AXIS)
        assert mu["dense2"]["bias"].sharding.spec == P()
        # a block a device: half of dense1's 8 columns
        block = state.params["dense1"]["kernel"].addressable_shards[0].data
        assert block.shape == (3, 4)
        state, _ = step(state, make_batches(1)[0])


def _hand_2d(batches, m):
    """The hand-written 2-D GSPMD step: jit over Mesh((8/m, m), (data, model)), the
    same rule as NamedShardings, the batch split over data."""
    mesh = Mesh(np.array(jax.devices()).reshape(8 // m, m), ("data", "model"))
    opt = optax.adam(1e-2)

    def spec(path, _):
        dim = DIMS.get(jax.tree_util.keystr(path))
        return NamedSharding(mesh, P() if dim is None else P(*([None] * dim), "model"))

    params = init_params()
    shardings = jax.tree_util.tree_map_with_path(spec, params)
    params = jax.device_put(params, shardings)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    data = NamedSharding(mesh, P("data"))
    for b in batches:
        params, opt_state = step(params, opt_state, jax.device_put(b, data))
    return [np.asarray(x) for x in jax.tree.leaves(params)]


@pytest.mark.parametrize("m", [2, 4])
def test_ten_steps_match_a_hand_written_2d_gspmd_step_within_1e_5(m):
    batches = make_batches(10)
    step = _step(m)
    state = jaxstep.fit(step, step.init(init_params()), batches)
    for got, want in zip(_host(step, state), _hand_2d(batches, m), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_model_parallel_1_is_todays_step_bitwise():
    batches = make_batches(3)
    plain = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), divergence_every=None)
    ones = _step(1)
    a = jaxstep.fit(plain, plain.init(init_params()), batches)
    b = jaxstep.fit(ones, ones.init(init_params()), batches)
    for x, y in zip(_host(plain, a), _host(ones, b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert [d.id for d in ones.devices] == list(range(8))


@pytest.mark.parametrize("device_id", [4, 5])
def test_a_gradient_fault_on_either_device_of_a_group_names_that_group(device_id):
    step = _step(faults=[Fault("grad", device_id=device_id, step=2, leaf="['dense2']['kernel']")])
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), make_batches(4), diagnose=False)
    err = assert_fails(
        info, device_id=4, step=2, status=Status.GRAD_NONFINITE, leaf="['dense2']['kernel']"
    )
    assert err.group == (4, 5) and [f.group for f in err.failures] == [(4, 5)]
    assert "(process 0, model group: devices 4, 5)" in str(err).splitlines()[0]
    assert int(err.state.step) == 2  # the last good state, still split over the model axis
    assert err.state.params["dense1"]["kernel"].sharding.spec == P(None, jaxstep.MODEL_AXIS)


def test_bad_rows_on_one_group_are_named_with_their_rows():
    batches = make_batches(3)
    batches[1]["pos"][9, 0] = -1.0  # row 9: chunk 1 (rows 8..15), the group of devices 2, 3
    step = _step()
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), batches, diagnose=False)
    err = assert_fails(info, device_id=2, step=1, has_status=Status.LOSS_NONFINITE)
    assert err.group == (2, 3) and err.failures[0].rows == (8, 16)


def test_drop_leaves_a_failing_groups_chunk_out_of_the_mean():
    fault = Fault("loss", device_id=7, step=1, mode="transient")
    step = _step(on_failure="drop", faults=[fault])
    history = jaxstep.History()
    state = jaxstep.fit(step, step.init(init_params()), make_batches(4), history=history)
    assert int(state.step) == 4
    assert history.dropped == [(), (6,), (), ()]  # the group of devices 6, 7, by its first
    assert all(np.isfinite(x).all() for x in _host(step, state))


def test_recover_excludes_the_whole_group_and_keeps_the_state_split():
    step = _step(faults=[Fault("grad", device_id=3, step=2, mode="device")])
    history = jaxstep.History()
    with pytest.warns(UserWarning, match="not trained"):  # 32 rows over 3 groups
        state = jaxstep.fit(
            step,
            step.init(init_params()),
            make_batches(6),
            recover=jaxstep.Recover(),
            history=history,
        )
    assert int(state.step) == 6
    [recovery] = history.recoveries
    assert (recovery.step, recovery.verdict, recovery.action) == (2, "device", "excluded")
    assert recovery.device_ids == (2,)  # the group of devices 2, 3, by its first
    assert [tuple(d.id for d in g) for g in step.options.groups] == [(0, 1), (4, 5), (6, 7)]
    assert state.params["dense1"]["kernel"].sharding.spec == P(None, jaxstep.MODEL_AXIS)
    held = {d.id for d in state.params["dense1"]["kernel"].sharding.device_set}
    assert held == {0, 1, 4, 5, 6, 7}


def test_exclude_devices_takes_any_device_of_a_group_and_drops_the_group():
    step = _step()
    state = step.init(init_params())
    smaller, state = step.without_devices([7], state)
    assert [d.id for d in smaller.devices] == [0, 2, 4]
    batch = {k: v[:24] for k, v in make_batches(1)[0].items()}
    state, out = smaller(state, batch)
    assert smaller.table(out).status.tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    ("device_id", "leaf", "group"),
    [
        (5, "['dense1']['kernel']", (4, 5)),  # a block of a split leaf
        (3, "['dense2']['bias']", (2, 3)),  # one device's copy of a whole leaf
    ],
)
def test_a_corrupted_device_is_named_by_its_group(device_id, leaf, group):
    step = _step(divergence_every=2)
    state, _ = step(step.init(init_params()), make_batches(1)[0])
    state, _ = step(state, make_batches(1)[0])  # step 2 checks the copies
    bad = corrupt_replica(step, state, device_id, leaf)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, bad, make_batches(2))
    err = assert_fails(info, device_id=group[0], step=2, status=Status.DIVERGED)
    assert err.group == group and err.leaf == f"params{leaf}"


def test_drop_repairs_a_corrupted_block_from_a_twin_group():
    step = _step(on_failure="drop", divergence_every=2)
    state, _ = step(step.init(init_params()), make_batches(1)[0])
    state, _ = step(state, make_batches(1)[0])
    bad = corrupt_replica(step, state, 5, "['dense1']['kernel']")
    history = jaxstep.History()
    state = jaxstep.fit(step, bad, make_batches(2), history=history)
    assert history.repaired == [(4,), ()]  # the group of devices 4, 5, by its first
    clean = _step(on_failure="drop", divergence_every=2)
    want = jaxstep.fit(clean, clean.init(init_params()), make_batches(1) * 2 + make_batches(2))
    for x, y in zip(_host(step, state), _host(clean, want), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_stalled_group_is_named_by_the_heartbeat():
    step = _step(faults=[Fault("stall", device_id=3, step=1, seconds=3.0)])
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), make_batches(3), step_timeout=1.5)
    err = assert_fails(info, device_id=2, step=1, status=Status.HUNG)
    assert err.group == (2, 3)


@pytest.mark.parametrize("chip", [5, 4])
def test_diagnosis_names_the_device_of_a_group_a_fault_follows(chip):
    step = _step(faults=[Fault("grad", device_id=chip, step=1, mode="device")])
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), make_batches(3), diagnose=True)
    err = info.value
    assert err.group == (4, 5) and err.device_id == 4
    assert err.diagnosis.verdict == "device" and err.diagnosis.chip == chip
    assert err.diagnosis.devices == (4,)  # the group goes whole
    said = "moved with it" if chip == 5 else "stayed with device 4 (model position 0)"
    assert said in str(err.diagnosis) and f"it follows device {chip}" in str(err.diagnosis)


def test_diagnosis_tells_bad_rows_from_a_groups_device():
    step = _step(faults=[Fault("grad", device_id=5, step=1, mode="data", example=2)])
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), make_batches(3), diagnose=True)
    assert info.value.diagnosis.verdict == "data"


def test_a_checkpoint_restores_bitwise_across_model_parallel_and_layouts(tmp_path):
    batches = make_batches(2)
    step = _step()
    state = jaxstep.fit(step, step.init(init_params()), batches)
    jaxstep.save(step, state, tmp_path / "m2")
    want = _host(step, state)
    others = [
        _step(1),
        _step(4),
        jaxstep.make_train_step(loss_fn, optax.adam(1e-2), shard_state="params", shard_min_size=0),
        jaxstep.make_train_step(loss_fn, optax.adam(1e-2), shard_state="optimizer"),
    ]
    for i, other in enumerate(others):
        restored = jaxstep.restore(other, tmp_path / "m2")
        for x, y in zip(_host(other, restored), want, strict=True):
            np.testing.assert_array_equal(x, y)
        jaxstep.save(other, restored, tmp_path / f"back{i}")
        back = jaxstep.restore(step, tmp_path / f"back{i}")
        assert back.params["dense1"]["kernel"].sharding.spec == P(None, jaxstep.MODEL_AXIS)
        for x, y in zip(_host(step, back), want, strict=True):
            np.testing.assert_array_equal(x, y)


def test_loss_fn_may_constrain_an_activation_over_the_model_axis():
    def constrained(params, batch):
        h = batch["x"] @ params["dense1"]["kernel"]
        h = jax.lax.with_sharding_constraint(h, P(None, jaxstep.MODEL_AXIS))
        return loss_fn(params, batch) + 0.0 * jnp.sum(h)

    step = jaxstep.make_train_step(
        constrained, optax.adam(1e-2), model_parallel=2, model_rule=megatron
    )
    _, out = step(step.init(init_params()), make_batches(1)[0])
    assert step.table(out).status.tolist() == [0, 0, 0, 0]


# -- bad input, before anything runs --------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "error", "words"),
    [
        (dict(model_parallel=3), ValueError, "model_parallel=3 does not divide the 8 devices"),
        (dict(model_parallel=0), TypeError, "model_parallel must be an int >= 1"),
        (dict(model_parallel=2, backend="pmap"), ValueError, "needs backend='shard_map'"),
        (
            dict(model_parallel=2, shard_state="params", replicas=3),
            ValueError,
            "replicas=3 does not divide the 4 model groups (8 devices, model_parallel=2)",
        ),
        (dict(model_parallel=2, axis_name="model"), ValueError, "pass another axis_name"),
        (dict(model_parallel=2, model_rule=3), TypeError, "model_rule must be a function"),
    ],
)
def test_a_bad_option_is_refused_naming_the_fix(kw, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        jaxstep.make_train_step(loss_fn, optax.sgd(0.1), **kw)


@pytest.mark.parametrize(
    ("rule", "error", "words"),
    [
        (lambda p, s: "columns", TypeError, "returned 'columns'; return a dimension"),
        (lambda p, s: 5, ValueError, "which a leaf of shape"),
        (lambda p, s: 0 if "dense2" in p else None, ValueError, "does not divide it"),
    ],
)
def test_a_bad_rule_is_refused_at_init_naming_the_leaf(rule, error, words):
    step = jaxstep.make_train_step(loss_fn, optax.sgd(0.1), model_parallel=2, model_rule=rule)
    with pytest.raises(error, match=words):
        step.init(init_params())


# -- with a sharded state over the data axis (FSDP / ZeRO-1 x tensor parallelism) -----


def _wide():
    """An MLP whose kernels split over both axes: 16x32 and 32x8."""
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.normal(size=(16, 32)) * 0.3).astype(np.float32),
        "b1": np.zeros(32, np.float32),
        "w2": (rng.normal(size=(32, 8)) * 0.3).astype(np.float32),
        "b2": np.zeros(8, np.float32),
    }


def _wide_loss(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - batch["y"]) ** 2)


def _wide_batches(num):
    rng = np.random.default_rng(1)
    return [
        {
            "x": rng.normal(size=(32, 16)).astype(np.float32),
            "y": rng.normal(size=(32, 8)).astype(np.float32),
        }
        for _ in range(num)
    ]


WIDE = {"['w1']": 1, "['b1']": 0, "['w2']": 0}


def _wide_step(layout, **kw):
    return jaxstep.make_train_step(
        _wide_loss,
        optax.adam(1e-2),
        model_parallel=2,
        model_rule=lambda path, shape: WIDE.get(path),
        shard_state=layout,
        shard_min_size=0,
        **kw,
    )


@pytest.mark.parametrize("layout", ["optimizer", "params"])
def test_a_sharded_state_splits_each_leaf_over_both_axes_and_trains_as_replicated(layout):
    batches = _wide_batches(6)
    plain = jaxstep.make_train_step(_wide_loss, optax.adam(1e-2), divergence_every=None)
    want = plain.host_state(jaxstep.fit(plain, plain.init(_wide()), batches)).params
    step = _wide_step(layout, divergence_every=2)
    state = jaxstep.fit(step, step.init(_wide()), batches)
    m, d = jaxstep.MODEL_AXIS, "devices"
    # the model dimension is never the data axis's: w1 (16, 32) is split along 1 over
    # the model axis, so along 0 over the data axis; w2 (32, 8) the other way round
    mu = state.opt_state[0].mu
    assert (mu["w1"].sharding.spec, mu["w2"].sharding.spec) == (P(d, m), P(m, d))
    params = state.params
    if layout == "params":
        assert (params["w1"].sharding.spec, params["w2"].sharding.spec) == (P(d, m), P(m, d))
    else:  # ZeRO-1: the parameters whole over the data axis
        assert (params["w1"].sharding.spec, params["w2"].sharding.spec) == (P(None, m), P(m))
    got = step.host_state(state).params
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["optimizer", "params"])
def test_a_sharded_state_over_model_groups_names_the_group_and_recovers(layout):
    step = _wide_step(layout, faults=[Fault("grad", device_id=5, step=2, leaf="['w2']")])
    assert_fails(
        lambda: jaxstep.fit(step, step.init(_wide()), _wide_batches(4), diagnose=False),
        device_id=4,
        step=2,
        status=Status.GRAD_NONFINITE,
        leaf="['w2']",
    )
    step = _wide_step(layout, faults=[Fault("grad", device_id=3, step=2, mode="device")])
    history = jaxstep.History()
    with pytest.warns(UserWarning, match="not trained"):
        state = jaxstep.fit(
            step, step.init(_wide()), _wide_batches(6), recover=jaxstep.Recover(), history=history
        )
    assert [(r.step, r.action, r.device_ids) for r in history.recoveries] == [(2, "excluded", (2,))]
    assert int(state.step) == 6
    assert state.opt_state[0].mu["w1"].sharding.spec == P("devices", jaxstep.MODEL_AXIS)


def test_a_shard_rule_on_the_model_rules_dimension_is_refused_naming_both():
    step = jaxstep.make_train_step(
        _wide_loss,
        optax.sgd(0.1),
        model_parallel=2,
        model_rule=lambda path, shape: WIDE.get(path),
        shard_state="params",
        shard_rule=lambda path, shape: 1 if path == "['w1']" else None,
        shard_min_size=0,
    )
    with pytest.raises(ValueError, match="which model_rule splits over the model axis already"):
        step.init(_wide())


def test_a_checkpoint_over_both_axes_restores_bitwise_onto_either_axis_alone(tmp_path):
    step = _wide_step("params", divergence_every=None)
    state = jaxstep.fit(step, step.init(_wide()), _wide_batches(2))
    jaxstep.save(step, state, tmp_path / "both")
    want = _host(step, state)
    for other in (
        jaxstep.make_train_step(_wide_loss, optax.adam(1e-2)),
        jaxstep.make_train_step(
            _wide_loss, optax.adam(1e-2), shard_state="params", shard_min_size=0
        ),
        _wide_step("optimizer"),
    ):
        restored = jaxstep.restore(other, tmp_path / "both")
        for x, y in zip(_host(other, restored), want, strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("saved", [False, True])
def test_recover_repairs_or_rolls_back_a_corrupted_block_of_the_first_group(tmp_path, saved):
    """Device 1's block of a split kernel (model group 0, 1: the group a host read of
    a split leaf would take by default) corrupted between two fit calls: repaired from
    the majority's blocks, or rolled back to the verified checkpoint, and the run ends
    where a clean one does."""
    batches = make_batches(6)
    step = _step(divergence_every=1)
    clean_step = _step(divergence_every=1)
    clean = jaxstep.fit(clean_step, clean_step.init(init_params()), batches)
    checkpoints = {"checkpoint_dir": tmp_path, "checkpoint_every": 2}
    first = checkpoints if saved else {}
    state = jaxstep.fit(step, step.init(init_params()), batches[:3], **first)
    state = corrupt_replica(step, state, 1, "params['dense1']['kernel']")
    history = jaxstep.History()
    recover = jaxstep.Recover(rollback_batches=2)
    state = jaxstep.fit(step, state, batches[3:], history=history, recover=recover, **checkpoints)
    (record,) = history.recoveries
    action = "rolled back" if saved else "repaired"
    assert (record.step, record.verdict, record.action) == (3, "diverged", action)
    assert record.device_ids == (0,)  # the group of devices 0, 1, by its first
    for x, y in zip(_host(step, state), _host(clean_step, clean), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    ("layout", "leaf"),
    [
        ("params", "params['b2']"),  # a block of the data axis, a copy on each device
        ("optimizer", "opt_state[0].mu['b2']"),  # the same, the optimizer's
        ("optimizer", "params['b2']"),  # whole over both axes: a copy on every device
    ],
)
def test_one_devices_copy_under_a_sharded_state_is_named_by_its_group(layout, leaf):
    """b2 is whole on the model axis, so each device of a group holds a copy of it (of
    its group's block, when sharded over the data axis: no twin in another group):
    device 5's copy corrupted is named by its group and the leaf."""
    step = _wide_step(layout, divergence_every=2)
    batches = _wide_batches(4)
    state, _ = step(step.init(_wide()), batches[0])
    state, _ = step(state, batches[1])  # step 2 checks the copies
    bad = corrupt_replica(step, state, 5, leaf)
    # the check a checkpoint's save runs alone sees it too (the group, the leaf)
    from jaxstep._src.step import runtime_of

    assert runtime_of(step).differing(bad) == {2: step.names["state"].index(leaf)}
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, bad, batches[2:])
    err = assert_fails(info, device_id=4, step=2, status=Status.DIVERGED)
    assert err.group == (4, 5) and err.leaf == leaf


def test_drop_repairs_a_copy_a_twin_group_holds_and_never_a_shard_it_does_not():
    """Under drop a corrupted copy of a leaf every group holds alike is repaired from a
    twin group (ZeRO-1's parameters); one of a data-axis block (FSDP's) has no twin to
    copy from, and nothing tells which of the group's copies is right: it diverges."""
    batches = _wide_batches(4)

    def corrupted(layout):
        step = _wide_step(layout, divergence_every=2, on_failure="drop")
        state, _ = step(step.init(_wide()), batches[0])
        state, _ = step(state, batches[1])
        return step, corrupt_replica(step, state, 5, "['b2']")

    step, bad = corrupted("optimizer")
    history = jaxstep.History()
    state = jaxstep.fit(step, bad, batches[2:], history=history)
    assert history.repaired == [(4,), ()]
    clean = _wide_step("optimizer", divergence_every=2, on_failure="drop")
    want = jaxstep.fit(clean, clean.init(_wide()), batches)
    for x, y in zip(_host(step, state), _host(clean, want), strict=True):
        np.testing.assert_array_equal(x, y)
    step, bad = corrupted("params")
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, bad, batches[2:])
    err = assert_fails(info, device_id=4, step=2, status=Status.DIVERGED)
    assert err.group == (4, 5) and err.leaf == "params['b2']"


def test_recover_rolls_back_a_copy_of_a_block_only_its_group_holds_never_rebuilds_it(tmp_path):
    """FSDP over model groups: device 4's copy (model position 0, the one a host read
    of the leaf takes) of its group's block of b2 corrupted. No other group holds that
    block, so no majority copy can rebuild it: Recover() rolls back to the verified
    checkpoint (equal to the clean run, bit for bit), and without one the error says
    why and calls the state not good, rather than "repair" it from the corrupted copy."""
    batches = _wide_batches(6)
    clean = _wide_step("params", divergence_every=2)
    want = jaxstep.fit(clean, clean.init(_wide()), batches)
    for saved in (True, False):
        kw = {"checkpoint_dir": str(tmp_path / str(saved)), "checkpoint_every": 2} if saved else {}
        step = _wide_step("params", divergence_every=2)
        state = jaxstep.fit(step, step.init(_wide()), batches[:2], **kw)
        bad = corrupt_replica(step, state, 4, "['b2']")
        history = jaxstep.History()
        if saved:
            state = jaxstep.fit(
                step, bad, batches[2:], recover=jaxstep.Recover(), history=history, **kw
            )
            assert [(r.step, r.verdict, r.action) for r in history.recoveries] == [
                (2, "diverged", "rolled back")
            ]
            for x, y in zip(_host(step, state), _host(clean, want), strict=True):
                np.testing.assert_array_equal(x, y)
            continue
        with pytest.raises(jaxstep.TrainingWorkerError) as info:
            jaxstep.fit(step, bad, batches[2:], recover=jaxstep.Recover())
        err = assert_fails(info, device_id=4, step=2, status=Status.DIVERGED)
        assert err.group == (4, 5) and not err.state_is_good
        assert "params['b2'] inside the model group differ" in err.note
        assert "no twin in another group" in err.note
