"""A failed step run again as under ``on_failure="drop"`` (``Runtime.rerun_dropping``,
fit's quarantine of bad rows), whatever the step's own policy: the options of that
rerun's runtime (a sibling of the step's, built on first use, sharing its fault
bookkeeping and heartbeats), and the moves of a state into it and back."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import Protocol

import numpy as np

from jaxstep._src.core import Batch
from jaxstep._src.core import StepOutput
from jaxstep._src.core import TrainState
from jaxstep._src.program import Options
from jaxstep._src.step._backends import Backend
from jaxstep._src.step._inputs import Inputs


class Sibling(Protocol):
    """What the rerun needs of its runtime (a :class:`~jaxstep._src.step.Runtime`)."""

    inputs: Inputs

    def dispatch(
        self, state: TrainState, batch: Batch, *, presplit: bool = ..., heartbeat: bool = ...
    ) -> tuple[TrainState, StepOutput]: ...
    def compile(
        self, state: TrainState, batch: Batch, *, heartbeat: bool = ..., check_replicas: bool = ...
    ) -> Any: ...
    def step_number(self, state: TrainState) -> int: ...


class Dropping:
    """The drop-policy rerun of one runtime's steps.

    Args:
      options: the step's options.
      backend: its backend (places the drop policy's fields).
      make: builds the rerun's runtime from its options (once, on first use).
    """

    def __init__(self, options: Options, backend: Backend, make: Callable[[Options], Sibling]):
        self.options = options
        self.backend = backend
        self.own = options.on_failure == "drop"  # the step's state is the policy's already
        self._make = make
        self._sibling: Sibling | None = None

    def sibling(self) -> Sibling:
        """The rerun's runtime (built on first use)."""
        if self._sibling is None:
            self._sibling = self._make(dropping_options(self.options))
        return self._sibling

    def rerun(
        self, state: TrainState, batch: Batch, *, presplit: bool, heartbeat: bool, warned: bool
    ) -> tuple[TrainState, StepOutput, int]:
        """The step again on ``batch`` from ``state`` (a state of the step's, not
        donated): the state returned (the step's structure), the output and the number
        of the next step. ``warned``: the step warned of a pre-split batch already."""
        sibling = self.sibling()
        sibling.inputs.presplit_warned = warned
        new, out = sibling.dispatch(
            self.entering(state), batch, presplit=presplit, heartbeat=heartbeat
        )
        return out_of_dropping(new, own=self.own), out, sibling.step_number(new)

    def entering(self, state: TrainState) -> TrainState:
        """``state`` as the rerun takes it (one ``device_put`` of its fields)."""
        placed = self.backend.place_state(drop_fields(len(self.backend.devices)))
        return into_dropping(state, placed, own=self.own)


def dropping_options(options: Options) -> Options:
    """The options of the step that reruns a step as under ``on_failure="drop"``: any
    number of devices but all may be left out, no limit on drops in a row, and the
    state passed in is not donated."""
    return dataclasses.replace(
        options,
        on_failure="drop",
        max_dropped=options.n - 1,
        max_consecutive_drops=None,
        donate=False,
    )


def drop_fields(n: int) -> dict[str, Any]:
    """The host values a state of another policy takes into the dropping step:
    ``halted`` cleared, ``total_drops`` and the per-device drop memory at zero."""
    return {
        "halted": np.zeros((), bool),
        "total_drops": np.zeros((), np.int32),
        "drops": np.zeros((n,), np.int32),
        "repairs": np.zeros((n,), np.int32),
    }


def into_dropping(state: TrainState, placed: dict[str, Any], *, own: bool) -> TrainState:
    """``state`` as the dropping step takes it; ``placed``: :func:`drop_fields` on the
    devices; ``own``: the state is already the drop policy's (only ``halted`` is
    cleared)."""
    if own:
        return dataclasses.replace(state, halted=placed["halted"])
    monitor = {**state.monitor, "drops": placed["drops"], "repairs": placed["repairs"]}
    return dataclasses.replace(
        state, halted=placed["halted"], total_drops=placed["total_drops"], monitor=monitor
    )


def out_of_dropping(state: TrainState, *, own: bool) -> TrainState:
    """The dropping step's state as a step of another policy takes it (its drop
    memory let go); ``own``: the drop policy's, returned as it is."""
    if own:
        return state
    monitor = {k: v for k, v in state.monitor.items() if k not in ("drops", "repairs")}
    return dataclasses.replace(state, total_drops=None, monitor=monitor)
