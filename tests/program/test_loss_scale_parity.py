"""jaxstep.DynamicLossScale against flax's DynamicScale, the class fp16 users port
from: the same defaults, and over an fp16 run the same skipped steps, the same scale
after every step and the same parameters as flax + optax by hand on one device over
the global batch."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.dynamic_scale import DynamicScale

import jaxstep
from jaxstep import Status

N = 8  # devices
PER_DEVICE = 2
BATCH = N * PER_DEVICE
STEPS = 20
SPIKES = {5: 3, 6: 0, 13: 7}  # step -> the device whose chunk gets a far-off target
OPTIMIZER = optax.adam(1e-3)


def _loss(params, batch):
    # fp16 compute, float32 loss: the scaled backward pass overflows fp16 first.
    x = batch["x"].astype(jnp.float16)
    pred = x @ params["w"].astype(jnp.float16) + params["b"].astype(jnp.float16)
    return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)


def _params():
    return {"w": np.full((4, 1), 0.5, np.float32), "b": np.zeros((1,), np.float32)}


def _batches():
    """Targets a hair off the first parameters, so that no scaled gradient overflows
    fp16 on its own; at the steps in SPIKES one row's target is 1000 away, which
    overflows on that device (and in the global batch) at any scale used here."""
    rng = np.random.default_rng(0)
    out = []
    for s in range(STEPS):
        x = rng.normal(size=(BATCH, 4)).astype(np.float32)
        y = (x @ np.full((4, 1), 0.5) + 0.01 * rng.normal(size=(BATCH, 1))).astype(np.float32)
        if s in SPIKES:
            y[SPIKES[s] * PER_DEVICE] += 1000.0
        out.append({"x": x, "y": y})
    return out


def _flax_run(batches):
    """The port's starting point: flax's DynamicScale and optax on one device."""

    @jax.jit
    def train(dyn, params, opt_state, batch):
        dyn, finite, _, grads = dyn.value_and_grad(_loss)(params, batch)
        updates, new_opt_state = OPTIMIZER.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
        return dyn, finite, keep(new_params, params), keep(new_opt_state, opt_state)

    dyn = DynamicScale(growth_interval=3)
    params = jax.tree.map(jnp.asarray, _params())
    opt_state = OPTIMIZER.init(params)
    skipped, scales = [], []
    for s, batch in enumerate(batches):
        dyn, finite, params, opt_state = train(dyn, params, opt_state, batch)
        if not bool(finite):
            skipped.append(s)
        scales.append(float(dyn.scale))
    return skipped, scales, params


def test_the_defaults_are_flax_dynamic_scales():
    ours, theirs = jaxstep.DynamicLossScale(), DynamicScale()
    for field in dataclasses.fields(ours):
        assert getattr(ours, field.name) == pytest.approx(getattr(theirs, field.name))
    assert ours.scale == 2.0**16


def test_an_fp16_run_skips_rescales_and_trains_as_flax_dynamic_scale(backend):
    batches = _batches()
    step = jaxstep.make_train_step(
        _loss,
        OPTIMIZER,
        backend=backend,
        loss_scale=jaxstep.DynamicLossScale(growth_interval=3),
        divergence_every=None,
    )
    state = step.init(_params())
    skipped, scales = [], []
    for s, batch in enumerate(batches):
        state, out = step(state, batch)
        table = step.table(out)
        # each overflow is recorded on the device that overflowed alone, and no failure
        expected = [Status.OVERFLOW if s in SPIKES and i == SPIKES[s] else 0 for i in range(N)]
        assert [Status(int(x)) for x in table.status] == expected, s
        assert not table.failed
        if table.skipped:
            skipped.append(s)
        scales.append(float(np.asarray(step.host_state(state).loss_scale.scale)))

    flax_skipped, flax_scales, flax_params = _flax_run(batches)
    assert skipped == flax_skipped == sorted(SPIKES)
    assert scales == flax_scales
    # grown after interval + 1 good steps, backed off at each overflow
    assert max(scales) == 2.0**17 and min(scales) == 2.0**15
    # fp16 sums over each device's chunk against sums over the whole batch: the
    # parameters (~0.5, moved ~1e-2 by adam) agree to a few fp16 roundings
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
        step.host_state(state).params,
        flax_params,
    )


def test_the_scale_update_follows_flax_step_by_step():
    """Every branch of flax's update (grow, back off, the floor, growth's cap) from the
    same starting points: flax's own code computes the expectation."""
    ours = jaxstep.DynamicLossScale(scale=4.0, growth_interval=2, minimum_scale=1.0)
    theirs = DynamicScale(growth_interval=2, scale=4.0, minimum_scale=1.0)
    state = ours.init()
    # finite steps and overflows in a row, enough to reach the floor and grow again
    pattern = [1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1]
    for finite in pattern:
        factor = 1.0 if finite else jnp.inf
        theirs, _, _, _ = theirs.value_and_grad(lambda p, f=factor: p * f)(1.0)
        ok = jnp.asarray(bool(finite))
        state = ours.update(state, overflow=~ok, ok=ok)
        assert float(state.scale) == float(theirs.scale)
        assert int(state.good_steps) == int(theirs.fin_steps)
    big = jaxstep.DynamicLossScale(scale=2.0**127, growth_interval=0)
    grown = big.update(big.init(), overflow=jnp.asarray(False), ok=jnp.asarray(True))
    assert float(grown.scale) == float(np.finfo(np.float32).max)


def test_fp16_parameters_train_at_the_default_scale_beyond_fp16s_range(backend):
    """2**16 is infinite in fp16: the gradients are unscaled in float32, as flax does,
    not divided by an infinite scale into zeros."""
    params = jax.tree.map(lambda x: x.astype(np.float16), _params())
    batches = _batches()[:3]
    step = jaxstep.make_train_step(
        _loss, optax.sgd(0.1), backend=backend, loss_scale=jaxstep.DynamicLossScale()
    )
    state = step.init(params)
    for batch in batches:
        state, out = step(state, batch)
        assert not step.table(out).skipped
    ours = step.host_state(state).params

    dyn, theirs = DynamicScale(), params
    for batch in batches:
        dyn, finite, _, grads = dyn.value_and_grad(_loss)(theirs, batch)
        assert bool(finite)
        theirs = optax.apply_updates(theirs, jax.tree.map(lambda g: -0.1 * g, grads))
    assert not np.array_equal(ours["w"], params["w"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-3), ours, theirs)
