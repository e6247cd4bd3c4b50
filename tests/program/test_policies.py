"""raise freezes the state; skip discards the update everywhere and goes on."""

import chex
import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep._src.step import Runtime
from jaxstep.testing import assert_replicas_equal
from jaxstep.testing import replicas
from tests.models import BATCH
from tests.models import host_params
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches
from tests.models import rows_of


def test_skip_discards_update_on_every_device_and_goes_on(backend):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend, on_failure="skip")
    batches = make_batches(6)
    state = jaxstep.fit(step, step.init(init_params()), batches[:2])
    before = replicas(step, state.params)
    bad = {k: v.copy() for k, v in batches[2].items()}
    bad["x"][rows_of(3)] = np.nan
    state, out = step(state, bad)
    table = step.table(out)
    assert table.skipped and not table.halted
    assert [int(s) for s in table.status] == [0, 0, 0, 7, 0, 0, 0, 0]
    after = replicas(step, state.params)
    for dev_before, dev_after in zip(before, after, strict=True):
        chex.assert_trees_all_equal(dev_before, dev_after)  # no device updated
    assert_replicas_equal(step, state)
    host = step.host_state(state)
    assert int(np.asarray(host.step)) == 3
    assert int(np.asarray(host.total_skips)) == 1
    assert int(np.asarray(host.consecutive_skips)) == 1
    # training continues: the next good step updates the params and resets the run
    history = jaxstep.History()
    state = jaxstep.fit(step, state, batches[3:], history=history)
    host = step.host_state(state)
    assert int(np.asarray(host.step)) == 6
    assert int(np.asarray(host.consecutive_skips)) == 0
    assert int(np.asarray(host.total_skips)) == 1
    kernel = replicas(step, state.params)[0]["dense1"]["kernel"]
    assert not np.array_equal(kernel, after[0]["dense1"]["kernel"])
    assert history.skipped == [False, False, False]


def test_skip_raises_after_max_consecutive_skips(backend):
    step = jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), backend=backend, on_failure="skip", max_consecutive_skips=3
    )
    batches = make_batches(8)
    for i in (2, 3, 4, 5):
        batches[i]["x"][rows_of(5)] = np.nan
    history = jaxstep.History()
    good = jaxstep.fit(step, step.init(init_params()), batches[:2])
    good_params = host_params(step, good)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, good, batches[2:], history=history)
    err = info.value
    assert err.device_id == jax.devices()[5].id
    assert err.step == 4  # the third bad step in a row
    assert err.status & Status.INPUT_NONFINITE
    assert "3 failed steps in a row" in str(err)
    assert history.skipped == [True, True, False]
    chex.assert_trees_all_equal(host_params(step, err.state), good_params)


def test_raise_freezes_state_for_steps_already_dispatched(backend):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    batches = make_batches(4)
    state = step.init(init_params())
    state, _ = step(state, batches[0])
    good = host_params(step, state)
    bad = {k: v.copy() for k, v in batches[1].items()}
    bad["x"][0, 0] = np.nan
    state, out1 = step(state, bad)
    state, _ = step(state, batches[2])  # dispatched before the host looked
    assert step.table(out1).failed and step.table(out1).halted
    host = step.host_state(state)
    assert bool(np.asarray(host.halted)) and int(np.asarray(host.step)) == 1
    chex.assert_trees_all_equal(host_params(step, state), good)
    with pytest.raises(ValueError, match="halted"):
        jaxstep.fit(step, state, batches)
    resumed = jaxstep.fit(step, step.clear_halt(state), batches[2:])
    assert int(np.asarray(step.host_state(resumed).step)) == 3


def test_healthy_run_matches_single_device_optax(backend):
    """The applied gradient is the mean over devices, not the sum."""
    opt = optax.adam(1e-2)
    batches = make_batches(5)
    step = jaxstep.make_train_step(loss_fn, opt, backend=backend)
    history = jaxstep.History()
    state = jaxstep.fit(step, step.init(init_params()), batches, history=history)

    params = jax.tree.map(np.asarray, init_params())
    opt_state = opt.init(params)
    losses = []
    for b in batches:
        loss, grads = jax.value_and_grad(loss_fn)(params, b)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    got = host_params(step, state)
    chex.assert_trees_all_close(got, params, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(history.loss, losses, rtol=1e-5)
    arrays = history.as_arrays()
    assert arrays["device_loss"].shape == (5, 8)
    assert arrays["device_grad_norm"].shape == (5, 8)
    assert np.all(arrays["device_grad_norm"] > 0)
    assert arrays["step"].tolist() == [0, 1, 2, 3, 4]
    assert BATCH % 8 == 0


def test_rng_is_folded_per_device_and_step(backend):
    seen = []

    def loss(params, batch, rng):
        noise = jax.random.normal(rng, ())
        return jax.numpy.mean((batch["x"] * params["w"]) ** 2) + 0.0 * noise, {"noise": noise}

    step = jaxstep.make_train_step(loss, optax.sgd(0.1), backend=backend, has_aux=True)
    state = step.init({"w": np.ones((), np.float32)}, rng=jax.random.key(0))
    for _ in range(2):
        state, out = step(state, {"x": np.ones((16,), np.float32)})
        seen.append(np.asarray(out.aux["noise"]).reshape(-1)[-8:])
    assert len(set(np.round(seen[0], 6))) == 8  # every device its own draw
    assert not np.allclose(seen[0], seen[1])  # a new draw each step


def test_fit_reads_each_table_one_step_late(monkeypatch):
    """Dispatch t, then read t-1: the device queue never drains, at most 2 in flight."""
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2))
    events = []
    dispatch, table = Runtime.dispatch, Runtime.raw_table

    def logged_dispatch(runtime, state, batch, **kw):
        state, out = dispatch(runtime, state, batch, **kw)
        events.append(("dispatch", id(out)))
        return state, out

    def logged_table(runtime, out):
        events.append(("table", id(out)))
        return table(runtime, out)

    monkeypatch.setattr(Runtime, "dispatch", logged_dispatch)
    monkeypatch.setattr(Runtime, "raw_table", logged_table)
    jaxstep.fit(step, step.init(init_params()), make_batches(4))
    kinds = [k for k, _ in events]
    assert kinds == [
        "dispatch",
        "dispatch",
        "table",
        "dispatch",
        "table",
        "dispatch",
        "table",
        "table",
    ]
    outs = [o for k, o in events if k == "dispatch"]
    assert [o for k, o in events if k == "table"] == outs  # each table read once, in order


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
