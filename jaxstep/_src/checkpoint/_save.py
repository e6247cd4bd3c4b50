"""``jaxstep.save``: a state written as a checkpoint outside ``fit``, the one
:func:`jaxstep.restore` and ``fit(..., resume=True)`` read back."""

from __future__ import annotations

import os

import numpy as np

from jaxstep._src.checkpoint._position import Source
from jaxstep._src.checkpoint._saver import Saver
from jaxstep._src.checkpoint._store import Store
from jaxstep._src.core import TrainState
from jaxstep._src.step import TrainStep
from jaxstep._src.step import runtime_of


def save(
    step: TrainStep,
    state: TrainState,
    checkpoint_dir: str | os.PathLike[str],
    *,
    keep: int | None = None,
) -> str:
    """Saves ``state`` as the checkpoint of its step in ``checkpoint_dir``.

    The checkpoint is verified when every device holds the same copy of the state (the
    replicas are compared first), and holds one copy of every leaf, whole, as
    ``fit(..., checkpoint_dir=...)``'s do: :func:`jaxstep.restore` reads it back onto
    any device count, either backend and any layout, and ``fit(..., resume=True)``
    goes on from it. It has no data position: a resume feeds ``batches(state.step)``
    when ``batches`` is a callable, and otherwise the batches as given. ``fit`` saves
    its last state itself when checkpoints are on; this is for a state made or changed
    outside it. With several processes, every process calls it alike (process 0
    writes; under a sharded layout each process writes its own blocks).

    Args:
      step: the step ``state`` belongs to.
      state: the state to save (not donated).
      checkpoint_dir: the checkpoint directory (made when missing).
      keep: the newest checkpoints kept there (None: all).

    Returns:
      The path of the checkpoint (``checkpoint_dir/<step>``).

    Raises:
      ValueError, TypeError: ``state`` does not fit ``step``, or the directory cannot
        be written.

    Example:
      >>> import jax.numpy as jnp, optax, jaxstep, tempfile
      >>> step = jaxstep.make_train_step(
      ...     lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2), optax.sgd(0.1))
      >>> where = tempfile.mkdtemp()
      >>> path = jaxstep.save(step, step.init({"w": jnp.ones(())}), where)
      >>> float(jaxstep.restore(step, where).params["w"])
      1.0
    """
    runtime = runtime_of(step)
    runtime.check_state(state)
    number = int(np.asarray(runtime.read_first(state.step)))
    store = Store(checkpoint_dir, keep=keep, create=True)
    saver = Saver(runtime, store, None, Source([], 0), number)
    try:
        return saver.save_now(state, None, "when jaxstep.save saved it")
    finally:
        saver.close()
