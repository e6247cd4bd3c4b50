"""``jaxstep.save``: a state written as a checkpoint outside ``fit``, the one
:func:`jaxstep.restore` and ``fit(..., resume=True)`` read back."""

from __future__ import annotations

import os

import numpy as np

from jaxstep._src.checkpoint._position import Source
from jaxstep._src.checkpoint._saver import Saver
from jaxstep._src.checkpoint._store import Store
from jaxstep._src.core import TrainState
from jaxstep._src.core import warn
from jaxstep._src.core.names import keystrs
from jaxstep._src.step import Runtime
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
    replicas are compared first; when they differ it is written marked not verified,
    which ``restore`` and ``resume`` pass over, with a warning naming the devices and
    a copy to save instead), and holds one copy of every leaf, whole, as
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
    differ = runtime.differing(state)  # (every process calls it alike)
    try:
        where = saver.save_now(state, None, "when jaxstep.save saved it", verified=not differ)
    finally:
        saver.close()
    if differ:
        warn(_unverified(runtime, state, differ, number, where))
    return where


def _unverified(
    runtime: Runtime, state: TrainState, differ: dict[int, int], number: int, where: str
) -> str:
    """What :func:`save` tells a user whose state's copies differ (``differ``: the
    positions of the devices outside a majority, each with the first leaf where)."""
    names = keystrs(state.params, "params") + keystrs(state.opt_state, "opt_state")
    names += keystrs(state.model_state, "model_state")
    leaf = names[next(iter(differ.values()))]
    ids = [runtime.devices[i].id for i in differ]
    n, k = len(runtime.devices), runtime.options.replicas
    # A copy is whole on each device (replicas=1) or spread over a group's n/k devices:
    # a good one is a copy no differing device holds part of.
    span = 1 if k == 1 else n // k
    good = [i for i in range(0, n, span) if not any(j in differ for j in range(i, i + span))]
    if good:
        what = f"{_devices(ids)} a copy that a majority of the devices does not"
        fix = (
            "To write one they resume from, save a state whose copies agree, e.g. "
            f"jaxstep.replica_state(step, state, {good[0]}) (device "
            f"{runtime.devices[good[0]].id}'s copy, the majority's)"
        )
    else:
        what = f"{_devices(ids)} copies that differ, and no majority tells which is right"
        fix = "Go on from the latest verified checkpoint (jaxstep.restore(step, checkpoint_dir))"
    return (
        f"jaxstep.save: the copies of the state differ: {what} (first in {leaf}). The "
        f"checkpoint of step {number} is written to {where} but marked not verified: "
        f"jaxstep.restore and fit(..., resume=True) pass over it (restore(..., at={number}) "
        f"reads it, with a warning). {fix}"
    )


def _devices(ids: list[int]) -> str:
    if len(ids) == 1:
        return f"device {ids[0]} holds"
    return f"devices {', '.join(map(str, ids[:-1]))} and {ids[-1]} hold"
