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

    Example::

        def loss_fn(params, batch):
            per_token = xent(model.apply(params, batch["tokens"]), batch["targets"])
            mask = batch["mask"]
            return jaxstep.WeightedLoss(jnp.sum(per_token * mask), jnp.sum(mask))
    """

    sum: jax.Array
    weight: jax.Array
