"""A tiny training step for tests of the code around training (callbacks, loops,
checkpoints): linear regression of 3 features, which compiles in about a second."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxstep._src.core import BackendName
from jaxstep._src.core import TrainState
from jaxstep._src.step import TrainStep
from jaxstep._src.step import make_train_step

#: the weights and bias the data are drawn from
TRUE_W = np.array([[1.0], [-2.0], [0.5]], np.float32)
TRUE_B = np.array([0.3], np.float32)


def tiny_loss(params: Any, batch: Any) -> jax.Array:
    """The mean squared error of ``batch["x"] @ params["w"] + params["b"]``."""
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)


class TinyStep(NamedTuple):
    """A linear regression step and what it trains on (:func:`tiny_step` builds it):
    the mean squared error of ``batch["x"] @ params["w"] + params["b"]``, the data drawn
    from fixed weights.

    Attributes:
      step: the :class:`jaxstep.TrainStep`.

    Example:
      >>> from jaxstep.testing import tiny_step
      >>> tiny = tiny_step(divergence_every=None)
      >>> {name: x.shape for name, x in tiny.params().items()}
      {'w': (3, 1), 'b': (1,)}
      >>> [batch["x"].shape for batch in tiny.batches(2, per_device=4)]  # 8 devices
      [(32, 3), (32, 3)]
    """

    step: TrainStep

    def params(self) -> dict[str, np.ndarray]:
        """The first parameters: zeros, ``{"w": (3, 1), "b": (1,)}`` float32.

        Returns:
          A new dict of numpy arrays.
        """
        return {"w": np.zeros((3, 1), np.float32), "b": np.zeros((1,), np.float32)}

    def state(self) -> TrainState:
        """The first state: ``step.init(params())``.

        Returns:
          A :class:`jaxstep.TrainState` on the step's devices.
        """
        return self.step.init(self.params())

    def batches(self, num: int, *, per_device: int = 2, seed: int = 0) -> list[dict[str, Any]]:
        """Global batches ``{"x": (rows, 3), "y": (rows, 1)}`` float32, ``y`` exactly
        linear in ``x``.

        Args:
          num: how many batches.
          per_device: rows of each batch for each of the step's devices.
          seed: the seed of the draw: the same seed, the same batches.

        Returns:
          A list of ``num`` dicts of numpy arrays.
        """
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
    """A tiny linear regression step, for tests of the code around training (callbacks,
    loops, checkpoints): it compiles in about a second.

    Args:
      backend: ``"shard_map"`` or ``"pmap"``.
      optimizer: an optax transformation (default ``optax.sgd(0.1)``).
      **options: more arguments of :func:`jaxstep.make_train_step`, e.g.
        ``faults=[Fault("grad", device_id=3, step=1)]``.

    Returns:
      A :class:`TinyStep`: the step, and its parameters, state and batches.

    Raises:
      ValueError, TypeError: an option is invalid (as ``make_train_step`` raises it).

    Example:
      >>> from jaxstep.testing import tiny_step
      >>> tiny = tiny_step(divergence_every=None)
      >>> state, out = tiny.step(tiny.state(), tiny.batches(1)[0])
    """
    step = make_train_step(
        tiny_loss, optax.sgd(0.1) if optimizer is None else optimizer, backend=backend, **options
    )
    return TinyStep(step)
