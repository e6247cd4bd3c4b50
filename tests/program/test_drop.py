"""on_failure="drop": a failing device is left out of the step's mean, and a diverged
replica is repaired from the majority, inside the step."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep.testing import Fault
from jaxstep.testing import assert_replicas_equal
from jaxstep.testing import corrupt_replica
from jaxstep.testing import replicas
from tests.models import N
from tests.models import host_params
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches
from tests.models import rows_of


def _devices(permuted):
    devices = jax.devices()
    return [devices[i] for i in (5, 2, 7, 0, 3, 6, 1, 4)] if permuted else devices


def _drop_step(backend, **kw):
    return jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), backend=backend, on_failure="drop", **kw
    )


def _oracle(params, opt_state, batch, healthy, optimizer):
    """One optax update with the mean over the ``healthy`` positions of each chunk's
    gradient, on the host."""
    chunk = lambda i: {k: v[rows_of(i)] for k, v in batch.items()}  # noqa: E731
    grads = [jax.grad(loss_fn)(params, chunk(i)) for i in healthy]
    mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
    updates, opt_state = optimizer.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@pytest.mark.parametrize("permuted", [False, True])
def test_a_nan_row_on_one_device_is_left_out_of_the_mean(backend, permuted):
    devices = _devices(permuted)
    bad = devices[3]  # position 3: its id differs from 3 when permuted
    step = _drop_step(
        backend, devices=devices, faults=Fault("input", bad.id, step=2), divergence_every=None
    )
    batches = make_batches(5)
    optimizer = optax.adam(1e-2)
    params = jax.tree.map(jnp.asarray, init_params())
    opt_state = optimizer.init(params)
    state = step.init(init_params())
    history = jaxstep.History()
    for i, batch in enumerate(batches):
        healthy = [p for p in range(N) if not (i == 2 and p == 3)]
        params, opt_state = _oracle(params, opt_state, batch, healthy, optimizer)
        state = jaxstep.fit(step, state, [batch], history=history)
        chex.assert_trees_all_close(host_params(step, state), params, rtol=2e-5, atol=1e-6)
    assert_replicas_equal(step, state)
    host = step.host_state(state)
    assert int(np.asarray(host.total_drops)) == 1
    assert int(np.asarray(host.total_skips)) == 0
    assert int(np.asarray(host.step)) == 5
    assert history.dropped == [(), (), (bad.id,), (), ()]
    assert history.dropped_rows == [(), (), ((rows_of(3).start, rows_of(3).stop),), (), ()]
    assert history.skipped == [False] * 5
    assert history.status[2].tolist() == [0, 0, 0, int(Status.INPUT_NONFINITE), 0, 0, 0, 0]
    assert history.as_arrays()["dropped"].tolist() == [[-1], [-1], [bad.id], [-1], [-1]]


def test_more_failing_devices_than_max_dropped_skip_the_step(backend):
    devices = jax.devices()
    faults = [Fault("input", devices[p].id, step=1) for p in (0, 2, 4, 6)]
    step = _drop_step(backend, faults=faults)
    batches = make_batches(3)
    history = jaxstep.History()
    state = jaxstep.fit(step, step.init(init_params()), batches[:1], history=history)
    before = host_params(step, state)
    state, out = step(state, batches[1])
    table = step.table(out)
    assert table.skipped and not table.halted and not table.dropped.any()
    chex.assert_trees_all_equal(host_params(step, state), before)
    host = step.host_state(state)
    assert (int(np.asarray(host.total_skips)), int(np.asarray(host.total_drops))) == (1, 0)
    # three of them are within the default limit, (8 - 1) // 2
    step3 = _drop_step(backend, faults=faults[:3])
    state = jaxstep.fit(step3, step3.init(init_params()), batches, history=history)
    assert history.dropped[-2] == tuple(devices[p].id for p in (0, 2, 4))
    assert int(np.asarray(step3.host_state(state).total_drops)) == 3


def test_a_device_failing_every_step_halts_the_run_naming_it(backend):
    devices = _devices(permuted=True)
    step = _drop_step(backend, devices=devices)
    batches = make_batches(6)
    for i in range(1, 6):
        batches[i]["x"][rows_of(5)] = np.nan
    batches[3]["x"][rows_of(1)] = np.nan  # another device fails once, beside it
    history = jaxstep.History()
    good = jaxstep.fit(step, step.init(init_params()), batches[:3], history=history)
    good_params = host_params(step, good)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, good, batches[3:], history=history)
    err = info.value
    assert (err.device_id, err.step) == (devices[5].id, 3)
    assert err.status & Status.INPUT_NONFINITE
    assert [f.device_id for f in err.failures] == [devices[5].id, devices[1].id]
    assert "failed 3 steps in a row" in str(err)
    # the device's own failure: the hint suspects the chip, not the data pipeline
    hint = next(line for line in str(err).splitlines() if line.startswith("what to try"))
    assert "suspect the chip" in hint and "check the data pipeline" not in hint
    assert history.dropped[1:3] == [(devices[5].id,), (devices[5].id,)]
    chex.assert_trees_all_equal(host_params(step, err.state), good_params)


def _centred_loss(params, batch):
    """The model communicates: the inputs are centred by their mean over all devices."""
    x = batch["x"] - jax.lax.pmean(jnp.mean(batch["x"], axis=0), "devices")
    return loss_fn(params, dict(batch, x=x))


def test_a_nan_that_spreads_through_a_pmean_skips_the_step(backend):
    step = jaxstep.make_train_step(
        _centred_loss, optax.adam(1e-2), backend=backend, on_failure="drop"
    )
    batches = make_batches(3)
    batches[1]["x"][rows_of(2).start, 0] = np.nan
    history = jaxstep.History()
    state = jaxstep.fit(step, step.init(init_params()), batches, history=history)
    assert history.skipped == [False, True, False]
    assert history.dropped == [(), (), ()]
    assert all(np.all(np.isfinite(p)) for p in jax.tree.leaves(host_params(step, state)))
    assert history.status[1][2] & Status.INPUT_NONFINITE


def test_a_corrupted_replica_is_repaired_from_the_majority(backend):
    devices = _devices(permuted=True)
    step = _drop_step(backend, devices=devices, divergence_every=1)
    batches = make_batches(6)
    clean = jaxstep.fit(step, step.init(init_params()), batches)
    clean_params = host_params(step, clean)
    state = jaxstep.fit(step, step.init(init_params()), batches[:3])
    bad = devices[6]
    leaf = "params['dense2']['kernel']"
    state = corrupt_replica(step, state, bad.id, leaf, ulps=1)
    history = jaxstep.History()
    state = jaxstep.fit(step, state, batches[3:], history=history)
    assert history.repaired == [(bad.id,), (), ()]
    assert history.dropped == [(), (), ()]
    assert_replicas_equal(step, state)
    for copy in replicas(step, state.params):
        chex.assert_trees_all_equal(copy, clean_params)  # bit for bit
    # the same device diverging a second time is a bad device: DIVERGED
    state = corrupt_replica(step, state, bad.id, leaf, ulps=1)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, make_batches(2, seed=5))
    err = info.value
    assert (err.device_id, err.status, err.leaf) == (bad.id, Status.DIVERGED, leaf)
    assert [f.device_id for f in err.failures] == [bad.id]


def test_drop_options_are_checked():
    with pytest.raises(ValueError, match="max_dropped"):
        jaxstep.make_train_step(loss_fn, optax.sgd(0.1), on_failure="drop", max_dropped=8)
    with pytest.raises(TypeError, match="max_dropped"):
        jaxstep.make_train_step(loss_fn, optax.sgd(0.1), on_failure="drop", max_dropped=1.5)
    with pytest.raises(ValueError, match="max_consecutive_drops"):
        jaxstep.make_train_step(loss_fn, optax.sgd(0.1), on_failure="drop", max_consecutive_drops=0)
    with pytest.raises(ValueError, match="'drop'"):
        jaxstep.make_train_step(loss_fn, optax.sgd(0.1), on_failure="dorp")


def test_checkpoints_move_between_drop_and_the_other_policies(tmp_path):
    batches = make_batches(4)
    skip = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), on_failure="skip")
    jaxstep.fit(
        skip,
        skip.init(init_params()),
        batches[:2],
        checkpoint_dir=tmp_path / "a",
        checkpoint_every=2,
    )
    step = _drop_step("shard_map", faults=Fault("input", jax.devices()[2].id, step=2))
    state = jaxstep.restore(step, tmp_path / "a")
    assert int(np.asarray(step.host_state(state).total_drops)) == 0
    # a sequence of batches is indexed by the restored state's step
    state = jaxstep.fit(step, state, batches, checkpoint_dir=tmp_path / "b", checkpoint_every=2)
    assert int(np.asarray(step.host_state(state).total_drops)) == 1
    again = jaxstep.restore(step, tmp_path / "b")
    host = step.host_state(again)
    assert int(np.asarray(host.total_drops)) == int(np.asarray(host.step) > 2)
    back = jaxstep.restore(skip, tmp_path / "b")
    assert step.host_state(back).total_drops is None


def test_the_records_show_the_chunk_left_out(tmp_path):
    import io
    import json

    import matplotlib

    matplotlib.use("Agg")
    bad = jax.devices()[4]
    step = _drop_step("shard_map", faults=Fault("input", bad.id, step=1))
    history = jaxstep.History()
    out = io.StringIO()
    callbacks = [
        jaxstep.JsonlWriter(tmp_path / "run.jsonl"),
        jaxstep.Progress(3, every=1, file=out),
    ]
    jaxstep.fit(
        step, step.init(init_params()), make_batches(3), history=history, callbacks=callbacks
    )
    lines = out.getvalue()
    assert f"step 1 left out device {bad.id}: non-finite input" in lines
    assert "dropped 1" in lines.splitlines()[-1]
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    steps = [r for r in records if "devices" in r]
    assert [r["dropped"] for r in steps] == [[], [bad.id], []]
    assert steps[1]["dropped_rows"] == [[rows_of(4).start, rows_of(4).stop]]
    assert [d["dropped"] for d in steps[1]["devices"]] == [d == bad for d in jax.devices()]
    marks = jaxstep.plot.marks(history)
    assert marks["dropped"].tolist() == [[1, bad.id]] and marks["skipped"].tolist() == []
    fig = jaxstep.plot.overview(history, tmp_path / "run.png")
    assert any(c.get_gid() == "dropped" for c in fig.axes[0].collections)


def _with_model_state(params, batch, model_state):
    mean = 0.9 * model_state["mean"] + 0.1 * jnp.mean(batch["x"], axis=0)
    return loss_fn(params, batch), {"model_state": {"mean": mean}}


@pytest.mark.parametrize(
    "options",
    [
        {"microbatches": 2},
        {"verify_update": True},
        {"loss_scale": jaxstep.DynamicLossScale(scale=2.0**8)},
        {"has_aux": True},  # with a model state
    ],
    ids=["microbatches", "verify_update", "loss_scale", "model_state"],
)
def test_drop_works_with_the_other_options(backend, options):
    with_state = options.get("has_aux", False)
    step = (
        _drop_step(backend, **options)
        if not with_state
        else jaxstep.make_train_step(
            _with_model_state, optax.adam(1e-2), backend=backend, on_failure="drop", has_aux=True
        )
    )
    ms = {"mean": jnp.zeros(3, jnp.float32)} if with_state else None
    batches = make_batches(2)
    batches[1]["x"][rows_of(3).start + 1, 0] = np.nan
    state, _ = step(step.init(init_params(), model_state=ms), batches[0])
    host = step.host_state(state)
    before_ms = None if not with_state else np.asarray(host.model_state["mean"])
    healthy = [p for p in range(N) if p != 3]
    params, _ = _oracle(host.params, host.opt_state, batches[1], healthy, optax.adam(1e-2))
    state, out = step(state, batches[1])
    table = step.table(out)
    assert table.dropped.tolist() == [p == 3 for p in range(N)] and not table.skipped
    chex.assert_trees_all_close(host_params(step, state), params, rtol=2e-5, atol=1e-6)
    if with_state:
        chunk_means = [np.mean(batches[1]["x"][rows_of(p)], axis=0) for p in healthy]
        want = 0.9 * before_ms + 0.1 * np.mean(chunk_means, axis=0)
        got = np.asarray(step.host_state(state).model_state["mean"])
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_replicas_equal(step, state)


def test_a_loss_scale_overflow_still_skips_the_whole_step_and_backs_off(backend):
    scale = jaxstep.DynamicLossScale(scale=2.0**8)
    step = _drop_step(backend, loss_scale=scale)
    batches = make_batches(2)
    batches[1]["poison"][rows_of(5)] = 1.0  # an inf gradient from a finite input and loss
    state, _ = step(step.init(init_params()), batches[0])
    before = host_params(step, state)
    state, out = step(state, batches[1])
    table = step.table(out)
    assert table.skipped and not table.failed and not table.dropped.any()
    assert table.status[5] == Status.OVERFLOW
    chex.assert_trees_all_equal(host_params(step, state), before)
    host = step.host_state(state)
    assert float(host.loss_scale.scale) == 2.0**7 and int(np.asarray(host.total_drops)) == 0


def _entry(step, state, batch):
    text = step.lower(state, batch).compile().as_text()
    entry = text[text.index("ENTRY") :]
    return entry[: entry.index("\n}")]


def test_drop_adds_no_collective_and_the_other_policies_none_of_its_code():
    batch = make_batches(1)[0]
    programs = {}
    for policy in ("skip", "drop"):
        step = jaxstep.make_train_step(
            loss_fn, optax.adam(1e-2), on_failure=policy, divergence_every=None
        )
        programs[policy] = _entry(step, step.init(init_params()), batch)
    # one all-reduce on the happy path: the healthy count rides in the gradients' one
    assert programs["drop"].count(" all-reduce(") == 1
    assert programs["skip"].count(" all-reduce(") == 1
    # no drop state in the other policies' programs: the same parameters as before
    params = {p: text.count(" parameter(") for p, text in programs.items()}
    assert params["drop"] == params["skip"] + 3  # total_drops, monitor drops, repairs


@pytest.mark.parametrize("count", [8, 6], ids=["8-devices", "6-devices"])
def test_steps_where_nothing_fails_match_the_default_policy(backend, count):
    # the mean over the healthy count is a multiply by its reciprocal, computed in the
    # step (it fuses into the optimizer's pass), where the default policy's 1 / n is a
    # constant XLA may fold elsewhere: equal within a few ulps, also where 1 / n is
    # not exact
    devices = jax.devices()[:count]
    batches = [
        {k: v[: count * (len(v) // N)] for k, v in batch.items()} for batch in make_batches(3)
    ]
    finals = {}
    for policy in ("raise", "drop"):
        step = jaxstep.make_train_step(
            loss_fn, optax.adam(1e-2), backend=backend, on_failure=policy, devices=devices
        )
        state = jaxstep.fit(step, step.init(init_params()), batches)
        finals[policy] = step.host_state(state)
    for part in ("params", "opt_state"):
        got, want = getattr(finals["drop"], part), getattr(finals["raise"], part)
        chex.assert_trees_all_close(got, want, rtol=2e-6, atol=0)


@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-15), ("bfloat16", 2.0**-8)])
def test_the_mean_over_the_healthy_devices_keeps_the_gradients_precision(dtype, rtol):
    # 1 / 7 is taken in float32 at least (float64 under x64) and the product rounded
    # once, within half an ulp (bfloat16: 2**-8 relative at most); a float32 reciprocal
    # cast to bfloat16 first was off by up to 0.53%, and float64 kept float32's digits
    from jaxstep._src.program._policies import times_share

    with jax.enable_x64(dtype == "float64"):
        x = jnp.asarray(np.linspace(-3.0, 3.0, 257), dtype)
        got = np.asarray(times_share(x, jnp.float32(7.0)))
    assert got.dtype == x.dtype
    exact = np.asarray(x).astype(np.float64) / 7.0
    np.testing.assert_allclose(got.astype(np.float64), exact, rtol=rtol, atol=0)
