"""The training code under test: a small regression MLP in plain JAX, and its data."""

import jax.numpy as jnp
import numpy as np


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(0, 0.5, (3, 16)).astype(np.float32),
        "b1": np.zeros(16, np.float32),
        "w2": rng.normal(0, 0.5, (16, 1)).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    pred = h @ params["w2"] + params["b2"]
    return jnp.mean((pred - batch["y"]) ** 2)


def make_batches(num, size, seed=1):
    """``num`` global batches of ``size`` rows: ``x`` (size, 3), ``y`` (size, 1)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        x = rng.normal(size=(size, 3)).astype(np.float32)
        out.append({"x": x, "y": np.sin(x.sum(axis=1, keepdims=True))})
    return out
