"""The host loop: dispatch step t, then read the (already finished) health table of
step t-1. The device queue never drains and at most two steps are in flight."""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

from jaxstep.checkpoint import FitCheckpoints
from jaxstep.core import TrainState
from jaxstep.loop._arguments import check_fit
from jaxstep.loop._callbacks import Callbacks
from jaxstep.loop._driver import Loop
from jaxstep.loop._history import History
from jaxstep.loop._recover import Recover
from jaxstep.loop._stopping import deferred_interrupts
from jaxstep.step import TrainStep


def fit(
    step: TrainStep,
    state: TrainState,
    batches: Iterable[Any] | Callable[[int], Iterable[Any]],
    *,
    num_steps: int | None = None,
    history: History | None = None,
    callbacks: Sequence[Any] = (),
    diagnose: bool = False,
    step_timeout: float | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    keep: int | None = 3,
    resume: bool = False,
    presplit: bool = False,
    recover: Recover | None = None,
) -> TrainState:
    """Trains ``state`` on ``batches`` and returns the final state.

    Dispatches step t, then reads the health table of step t-1, which has finished
    by then: the host never waits on the step it just dispatched, and at most two
    steps are in flight.

    Args:
      step: from :func:`jaxstep.make_train_step`.
      state: from ``step.init`` (donated: use the returned state, not this one).
      batches: an iterable of global batches, or a callable ``start -> iterable`` (asked
        for the batches from the data position: the checkpoint's on resume, else
        ``state.step``), or a checkpointable iterator (``get_state``/``set_state``, e.g.
        a ``grain.DataLoader``'s). A sequence resumes by index; any other iterable
        resumes from wherever it stands (see docs/checkpoints.md).
      num_steps: stop after this many steps (default: when ``batches`` runs out).
      history: a :class:`History` to append each finished step to.
      callbacks: objects with optional ``on_fit_start(step, history)``,
        ``on_step_end(table)`` (after ``history`` has the step), ``on_failure(error)``
        and ``on_fit_end(history)`` (after the last step, when nothing failed); e.g.
        :class:`jaxstep.Progress`, :class:`jaxstep.JsonlWriter`.
      diagnose: on a failure, replay the step (:func:`jaxstep.diagnose`) and put the
        verdict on ``error.diagnosis`` and in its message (with several processes the
        chunks move only among each process's devices; every process gets the same
        verdict).
      step_timeout: seconds a step may take (counted from its dispatch, compile
        excluded) before the devices that did not finish their part are named in a
        ``HUNG`` error; the Python stacks go to the ``jaxstep`` logger first. Adds one
        host callback per device and step. Keep it well under 40 s on CPU, where XLA
        aborts a stuck collective.
      checkpoint_dir: where to write checkpoints (an orbax ``CheckpointManager``
        root) and, on a failure, the emergency save (``error.checkpoint``).
      checkpoint_every: save the state every this many steps, from a writer thread,
        once that step's replica check has passed (a checkpoint step runs the check
        whatever the step's ``divergence_every``: every checkpoint is verified); None:
        only emergency saves and the save of an early stop.
      keep: how many periodic checkpoints to keep (None: all).
      presplit: every batch is pre-split ``(n_devices, per_device, ...)``, as pmap code
        builds it (``step(state, batch, presplit=True)`` for each); ``error.batches``
        hands them back as they were given.
      recover: a :class:`jaxstep.Recover`: act on each failure's verdict and go on
        instead of raising (within ``max_recoveries``): a transient fault is retried, bad
        examples are left out of the step and quarantined, a bad device is left out of
        the run (``step.devices`` shrinks), a loss spike or a diverged replica is rolled
        back to the last verified checkpoint. Each action is a :class:`jaxstep.Recovery`
        in ``history.recoveries`` (docs/recovery.md). A hung step or a lost peer process
        cannot be recovered in this process: after the emergency save it exits with code
        ``jaxstep.RESTART_EXIT_CODE`` (75), and ``python -m jaxstep.launch --restarts N``
        (or ``scripts/tpu_vm/launch.sh``) restarts the job; pass ``checkpoint_dir`` and
        ``resume=True`` so the restarted job goes on from the last verified checkpoint
        (docs/multihost.md).
      resume: restore the latest verified checkpoint of ``checkpoint_dir`` (if any)
        instead of ``state``, which then only gives the expected structure, and go
        on from its data position.

    Returns:
      The state after the last step.

    Raises:
      TrainingWorkerError: a step failed (``raise`` policy), or too many steps in a
        row were skipped (``skip`` policy), or a replica diverged, or a step hung.
        ``error.state`` is the last good state (None for a hang); ``error.batches``
        the failing batch and every batch pulled after it, untrained, in order;
        ``error.checkpoint`` the emergency save (with ``checkpoint_dir``).
      ValueError, TypeError: an argument was wrong (before anything ran), or a batch
        was malformed.
      BaseException: whatever else ends fit early (Ctrl-C's ``KeyboardInterrupt``, a
        callback's or the data source's exception, ``SystemExit``) leaves with its own
        type, carrying ``error.state`` (the last good state, usable) and
        ``error.batches`` (pulled and not trained, in order); with ``checkpoint_dir``
        the state is saved first, so ``resume=True`` goes on from it. A first Ctrl-C
        lets the step in flight finish; a second stops at once.
    """
    callbacks = check_fit(
        step,
        state,
        batches,
        num_steps=num_steps,
        history=history,
        callbacks=callbacks,
        step_timeout=step_timeout,
        recover=recover,
    )
    state, source, checkpoints = FitCheckpoints.begin(
        step,
        state,
        batches,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        keep=keep,
        resume=resume,
    )
    loop = Loop(
        step,
        state,
        checkpoints,
        history=history,
        callbacks=Callbacks(callbacks),
        diagnose=diagnose,
        step_timeout=step_timeout,
        presplit=presplit,
        recover=recover,
    )
    try:
        loop.start()
        with deferred_interrupts(loop):
            # islice: never pull a batch that will not be trained (an iterator is shared).
            for batch in itertools.islice(source, num_steps):
                loop.advance(batch)
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
