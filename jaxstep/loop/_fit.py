"""The host loop: dispatch step t, then read the (already finished) health table of
step t-1. The device queue never drains and at most two steps are in flight."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

from jaxstep.checkpoint import CheckpointOptions
from jaxstep.checkpoint import FitCheckpoints
from jaxstep.core import TrainState
from jaxstep.loop._driver import Loop
from jaxstep.loop._history import History
from jaxstep.loop._options import FitOptions
from jaxstep.loop._options import Recover
from jaxstep.loop._options import check_inputs
from jaxstep.loop._stopping import deferred_interrupts
from jaxstep.step import TrainStep
from jaxstep.step import runtime_of


def fit(
    step: TrainStep,
    state: TrainState,
    batches: Iterable[Any] | Callable[[int], Iterable[Any]],
    *,
    num_steps: int | None = None,
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
) -> TrainState:
    """Trains ``state`` (from ``step.init``; donated) on ``batches`` and returns the
    final state.

    Dispatches step t, then reads the health table of step t-1, which has finished by
    then: the host never waits on the step it just dispatched. ``batches``: an iterable
    of global batches, a callable ``start -> iterable``, or a checkpointable iterator;
    a background thread pulls the next ``prefetch`` of them (2 by default) and places
    them on the devices while the step runs (``prefetch=0``: pulled here, in turn).
    Every argument, what a callback hears, and what an error carries: docs/fit.md.

    Raises:
      TrainingWorkerError: a step failed, diverged or hung (``error.state``: the last
        good state; ``error.batches``: the failing batch and every one after it).
      ValueError, TypeError: an argument was wrong (before anything ran).
    """
    options = FitOptions(
        num_steps=num_steps,
        history=history,
        callbacks=callbacks,
        diagnose=diagnose,
        step_timeout=step_timeout,
        checkpoints=CheckpointOptions(checkpoint_dir, checkpoint_every, keep, resume),
        presplit=presplit,
        recover=recover,
        prefetch=prefetch,
    )
    check_inputs(state, batches)
    state, _, checkpoints = FitCheckpoints.begin(
        runtime_of(step), state, batches, options.checkpoints, lookahead=options.prefetch
    )
    loop = Loop(step, state, checkpoints, options)
    try:
        loop.start()
        with deferred_interrupts(loop.interrupt):
            loop.train()  # up to num_steps: never a batch pulled that is not trained
        loop.drain()
    except BaseException as err:  # Ctrl-C included: the state and batches go on err
        loop.abandon(err)
        raise
    if loop.last is None and num_steps != 0:
        warnings.warn(
            "fit's batches yielded no batch: nothing was trained and the state is returned "
            "as given (an exhausted iterator? pass a fresh one, or a callable start -> "
            "iterable)",
            stacklevel=2,
        )
    return loop.finish()
