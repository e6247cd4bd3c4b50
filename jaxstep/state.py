"""The training state: a pytree of arrays and nothing else, so it checkpoints,
pickles and transfers as plain data. Functions (loss, optimizer, mesh) live in the
step object."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct


@struct.dataclass
class TrainState:
    """Everything a step reads and writes.

    Attributes:
      step: steps taken (skipped steps count: they consumed a batch).
      params: the model parameters.
      opt_state: the optimizer state.
      rng: a PRNG key, or None. When set, ``loss_fn(params, batch, rng)`` gets a key
        folded with the step and the device's position, so every device draws its
        own numbers and a replay draws the same ones.
      halted: True once a step failed under the ``raise`` policy (or too many skips
        in a row): every later step leaves the state unchanged.
      consecutive_skips: skipped steps in a row (``skip`` policy).
      total_skips: skipped steps in all.
      monitor: memory of the cross-step checks (the loss-spike window), a dict.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array | None
    halted: jax.Array
    consecutive_skips: jax.Array
    total_skips: jax.Array
    monitor: dict[str, Any]
