"""The host loop: dispatch step t, then read the (already finished) health table of
step t-1. The device queue never drains and at most two steps are in flight."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any
from typing import Protocol

import jax
import numpy as np

from jaxstep.errors import TrainingWorkerError
from jaxstep.health import HealthTable
from jaxstep.state import TrainState
from jaxstep.step import StepOutput
from jaxstep.step import TrainStep


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


def fit(
    step: TrainStep,
    state: TrainState,
    batches: Iterable[Any],
    *,
    num_steps: int | None = None,
    history: History | None = None,
    callbacks: Sequence[Any] = (),
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

    Returns:
      The state after the last step.

    Raises:
      TrainingWorkerError: a step failed (``raise`` policy), or too many steps in a
        row were skipped (``skip`` policy). ``error.state`` is the last good state.
      ValueError, TypeError: a batch was malformed; ``error.state`` holds the state
        before it, nothing lost.
    """
    if num_steps is not None and num_steps < 0:
        raise ValueError(f"num_steps must be >= 0 or None, got {num_steps}")
    if bool(np.any(np.asarray(jax.device_get(state.halted)))):
        raise ValueError(
            "the state is halted by an earlier failure; resume from error.state (or "
            "step.clear_halt(state)) once the cause is fixed"
        )
    history = History() if history is None else history
    history.device_ids = [d.id for d in step.devices]

    def settle(pending: tuple[StepOutput, int], current: TrainState) -> None:
        out, rows = pending
        table = step.table(out)
        history.append(table)
        for cb in callbacks:
            if hasattr(cb, "on_step_end"):
                cb.on_step_end(table)
        if table.failed and table.halted:
            note = None
            if step.on_failure == "skip":
                note = (
                    f"{table.consecutive_skips + 1} failed steps in a row "
                    f"(max_consecutive_skips={step.max_consecutive_skips})"
                )
            error = TrainingWorkerError(
                step.failures(table, rows),
                state=step.clear_halt(current),
                note=note,
                history=history,
            )
            for cb in callbacks:
                if hasattr(cb, "on_failure"):
                    cb.on_failure(error)
            raise error

    pending: tuple[StepOutput, int] | None = None
    for count, batch in enumerate(batches):
        if num_steps is not None and count >= num_steps:
            break
        try:
            state, out = step(state, batch)
        except (ValueError, TypeError) as err:
            if pending is not None:
                settle(pending, state)  # a failure of the previous step comes first
            err.state = state  # type: ignore[union-attr]
            err.add_note("the state before this batch is in error.state; nothing was lost")
            raise
        if pending is not None:
            settle(pending, state)
        pending = (out, _rows_per_device(step, batch))
    if pending is not None:
        settle(pending, state)
    return state
