"""Pre-split batches ``(n_devices, per_device, ...)``: a first call that took one flat
(as ``n`` examples, with a warning to pass ``presplit=True``) does not hold the step to
that layout once the user does as told; a pre-split batch without the option is
refused with the fix, named for ``step`` and for ``fit``."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstep

N = 8  # the fake CPU devices


def _loss(params, batch):
    return jnp.mean((batch["x"] * params["w"] - batch["y"]) ** 2)


def _step(backend, loss=_loss):
    return jaxstep.make_train_step(loss, optax.sgd(0.1), backend=backend)


def _params():
    return {"w": jnp.zeros(())}


def _split_batches(count=3):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(N, 4, 1)).astype(np.float32),
            "y": np.ones((N, 4, 1), np.float32),
        }
        for _ in range(count)
    ]


def _flat(batch):
    return jax.tree.map(lambda x: x.reshape(N * 4, *x.shape[2:]), batch)


def _w(step, state):
    return np.asarray(step.host_state(state).params["w"])


def _fit_flat_by_mistake(step, batches):
    """``fit`` on pre-split batches without the option: they train as N examples each,
    with the warning that says to pass ``presplit=True``."""
    with pytest.warns(UserWarning, match=r"fit\(\.\.\., presplit=True\)"):
        return jaxstep.fit(step, step.init(_params()), batches)


def test_a_fresh_state_after_a_presplit_batch_taken_flat_trains_with_presplit(backend):
    batches = _split_batches()
    step = _step(backend)
    _fit_flat_by_mistake(step, batches)
    # as the warning says, with the same step and a fresh state
    state = jaxstep.fit(step, step.init(_params()), batches, presplit=True)
    clean = _step(backend)
    want = jaxstep.fit(clean, clean.init(_params()), batches, presplit=True)
    np.testing.assert_array_equal(_w(step, state), _w(clean, want))
    assert int(step.host_state(state).step) == 3


@pytest.mark.parametrize("how", ["presplit", "global batch", "presplit, watched"])
def test_the_same_state_goes_on_when_the_batches_come_as_the_warning_says(backend, how):
    batches = _split_batches()
    step = _step(backend)
    state = _fit_flat_by_mistake(step, batches[:1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no refusal
        if how == "global batch":
            state = jaxstep.fit(step, state, [_flat(b) for b in batches[1:]])
        else:  # under step_timeout the loop joins the batches before the step sees them
            timeout = 60.0 if how == "presplit, watched" else None
            state = jaxstep.fit(step, state, batches[1:], presplit=True, step_timeout=timeout)
    assert int(step.host_state(state).step) == 3
    # the global layout is the one held now: a pre-split batch without the option is refused
    with pytest.raises(ValueError, match=r"fit\(\.\.\., presplit=True\)"):
        step(state, batches[0])


def test_a_presplit_batch_without_the_option_after_presplit_ones_is_refused(backend):
    batches = _split_batches()
    step = _step(backend)
    state = jaxstep.fit(step, step.init(_params()), batches[:2], presplit=True)
    for run in (lambda: step(state, batches[2]), lambda: jaxstep.fit(step, state, batches[2:])):
        with pytest.raises(ValueError, match=r"looks pre-split") as info:
            run()
        assert "step(state, batch, presplit=True)" in str(info.value)
        assert "fit(..., presplit=True)" in str(info.value)
    state = jaxstep.fit(step, state, batches[2:], presplit=True)  # nothing was lost
    assert int(step.host_state(state).step) == 3


def test_a_presplit_batch_that_fails_to_trace_names_the_option_for_step_and_fit(backend):
    def loss(params, batch):
        rows, features = batch["x"].shape  # a model written for (rows, features)
        return _loss(params, batch) + 0.0 * rows * features

    batches = _split_batches(1)
    for run in ("step", "fit"):
        step = _step(backend, loss)
        state = step.init(_params())
        with pytest.warns(UserWarning), pytest.raises(ValueError) as info:
            if run == "step":
                step(state, batches[0])
            else:
                jaxstep.fit(step, state, batches)
        message = str(info.value)
        assert message.startswith("tracing the step failed (ValueError: too many values")
        assert "step(state, batch, presplit=True)" in message
        assert "fit(..., presplit=True)" in message
        state, out = step(state, batches[0], presplit=True)  # the state is still usable
        assert not step.table(out).failed


def test_two_axis_leaves_taken_flat_then_passed_presplit_or_afresh_train(backend):
    """Leaves of two axes, ``(n_devices, per_device)``, look like a global batch of
    feature rows (no warning): the option, or a fresh state, still takes the new
    layout; only the same state with a layout of fewer axes and no option is refused."""
    rng = np.random.default_rng(1)
    split = {"x": rng.normal(size=(N, 4)).astype(np.float32), "y": np.ones((N, 4), np.float32)}
    step = _step(backend)
    state, _ = step(step.init(_params()), split)  # N examples of 4 features
    with pytest.raises(ValueError, match=r"keeps its number of axes"):
        step(state, _flat(split))
    state, out = step(state, split, presplit=True)  # the same state, as pre-split
    assert not step.table(out).failed
    step(step.init(_params()), split)  # N examples of 4 features again, from a fresh state
    state, out = step(step.init(_params()), _flat(split))  # and a fresh one: the global batch
    assert not step.table(out).failed
