"""The host loop: dispatch step t, then read the (already finished) health table of
step t-1. The device queue never drains and at most two steps are in flight."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import sys
import time
import traceback
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep.errors import Failure
from jaxstep.errors import TrainingWorkerError
from jaxstep.health import HealthTable
from jaxstep.health import Status
from jaxstep.state import TrainState
from jaxstep.state import from_host
from jaxstep.state import map_host
from jaxstep.step import StepOutput
from jaxstep.step import TrainStep

log = logging.getLogger("jaxstep")


class Callback(Protocol):
    """Hooks into :func:`fit`; define the methods you need (all optional)."""

    def on_step_end(self, table: HealthTable) -> None: ...

    def on_failure(self, error: TrainingWorkerError) -> None: ...


@dataclasses.dataclass
class History:
    """Per-step record of a run, one entry per finished step, for reading or plotting."""

    device_ids: list[int] = dataclasses.field(default_factory=list)
    step: list[int] = dataclasses.field(default_factory=list)
    loss: list[float] = dataclasses.field(default_factory=list)
    device_loss: list[np.ndarray] = dataclasses.field(default_factory=list)
    device_grad_norm: list[np.ndarray] = dataclasses.field(default_factory=list)
    status: list[np.ndarray] = dataclasses.field(default_factory=list)
    skipped: list[bool] = dataclasses.field(default_factory=list)

    def append(self, table: HealthTable) -> None:
        self.step.append(table.step)
        self.loss.append(table.mean_loss)
        self.device_loss.append(table.loss)
        self.device_grad_norm.append(table.grad_norm)
        self.status.append(table.status)
        self.skipped.append(table.skipped)

    def __len__(self) -> int:
        return len(self.step)

    def as_arrays(self) -> dict[str, np.ndarray]:
        """Every field as an array: per-device ones are ``(steps, devices)``."""
        n = len(self.device_ids)
        return {
            "device_ids": np.asarray(self.device_ids, np.int64),
            "step": np.asarray(self.step, np.int64),
            "loss": np.asarray(self.loss, np.float32),
            "device_loss": np.asarray(self.device_loss, np.float32).reshape(-1, n),
            "device_grad_norm": np.asarray(self.device_grad_norm, np.float32).reshape(-1, n),
            "status": np.asarray(self.status, np.int32).reshape(-1, n),
            "skipped": np.asarray(self.skipped, bool),
        }


def _rows_per_device(step: TrainStep, batch: Any) -> int:
    return int(jax.tree.leaves(batch)[0].shape[0]) // len(step.devices)


class _Pending(NamedTuple):
    out: StepOutput
    batch: Any


def fit(
    step: TrainStep,
    state: TrainState,
    batches: Iterable[Any],
    *,
    num_steps: int | None = None,
    history: History | None = None,
    callbacks: Sequence[Any] = (),
    diagnose: bool = False,
    step_timeout: float | None = None,
) -> TrainState:
    """Trains ``state`` on ``batches`` and returns the final state.

    Dispatches step t, then reads the health table of step t-1, which has finished
    by then: the host never waits on the step it just dispatched, and at most two
    steps are in flight.

    Args:
      step: from :func:`jaxstep.make_train_step`.
      state: from ``step.init`` (donated: use the returned state, not this one).
      batches: an iterable of global batches.
      num_steps: stop after this many steps (default: when ``batches`` runs out).
      history: a :class:`History` to append each finished step to.
      callbacks: objects with optional ``on_step_end(table)`` / ``on_failure(error)``.
      diagnose: on a failure, replay the step (:func:`jaxstep.diagnose`) and put the
        verdict on ``error.diagnosis`` and in its message.
      step_timeout: seconds a step may take (counted from its dispatch, compile
        excluded) before the devices that did not finish their part are named in a
        ``HUNG`` error; the Python stacks go to the ``jaxstep`` logger first. Adds one
        host callback per device and step. Keep it well under 40 s on CPU, where XLA
        aborts a stuck collective.

    Returns:
      The state after the last step.

    Raises:
      TrainingWorkerError: a step failed (``raise`` policy), or too many steps in a
        row were skipped (``skip`` policy), or a replica diverged, or a step hung.
        ``error.state`` is the last good state (None for a hang).
      ValueError, TypeError: a batch was malformed; ``error.state`` holds the state
        before it, nothing lost.
    """
    if num_steps is not None and num_steps < 0:
        raise ValueError(f"num_steps must be >= 0 or None, got {num_steps}")
    if step_timeout is not None and not step_timeout > 0:
        raise ValueError(f"step_timeout must be > 0 seconds or None, got {step_timeout!r}")
    host = step.host_state(state)
    if bool(np.asarray(host.halted)):
        raise ValueError(
            "the state is halted by an earlier failure; resume from error.state (or "
            "step.clear_halt(state)) once the cause is fixed"
        )
    history = History() if history is None else history
    history.device_ids = [d.id for d in step.devices]
    next_step = int(np.asarray(host.step))
    step.heartbeats.clear()

    def settle(pending: _Pending, current: TrainState) -> None:
        nonlocal next_step
        table = step.table(pending.out)
        next_step = table.step + 1
        history.append(table)
        for cb in callbacks:
            if hasattr(cb, "on_step_end"):
                cb.on_step_end(table)
        if table.failed and table.halted:
            error = _failure(step, table, pending, current, history)
            if diagnose:
                from jaxstep.diagnose import diagnose as replay

                error = error.with_diagnosis(replay(step, error, pending.batch))
            for cb in callbacks:
                if hasattr(cb, "on_failure"):
                    cb.on_failure(error)
            raise error

    pending: _Pending | None = None
    watcher = _Watcher(step, step_timeout) if step_timeout is not None else None
    # islice: never pull a batch that will not be trained on (an iterator is shared).
    for batch in itertools.islice(batches, num_steps):
        try:
            if watcher is not None:
                state, out = watcher.run(state, batch, next_step)
            else:
                state, out = step.dispatch(state, batch)
        except (ValueError, TypeError) as err:
            if pending is not None:
                settle(pending, state)  # a failure of the previous step comes first
            err.state = state  # type: ignore[union-attr]
            err.add_note("the state before this batch is in error.state; nothing was lost")
            raise
        if pending is not None:
            settle(pending, state)
        pending = _Pending(out, batch)
        if watcher is not None:  # the step has finished: settle it now
            settle(pending, state)
            pending = None
    if pending is not None:
        settle(pending, state)
    return state


def _failure(
    step: TrainStep, table: HealthTable, pending: _Pending, current: TrainState, history: History
) -> TrainingWorkerError:
    failures = step.failures(table, _rows_per_device(step, pending.batch))
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
        if step.on_failure == "skip":
            note = (
                f"{table.consecutive_skips + 1} failed steps in a row "
                f"(max_consecutive_skips={step.max_consecutive_skips})"
            )
        # Without verify_update an overflowing update is committed, and what fails
        # later fails because of it: say so rather than call this state good.
        if not step.verify_update and not _params_finite(step.host_state(state).params):
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
    device = step.devices[position]

    def take(x: jax.Array) -> np.ndarray:
        if step._backend.stacked:
            return np.asarray(x)[position]
        return next(np.asarray(s.data) for s in x.addressable_shards if s.device == device)

    host = from_host(map_host(take, state))
    return step._backend.place_state(dataclasses.replace(host, halted=np.zeros((), bool)))


class _Watcher:
    """Runs each step on a dispatch thread and waits for it with a deadline, so a
    hung device is named instead of hanging the host (CPU runs steps with host
    callbacks synchronously, so the wait must not be on the dispatching thread)."""

    def __init__(self, step: TrainStep, timeout: float):
        self.step = step
        self.timeout = timeout
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxstep-step")

    def run(self, state: TrainState, batch: Any, expected: int) -> tuple[TrainState, StepOutput]:
        for replicas in (False, self.step.divergence_every is not None):
            # Compile time is not step time: both programs, before the clock starts.
            self.step.compile(state, batch, heartbeat=True, replicas=replicas)
        future = self.pool.submit(self.step.dispatch, state, batch, heartbeat=True)
        deadline = time.monotonic() + self.timeout
        pause = 1e-4
        while not (future.done() and future.result()[1].health.is_ready()):  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                self.pool.shutdown(wait=False)
                raise _hung(self.step, expected, self.timeout)
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return future.result()


def _hung(step: TrainStep, expected: int, timeout: float) -> TrainingWorkerError:
    stacks = "\n".join(
        f"--- thread {ident}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )
    log.error("step %d did not finish within %.1f s; Python stacks:\n%s", expected, timeout, stacks)
    beats = dict(step.heartbeats)
    late = [i for i in range(len(step.devices)) if beats.get(i, -1) < expected]
    where = "before reaching the first collective"
    if not late:  # every device reached the collective: the hang is in or after it
        late = list(range(len(step.devices)))
        where = "after reaching the first collective (all devices did)"
    failures = [
        Failure(
            device_id=step.devices[i].id,
            process_index=step.devices[i].process_index,
            step=expected,
            status=Status.HUNG,
            reason=f"did not finish its part of the step within {timeout:g} s, {where}",
            leaf=None,
        )
        for i in late
    ]
    note = (
        "the state lives on the hung device(s) and cannot be read: error.state is None; "
        "restore from the last checkpoint (on CPU, XLA aborts a stuck collective ~40 s in)"
    )
    return TrainingWorkerError(failures, state=None, note=note)
