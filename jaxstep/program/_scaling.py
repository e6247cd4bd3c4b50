"""Dynamic loss scaling for fp16: the loss is multiplied by a scale before
differentiating, each device finds its own overflow before the all-reduce, an
overflowing step is skipped everywhere and the scale backs off; after a run of good
steps it grows again. bf16 has float32's range and needs none of this."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


class LossScaleState(NamedTuple):
    """The scale in the training state: ``scale`` (float32) and the good steps since
    it last changed (``good_steps``, int32)."""

    scale: jax.Array
    good_steps: jax.Array


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """``make_train_step(..., loss_scale=DynamicLossScale())``.

    Attributes:
      scale: the first scale.
      growth_interval: good steps in a row after which the scale grows.
      growth_factor: what it grows by.
      backoff_factor: what it is multiplied by after an overflow.
      minimum_scale: an overflow at this scale is a failure (``TrainingWorkerError``
        naming the devices that overflowed), not a skip.
    """

    scale: float = 2.0**15
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    minimum_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.minimum_scale > 0 or not self.scale >= self.minimum_scale:
            raise ValueError(
                f"need scale >= minimum_scale > 0, got scale={self.scale}, "
                f"minimum_scale={self.minimum_scale}"
            )
        if not 0 < self.backoff_factor < 1 or not self.growth_factor >= 1:
            raise ValueError(
                f"need 0 < backoff_factor < 1 and growth_factor >= 1, got "
                f"{self.backoff_factor}, {self.growth_factor}"
            )
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise ValueError(f"growth_interval must be an int >= 1, got {self.growth_interval!r}")

    def init(self) -> LossScaleState:
        return LossScaleState(jnp.asarray(self.scale, jnp.float32), jnp.zeros((), jnp.int32))

    def at_minimum(self, state: LossScaleState) -> jax.Array:
        return state.scale <= self.minimum_scale

    def update(self, state: LossScaleState, overflow: jax.Array, ok: jax.Array) -> LossScaleState:
        """After an overflow: back off; after a good step: count it, grow at the interval."""
        good = jnp.where(ok, state.good_steps + 1, 0)
        grow = good >= self.growth_interval
        scale = jnp.where(grow, state.scale * self.growth_factor, state.scale)
        scale = jnp.where(
            overflow, jnp.maximum(state.scale * self.backoff_factor, self.minimum_scale), scale
        )
        good = jnp.where(grow | overflow, 0, good).astype(jnp.int32)
        return LossScaleState(scale.astype(jnp.float32), good)
