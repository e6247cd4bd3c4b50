"""A tiny training step for tests of the code around training (callbacks, loops,
checkpoints): linear regression of 3 features, which compiles in about a second."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxstep.core import BackendName
from jaxstep.core import TrainState
from jaxstep.step import TrainStep
from jaxstep.step import make_train_step

#: the weights and bias the data are drawn from
TRUE_W = np.array([[1.0], [-2.0], [0.5]], np.float32)
TRUE_B = np.array([0.3], np.float32)


def tiny_loss(params: Any, batch: Any) -> jax.Array:
    """The mean squared error of ``batch["x"] @ params["w"] + params["b"]``."""
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)


class TinyStep(NamedTuple):
    """A linear regression step (``step``) and what it trains on.

    ``params()`` are zeros (``{"w": (3, 1), "b": (1,)}``), ``state()`` is
    ``step.init(params())``, ``batches(num)`` gives global batches of
    ``{"x": (rows, 3), "y": (rows, 1)}`` with ``per_device`` rows for each device.
    """

    step: TrainStep

    def params(self) -> dict[str, np.ndarray]:
        return {"w": np.zeros((3, 1), np.float32), "b": np.zeros((1,), np.float32)}

    def state(self) -> TrainState:
        return self.step.init(self.params())

    def batches(self, num: int, *, per_device: int = 2, seed: int = 0) -> list[dict[str, Any]]:
        rng = np.random.default_rng(seed)
        rows = per_device * len(self.step.devices)
        out = []
        for _ in range(num):
            x = rng.normal(size=(rows, 3)).astype(np.float32)
            out.append({"x": x, "y": x @ TRUE_W + TRUE_B})
        return out


def tiny_step(
    *,
    backend: BackendName = "shard_map",
    optimizer: optax.GradientTransformation | None = None,
    **options: Any,
) -> TinyStep:
    """A :class:`TinyStep` built by ``make_train_step(tiny_loss, optimizer, backend=backend,
    **options)`` (default optimizer: ``optax.sgd(0.1)``); ``options`` are
    ``make_train_step``'s, e.g. ``faults=[Fault("grad", device_id=3, step=1)]``.

    Example:
      >>> from jaxstep.testing import tiny_step
      >>> tiny = tiny_step(divergence_every=None)
      >>> state, out = tiny.step(tiny.state(), tiny.batches(1)[0])
    """
    step = make_train_step(
        tiny_loss, optax.sgd(0.1) if optimizer is None else optimizer, backend=backend, **options
    )
    return TinyStep(step)
