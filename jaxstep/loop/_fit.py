"""The host loop: dispatch step t, then read the (already finished) health table of
step t-1. The device queue never drains and at most two steps are in flight."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep.checkpoint import Run
from jaxstep.core import HealthTable
from jaxstep.core import Status
from jaxstep.core import StepOutput
from jaxstep.core import TrainingWorkerError
from jaxstep.core import TrainState
from jaxstep.distributed import _runtime as distributed
from jaxstep.loop._history import History
from jaxstep.loop._history import scalar_aux
from jaxstep.loop._watchdog import Watcher
from jaxstep.step import TrainStep


class _Pending(NamedTuple):
    out: StepOutput
    batch: Any
    number: int  # the step it runs (as counted from the state fit started with)
    rows: int  # rows per device of its batch, as this process passed it


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
        verdict on ``error.diagnosis`` and in its message.
      step_timeout: seconds a step may take (counted from its dispatch, compile
        excluded) before the devices that did not finish their part are named in a
        ``HUNG`` error; the Python stacks go to the ``jaxstep`` logger first. Adds one
        host callback per device and step. Keep it well under 40 s on CPU, where XLA
        aborts a stuck collective.
      checkpoint_dir: where to write checkpoints (an orbax ``CheckpointManager``
        root) and, on a failure, the emergency save (``error.checkpoint``).
      checkpoint_every: save the state every this many steps, from a writer thread,
        once that step's replica check has passed (so it must be a multiple of the
        step's ``divergence_every``); None: only emergency saves.
      keep: how many periodic checkpoints to keep (None: all).
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
      ValueError, TypeError: a batch was malformed; ``error.state`` holds the state
        before it, nothing lost.
    """
    if num_steps is not None and num_steps < 0:
        raise ValueError(f"num_steps must be >= 0 or None, got {num_steps}")
    if step_timeout is not None and not step_timeout > 0:
        raise ValueError(f"step_timeout must be > 0 seconds or None, got {step_timeout!r}")
    if diagnose and distributed.spans_processes(step.devices):
        raise ValueError(
            "diagnose=True replays a failed step with its chunks moved to other devices, "
            "which needs the whole batch in one process: not available when the step's "
            "devices span processes. The error still names the device and its rows; replay "
            "them on one host with make_train_step(..., devices=jax.local_devices())"
        )
    state, source, run = Run.begin(
        step,
        state,
        batches,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        keep=keep,
        resume=resume,
    )
    halted, next_step = step.first_copy((state.halted, state.step))  # two small reads
    if bool(halted):
        raise ValueError(
            "the state is halted by an earlier failure; resume from error.state (or "
            "step.clear_halt(state)) once the cause is fixed"
        )
    history = History() if history is None else history
    history.device_ids = [d.id for d in step.devices]
    next_step = int(next_step)
    step._internals.heartbeats.clear()
    for cb in callbacks:
        if hasattr(cb, "on_fit_start"):
            cb.on_fit_start(step, history)
    last_time = time.perf_counter()

    def settle(pending: _Pending, current: TrainState, pulled: Sequence[Any] = ()) -> None:
        nonlocal next_step, last_time
        try:
            if watch_peers:  # never block where a lost peer would leave this process stuck
                distributed.wait_ready(pending.out.health, pending.number, step.devices)
            table = step.table(pending.out)
        except TrainingWorkerError as err:  # a lost peer: nothing pulled is lost either
            raise hung(err, [pending.batch, *pulled]) from None
        except Exception as err:  # a collective failed: a lost peer is the likely cause
            if not watch_peers:
                raise
            lost = distributed.lost_after(err, pending.number, step.devices)
            if isinstance(lost, TrainingWorkerError):
                raise hung(lost, [pending.batch, *pulled]) from err
            raise lost from err
        now = time.perf_counter()
        metrics = {} if pending.out.aux is None else scalar_aux(pending.out.aux, n)
        history.append(table, metrics, n * pending.rows / max(now - last_time, 1e-9))
        last_time = now
        next_step = table.step + 1
        if run.waiting:
            run.settled(table)
        for cb in step_end:
            cb.on_step_end(table)
        if table.failed and table.halted:
            error = _failure(step, table, pending, current, history)
            if diagnose:
                from jaxstep.loop._diagnose import diagnose as replay

                error = error.with_diagnosis(replay(step, error, pending.batch))
            # Nothing pulled is lost: the failing batch and those after it, untrained.
            error = run.failed(error, [pending.batch, *pulled])
            for cb in callbacks:
                if hasattr(cb, "on_failure"):
                    cb.on_failure(error)
            raise error

    def hung(err: TrainingWorkerError, batches: Sequence[Any]) -> TrainingWorkerError:
        """A hang or a lost peer: the emergency save, and the callbacks hear of it."""
        err = run.failed(err, batches)
        for cb in callbacks:
            if hasattr(cb, "on_failure"):
                cb.on_failure(err)
        return err

    pending: _Pending | None = None
    n = len(step.devices)
    step_end = [cb for cb in callbacks if hasattr(cb, "on_step_end")]
    many = distributed.spans_processes(step.devices)
    watch_peers = many and distributed.watch() is not None
    first_step = next_step
    watcher = Watcher(step, step_timeout) if step_timeout is not None else None
    last: StepOutput | None = None  # the newest dispatched step
    try:
        # islice: never pull a batch that will not be trained on (an iterator is shared).
        for count, batch in enumerate(itertools.islice(source, num_steps)):
            run.before(state)
            try:
                if watcher is not None:
                    state, out = watcher.run(state, batch, next_step)
                else:
                    state, out = step.dispatch(state, batch)
                last = out
            except (ValueError, TypeError) as err:
                if pending is not None:  # a failure of the previous step comes first
                    settle(pending, state, [batch])
                err.state = state  # type: ignore[union-attr]
                err.add_note("the state before this batch is in error.state; nothing was lost")
                raise
            except TrainingWorkerError as err:  # a hung step
                raise hung(err, [batch]) from None
            if pending is not None:
                settle(pending, state, [batch])
            pending = _Pending(out, batch, first_step + count, step._internals.rows_per_device)
            if watcher is not None:  # the step has finished: settle it now
                settle(pending, state)
                pending = None
        if pending is not None:
            settle(pending, state)
    except BaseException as err:
        if watch_peers and last is not None:
            # Leave no collective half done: a peer that is still in it would abort.
            distributed.finish_in_flight(last.health, err)
        raise
    run.close()  # waits for the last write
    for cb in callbacks:
        if hasattr(cb, "on_fit_end"):
            cb.on_fit_end(history)
    return state


def _failure(
    step: TrainStep, table: HealthTable, pending: _Pending, current: TrainState, history: History
) -> TrainingWorkerError:
    failures = step.failures(table, pending.rows)
    note = None
    bad = {f.device_id for f in failures}
    here = jax.process_index()  # a healthy copy this process can read
    good = [i for i, d in enumerate(step.devices) if d.id not in bad and d.process_index == here]
    if any(f.status & Status.DIVERGED for f in failures) and good:
        state = replica_state(step, current, good[0])
        note = (
            f"error.state was rebuilt from the copy on device {step.devices[good[0]].id}, "
            "which agrees with the majority"
        )
    elif any(f.status & Status.DIVERGED for f in failures):
        state = step.clear_halt(current)
        note = (
            "no majority of replicas agrees (two devices, or every copy differs): error.state "
            "is the state as it stands; compare it with your last checkpoint"
        )
    else:
        state = step.clear_halt(current)
        if step.options.on_failure == "skip":
            note = (
                f"{table.consecutive_skips + 1} failed steps in a row "
                f"(max_consecutive_skips={step.options.max_consecutive_skips})"
            )
        # Without verify_update an overflowing update is committed, and what fails
        # later fails because of it: say so rather than call this state good.
        if not step.options.verify_update and not _params_finite(step.host_state(state).params):
            note = (
                "the parameters in error.state are already non-finite: an earlier update "
                "overflowed (from finite gradients), and this failure follows from it. "
                "make_train_step(verify_update=True) stops such an update before it is "
                "committed"
            )
            return TrainingWorkerError(
                failures, state=state, note=note, history=history, state_is_good=False
            )
    return TrainingWorkerError(failures, state=state, note=note, history=history)


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves] or [jnp.array(True)]))


def _params_finite(params: Any) -> bool:
    """One device-side reduction and one scalar read: only on the failure path."""
    return bool(_all_finite(params))


def replica_state(step: TrainStep, state: TrainState, position: int) -> TrainState:
    """The state as held by ``step.devices[position]``, placed afresh on every device
    (unhalted): how a run recovers from one corrupted replica."""
    host = step.local_copy(state, position)
    return step.place_state(dataclasses.replace(host, halted=np.zeros((), bool)))
