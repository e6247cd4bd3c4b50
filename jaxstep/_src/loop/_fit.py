"""The host loop: dispatch step t, then read the (already finished) health table of
step t-1. The device queue never drains and at most two steps are in flight."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

from jaxstep._src.checkpoint import CheckpointOptions
from jaxstep._src.checkpoint import begin_fit
from jaxstep._src.core import TrainState
from jaxstep._src.core import warn
from jaxstep._src.loop._checkpoints import FitCheckpoints
from jaxstep._src.loop._driver import Loop
from jaxstep._src.loop._history import History
from jaxstep._src.loop._options import FitOptions
from jaxstep._src.loop._options import Recover
from jaxstep._src.loop._options import check_inputs
from jaxstep._src.loop._options import check_until_step
from jaxstep._src.loop._stopping import deferred_interrupts
from jaxstep._src.step import TrainStep
from jaxstep._src.step import runtime_of


def fit(
    step: TrainStep,
    state: TrainState,
    batches: Iterable[Any] | Callable[[int], Iterable[Any]],
    *,
    num_steps: int | None = None,
    until_step: int | None = None,
    history: History | None = None,
    callbacks: Sequence[Any] = (),
    diagnose: bool | None = None,
    step_timeout: float | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    keep: int | None = 3,
    resume: bool = False,
    presplit: bool = False,
    recover: Recover | None = None,
    prefetch: int = 2,
    global_batches: bool = False,
) -> TrainState:
    """Trains ``state`` on ``batches`` and returns the final state.

    Dispatches step t, then reads the health table of step t-1, which has finished by
    then: the host never waits on the step it just dispatched. A background thread
    pulls the next ``prefetch`` batches and places them on the devices while the step
    runs. What a callback hears, and what an error carries: the fit guide
    (docs/fit.md).

    Args:
      step: from :func:`make_train_step`.
      state: from ``step.init`` (or a step's last state, or :func:`restore`); donated:
        use the state returned.
      batches: the global batches: an iterable, a callable ``start -> iterable`` (the
        batches from data position ``start``: exact resume), or a checkpointable
        iterator (``get_state``/``set_state``, a ``grain.DataLoader``'s).
      num_steps: train at most this many batches (None: until the data ends).
      until_step: train until ``state.step`` reaches this step (a run's total, as
        MaxText's ``steps``): with ``resume=True`` a restarted job trains only what is
        left, never past it (None: no such limit; with ``num_steps`` too, the first
        reached ends the call). One below the step the call starts at trains nothing,
        with a warning.
      history: a :class:`History` the steps are appended to (None: a new one, not
        returned).
      callbacks: :class:`Callback` objects, called in the order given (or any object
        with some of the hooks ``on_fit_start(step, history)``, ``on_step_end(table)``,
        ``on_recovery(record)``, ``on_failure(error)``, ``on_fit_end(history)``; one
        object needs no list).
      diagnose: replay a failure to tell data from device from a one-off: True every
        failure, None (default) a failure every device had alike, False none.
      step_timeout: seconds a step may take before the devices that did not finish
        it are named ``HUNG`` (None: not watched).
      checkpoint_dir: where verified checkpoints, the final state, the emergency save
        of a failure and the save of an early stop go (None: no checkpoints).
      checkpoint_every: a checkpoint every this many steps (needs ``checkpoint_dir``).
      keep: the newest checkpoints kept (None: all).
      resume: start from the latest verified checkpoint of ``checkpoint_dir`` (the
        state passed then gives only the structure) at its data position.
      presplit: batches come ``(n_devices, per_device, ...)``, as pmap code builds them.
      recover: a :class:`Recover`: act on each failure's verdict and go on (None: raise).
      prefetch: batches a background thread pulls and places ahead (0: pulled on this
        thread, in turn).
      global_batches: on several processes, every process's ``batches`` yield the whole
        global batch, the same on every process (as :func:`jaxstep.data.batches` makes
        them): fit keeps each process's rows itself (no
        :func:`~jaxstep.distributed.local_batch` needed), and once a device has left
        the run each process takes the rows it now trains from the batch it read, so
        no row travels between processes (False: each process passes its own rows,
        which then go through the devices). On one process batches are global anyway.

    Returns:
      The state after the last batch.

    Raises:
      TrainingWorkerError: a step failed, diverged or hung (``error.state``: the last
        good state; ``error.batches``: the failing batch and every one after it).
      ValueError, TypeError: an argument was wrong (before anything ran).

    Example:
      >>> import jax.numpy as jnp, optax, jaxstep
      >>> step = jaxstep.make_train_step(
      ...     lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2), optax.sgd(0.1))
      >>> batches = [{"x": jnp.ones(16), "y": 2 * jnp.ones(16)}] * 5
      >>> state = jaxstep.fit(step, step.init({"w": jnp.zeros(())}), batches)
      >>> int(state.step), round(float(state.params["w"]), 3)
      (5, 1.345)
    """
    began = time.perf_counter()  # the call's startup: the restore and checks below
    options = FitOptions(
        num_steps=num_steps,
        until_step=until_step,
        history=history,
        callbacks=callbacks,
        diagnose=diagnose,
        step_timeout=step_timeout,
        checkpoints=CheckpointOptions(checkpoint_dir, checkpoint_every, keep, resume),
        presplit=presplit,
        recover=recover,
        prefetch=prefetch,
        global_batches=global_batches,
    )
    check_inputs(state, batches)
    state, _, saver = begin_fit(
        runtime_of(step), state, batches, options.checkpoints, lookahead=options.prefetch
    )
    check_until_step(options, saver.first)
    loop = Loop(step, state, FitCheckpoints(saver), options, began=began)
    try:
        loop.start()
        with deferred_interrupts(loop.interrupt):
            loop.train()  # up to num_steps: never a batch pulled that is not trained
        loop.drain()
    except BaseException as err:  # Ctrl-C included: the state and batches go on err
        loop.abandon(err)
        raise
    if loop.last is None and loop.limit != 0:
        warn(
            "fit's batches yielded no batch: nothing was trained and the state is returned "
            "as given (an exhausted iterator? pass a fresh one, or a callable start -> "
            "iterable)",
        )
    return loop.finish()
