"""FAILS ON PURPOSE: a model that breaks on one device's rows, and the report the
testing kit gives. tests/testing/test_user_project.py checks the failure and its message."""

import jax.numpy as jnp
import jaxstep
import optax
from jaxstep.testing import assert_matches_reference

from mymodel import init_params
from mymodel import make_batches


def normalized_loss_fn(params, batch):
    """Scales each input row to unit length: 0/0 on an all-zero (padding) row."""
    x = batch["x"] / jnp.linalg.norm(batch["x"], axis=-1, keepdims=True)
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def test_padded_batches_train(jaxstep_devices):
    step = jaxstep.make_train_step(normalized_loss_fn, optax.adam(1e-2))
    (batch,) = make_batches(1, 2 * len(jaxstep_devices))
    batch["x"][-2:] = 0.0  # padded with two zero rows: the last device's chunk
    batch["y"][-2:] = 0.0
    assert_matches_reference(step, init_params(), [batch])
