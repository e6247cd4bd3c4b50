"""Dynamic loss scaling for fp16: the loss is multiplied by a scale before
differentiating, each device finds its own overflow before the all-reduce, an
overflowing step is skipped everywhere and the scale backs off; after a run of good
steps it grows again, exactly as flax's ``DynamicScale``. bf16 has float32's range and
needs none of this."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The state's type lives with the state (core). Imported here by name, it also keeps
# the pickled tree structure of a checkpoint saved before it moved loading
# (``jaxstep._src.program._scaling.LossScaleState``).
from jaxstep._src.core import LossScaleState

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """``make_train_step(..., loss_scale=DynamicLossScale())``: a drop-in for flax's
    ``flax.training.dynamic_scale.DynamicScale``, with the same arguments, defaults and
    scale sequence.

    As in flax, after each step:

    - a step whose scaled gradients overflowed is skipped and the scale becomes
      ``max(scale * backoff_factor, minimum_scale)`` (no floor when ``minimum_scale``
      is None); the count of good steps restarts at 0;
    - a good step that finds ``growth_interval`` good steps already counted multiplies
      the scale by ``growth_factor`` (at most float32's largest value) and restarts the
      count at 0; any other good step adds one to the count. So the scale first grows
      after ``growth_interval + 1`` good steps in a row, and the step that grows it
      still trains with the old scale.

    Where jaxstep departs from flax, on purpose:

    - Overflow is found on each device, before the all-reduce (``Status.OVERFLOW`` in
      that device's row, recorded and not a failure); flax checks the reduced
      gradients. The steps skipped are the same: a non-finite gradient anywhere makes
      the mean non-finite.
    - Only an overflow of the scaled gradients is an overflow: a non-finite input or
      unscaled loss is a failure (flax would back off and skip it too). A step skipped
      for another failure (``on_failure="skip"``), or one after the state halted,
      leaves the scale and the count as they were.
    - An overflow when backing off cannot lower the scale any more (at
      ``minimum_scale``, or at 0 without one) raises a ``TrainingWorkerError`` naming
      the devices, where flax would skip every step from then on without a word. The
      default floor is flax's (float32's smallest normal number, ~1.2e-38): no run
      that flax trains reaches it.

    Its fields are flax's arguments, with flax's names and defaults.

    Attributes:
      scale: the first scale (``2.0**16``).
      growth_interval: the good steps counted before the next good one grows the
        scale (2000).
      growth_factor: what the scale grows by (2.0).
      backoff_factor: what it is multiplied by after an overflow (0.5).
      minimum_scale: the floor of the scale (``jnp.finfo(jnp.float32).tiny``), or None
        for none.

    Example:
      >>> import jaxstep
      >>> jaxstep.DynamicLossScale(growth_interval=1000).scale
      65536.0
    """

    scale: float = 2.0**16
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    minimum_scale: float | None = _FLOAT32_TINY

    def __post_init__(self) -> None:
        floor = 0.0 if self.minimum_scale is None else self.minimum_scale
        if self.minimum_scale is not None and not self.minimum_scale > 0:
            raise ValueError(f"need minimum_scale > 0 or None, got {self.minimum_scale}")
        if not self.scale > 0 or not self.scale >= floor:
            raise ValueError(
                f"need scale > 0 and scale >= minimum_scale, got scale={self.scale}, "
                f"minimum_scale={self.minimum_scale}"
            )
        if not 0 < self.backoff_factor < 1 or not self.growth_factor >= 1:
            raise ValueError(
                f"need 0 < backoff_factor < 1 and growth_factor >= 1, got "
                f"{self.backoff_factor}, {self.growth_factor}"
            )
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 0):
            raise ValueError(f"growth_interval must be an int >= 0, got {self.growth_interval!r}")

    def init(self) -> LossScaleState:
        """The scale's first state (what ``step.init`` puts in ``state.loss_scale``).

        Returns:
          ``LossScaleState(scale, good_steps=0)``.
        """
        return LossScaleState(jnp.asarray(self.scale, jnp.float32), jnp.zeros((), jnp.int32))

    def scale_loss(self, state: LossScaleState, loss: jax.Array) -> jax.Array:
        """The loss times the scale, as flax: in the loss's dtype, or float32 when wider.

        Args:
          state: the scale's state (``state.loss_scale``).
          loss: the unscaled loss.

        Returns:
          The scaled loss, what the step differentiates.
        """
        return loss * state.scale.astype(jnp.promote_types(loss.dtype, jnp.float32))

    def unscale(self, state: LossScaleState, grads: Any) -> Any:
        """The gradients divided by the scale in float32 (as flax; a scale of 2**16 is
        beyond fp16), then cast back to each gradient's dtype.

        Args:
          state: the scale's state.
          grads: the gradients of the scaled loss (a pytree).

        Returns:
          The gradients of the loss itself.
        """
        return jax.tree.map(lambda g: (g.astype(jnp.float32) / state.scale).astype(g.dtype), grads)

    def _backed_off(self, scale: jax.Array) -> jax.Array:
        lowered = scale * self.backoff_factor
        return lowered if self.minimum_scale is None else jnp.maximum(lowered, self.minimum_scale)

    def at_minimum(self, state: LossScaleState) -> jax.Array:
        """Whether backing off would leave the scale where it is (an overflow there
        fails the step).

        Args:
          state: the scale's state.

        Returns:
          A boolean scalar.
        """
        return self._backed_off(state.scale) >= state.scale

    def update(self, state: LossScaleState, overflow: jax.Array, ok: jax.Array) -> LossScaleState:
        """flax's update of the scale after a step.

        Args:
          state: the scale's state before the step.
          overflow: the step was skipped for an overflow alone (the scale backs off).
          ok: the step trained (the count of good steps grows, or the scale does).
            Neither (another failure, or halted): nothing changes.

        Returns:
          The scale's state after the step.
        """
        grow = state.good_steps == self.growth_interval
        grown = jnp.minimum(state.scale * self.growth_factor, _FLOAT32_MAX)
        scale = jnp.where(ok & grow, grown, state.scale)
        scale = jnp.where(overflow, self._backed_off(state.scale), scale)
        good = jnp.where(grow | overflow, 0, state.good_steps + 1)
        good = jnp.where(ok | overflow, good, state.good_steps)
        return LossScaleState(scale.astype(jnp.float32), good.astype(jnp.int32))
