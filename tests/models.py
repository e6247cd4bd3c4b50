"""A small named MLP and batch makers shared by the tests."""

from __future__ import annotations

import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

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


class HostFault:
    """A fault the test springs: :meth:`loss` is :func:`loss_fn` plus a host callback on
    each device, and once :meth:`arm` ed, the next call on ``devices[position]`` makes
    its loss NaN (``stall=None``) or sleeps ``stall`` seconds; then it is spent. A
    ``jaxstep.testing.Fault`` fires in a step's first run; this one fires when the test
    says, e.g. from a callback's ``on_recovery``: in a step run again only."""

    def __init__(self, position: int, stall: float | None = None, axis: str = "devices"):
        self.position, self.stall, self.axis = position, stall, axis
        self.armed = False
        self.fired = 0
        self._lock = threading.Lock()  # the devices call it from their own threads

    def arm(self) -> None:
        self.armed = True

    def loss(self, params, batch):
        shape = jax.ShapeDtypeStruct((), jnp.float32)
        term = io_callback(self._call, shape, jax.lax.axis_index(self.axis))
        return loss_fn(params, batch) + term

    def _call(self, position) -> np.ndarray:
        with self._lock:
            hit = self.armed and int(position) == self.position
            if hit:
                self.armed = False
                self.fired += 1
        if hit and self.stall is not None:
            time.sleep(self.stall)
        return np.asarray(np.nan if hit and self.stall is None else 0.0, np.float32)


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


def seq_loss_fn(params, batch):
    """:func:`loss_fn` over the mean of a sequence axis (sst2-like, padded lengths)."""
    return loss_fn(params, dict(batch, x=batch["x"].mean(axis=1)))


def bucketed_batches(lengths, seed: int = 1) -> list[dict]:
    """Batches of :data:`BATCH` rows for :func:`seq_loss_fn`, one per length in
    ``lengths`` (bucketed sequence lengths: ``x`` is ``(BATCH, length, 3)``)."""
    rng = np.random.default_rng(seed)
    out = []
    for length in lengths:
        x = rng.normal(size=(BATCH, length, 3)).astype(np.float32)
        y = np.sin(x.mean(axis=1).sum(axis=1, keepdims=True)).astype(np.float32)
        ones, zeros = np.ones((BATCH, 1), np.float32), np.zeros((BATCH,), np.float32)
        out.append({"x": x, "y": y, "pos": ones, "poison": zeros})
    return out


def fit_recording(step, state, batches, **kw):
    """``jaxstep.fit`` with a new History and every warning recorded: (state, history,
    the warnings' messages)."""
    import jaxstep

    history = jaxstep.History()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = jaxstep.fit(step, state, batches, history=history, **kw)
    return state, history, [str(w.message) for w in caught]


class RaiseAt:
    """A callback that raises ``exc`` at the end of step ``at``."""

    def __init__(self, at, exc):
        self.at, self.exc = at, exc

    def on_step_end(self, table):
        if table.step == self.at:
            raise self.exc


def rows_of(position: int) -> slice:
    """The rows of the global batch that land on ``devices[position]``."""
    return slice(position * PER_DEVICE, (position + 1) * PER_DEVICE)


def host_params(step, state) -> dict:
    return jax.tree.map(np.asarray, step.host_state(state).params)


def assert_params_equal(step, a, b, b_step=None) -> None:
    """The parameters of states ``a`` (of ``step``) and ``b`` (of ``b_step``, default
    ``step``) are bitwise equal, leaf by leaf."""
    left = jax.tree.leaves(host_params(step, a))
    right = jax.tree.leaves(host_params(b_step or step, b))
    for x, y in zip(left, right, strict=True):
        np.testing.assert_array_equal(x, y)
