"""A loss normalised over the whole global batch: ``loss_fn`` returns the sum over its
chunk and the chunk's weight (its real tokens, say), and the step's gradient is that of
the global weighted mean, as a single device would compute it over the global batch."""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class WeightedLoss:
    """What ``loss_fn`` may return instead of a scalar loss (or as the loss of
    ``(loss, aux)``): the sum of the per-example (per-token) losses over this device's
    chunk, and the chunk's weight (the number of examples or tokens that count). The
    step trains on ``sum over devices of sum / sum over devices of weight``, the
    global weighted mean (lm1b's and every padded-sequence model's normalisation),
    instead of the mean of each device's own mean. A chunk of weight 0 (all padding)
    adds nothing and is no failure.

    Each device's loss in the health table is its sum scaled so that the mean over the
    devices is the global weighted mean. One scalar all-reduce of the weights runs
    before the gradients' (it is needed to scale them). With micro-batches each
    micro-batch is normalised by its own global weight.

    Attributes:
      sum: the sum of the per-example (or per-token) losses over this device's chunk,
        a float scalar.
      weight: what counts in the chunk (examples, real tokens), a scalar >= 0.

    Example:
      The mean over the rows a mask keeps, whatever device holds them (rows 8 to 15 are
      padding, two devices' chunks all of it):

      >>> import jax.numpy as jnp, optax, jaxstep
      >>> def loss_fn(params, batch):
      ...     per_row = (batch["x"] * params["w"] - batch["y"]) ** 2
      ...     return jaxstep.WeightedLoss(jnp.sum(per_row * batch["mask"]), jnp.sum(batch["mask"]))
      >>> step = jaxstep.make_train_step(loss_fn, optax.sgd(0.1))
      >>> mask = jnp.arange(16) < 8
      >>> batch = {"x": jnp.ones(16), "y": jnp.where(mask, 2.0, 100.0), "mask": mask}
      >>> state, out = step(step.init({"w": jnp.zeros(())}), batch)
      >>> round(float(out.metrics["loss"]), 3)  # (2 - 0)**2 on each row kept
      4.0
    """

    sum: jax.Array
    weight: jax.Array
