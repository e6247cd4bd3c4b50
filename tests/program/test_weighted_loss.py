"""Token-weighted losses (lm1b and every padded-sequence model): loss_fn returns
``jaxstep.WeightedLoss(sum, weight)`` and the step trains on the global batch's
weighted mean, as one device would; a chunk of all padding trains through. Both
backends."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstep

V, D, L = 11, 6, 5  # vocabulary, width, sequence length


def _params():
    rng = np.random.default_rng(0)
    return {
        "embed": rng.normal(0, 0.5, (V, D)).astype(np.float32),
        "out": rng.normal(0, 0.5, (D, V)).astype(np.float32),
    }


def _per_token(params, batch):
    logits = params["embed"][batch["tokens"]] @ params["out"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])


def _batches(num, n):
    rng = np.random.default_rng(1)
    out = []
    for _ in range(num):
        size = 4 * n
        lengths = rng.integers(1, L + 1, size)
        lengths[3 * 4 : 4 * 4] = 0  # device 3's rows: all padding
        mask = (np.arange(L)[None, :] < lengths[:, None]).astype(np.float32)
        out.append(
            {
                "tokens": rng.integers(0, V, (size, L)).astype(np.int32),
                "targets": rng.integers(0, V, (size, L)).astype(np.int32),
                "mask": mask,
            }
        )
    return out


def test_a_weighted_loss_trains_on_the_global_token_mean(backend):
    n = len(jax.devices())
    batches = _batches(6, n)

    def loss_fn(params, batch):
        mask = batch["mask"]
        return jaxstep.WeightedLoss(jnp.sum(_per_token(params, batch) * mask), jnp.sum(mask))

    optimizer = optax.adam(1e-2)
    step = jaxstep.make_train_step(loss_fn, optimizer, backend=backend)
    history = jaxstep.History()
    state = jaxstep.fit(step, step.init(_params()), batches, history=history)
    assert not any(history.skipped)

    @jax.jit
    def reference(params, opt_state, batch):  # one device, the whole global batch
        def loss(p):
            mask = batch["mask"]
            return jnp.sum(_per_token(p, batch) * mask) / jnp.sum(mask)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = jax.tree.map(jnp.asarray, _params())
    opt_state, losses = optimizer.init(params), []
    for batch in batches:
        params, opt_state, value = reference(params, opt_state, batch)
        losses.append(float(value))
    got = step.host_state(state).params
    for name in params:
        np.testing.assert_allclose(
            np.asarray(got[name]), np.asarray(params[name]), rtol=2e-5, atol=2e-6
        )
    np.testing.assert_allclose(history.loss, losses, rtol=1e-5)


def test_a_weighted_loss_is_checked_like_a_loss():
    step = jaxstep.make_train_step(
        lambda p, b: jaxstep.WeightedLoss(jnp.sum(b * p["w"], axis=-1), jnp.ones(())),
        optax.sgd(0.1),
    )
    with pytest.raises(TypeError, match=r"WeightedLoss.sum must be a float scalar"):
        step(step.init({"w": jnp.ones(3)}), np.ones((16, 3), np.float32))
