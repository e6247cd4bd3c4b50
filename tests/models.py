"""A small named MLP and batch makers shared by the tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

N = 8  # devices
PER_DEVICE = 4
BATCH = N * PER_DEVICE


def init_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "dense1": {
            "kernel": rng.normal(0, 0.5, (3, 8)).astype(np.float32),
            "bias": np.zeros(8, np.float32),
        },
        "dense2": {
            "kernel": rng.normal(0, 0.5, (8, 1)).astype(np.float32),
            "bias": np.zeros(1, np.float32),
        },
    }


@jax.custom_vjp
def poison_grad(x, flag):
    """Identity whose gradient turns infinite when ``flag`` is set."""
    return x


def _poison_fwd(x, flag):
    return x, flag


def _poison_bwd(flag, g):
    return jnp.where(flag, jnp.inf, g), None


poison_grad.defvjp(_poison_fwd, _poison_bwd)


def loss_fn(params, batch):
    """MSE plus two terms the tests use to make one device fail on purpose:
    ``log(pos)`` (NaN loss when pos < 0) and ``poison`` (inf gradient in
    dense2.kernel while the loss stays finite)."""
    kernel2 = poison_grad(params["dense2"]["kernel"], jnp.any(batch["poison"] > 0))
    h = jnp.tanh(batch["x"] @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    pred = h @ kernel2 + params["dense2"]["bias"]
    return jnp.mean((pred - batch["y"]) ** 2) + 1e-3 * jnp.mean(jnp.log(batch["pos"]))


def loss_with_checks(params, batch):
    loss = loss_fn(params, batch)
    checks = {"y_bounded": jnp.all(jnp.abs(batch["y"]) < 100.0), "loss_finite": jnp.isfinite(loss)}
    return loss, {"checks": checks, "mean_y": jnp.mean(batch["y"])}


def make_batches(num: int, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        x = rng.normal(size=(BATCH, 3)).astype(np.float32)
        out.append(
            {
                "x": x,
                "y": np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32),
                "pos": np.ones((BATCH, 1), np.float32),
                "poison": np.zeros((BATCH,), np.float32),
            }
        )
    return out


def rows_of(position: int) -> slice:
    """The rows of the global batch that land on ``devices[position]``."""
    return slice(position * PER_DEVICE, (position + 1) * PER_DEVICE)


def host_params(step, state) -> dict:
    return jax.tree.map(np.asarray, step.host_state(state).params)
