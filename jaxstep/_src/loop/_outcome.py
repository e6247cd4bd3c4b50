"""What the loop decides, as values it acts on: what a recovery hands it to go on with
(:class:`Resume`: retry, quarantine, exclude, roll back; a failure not recovered is the
error, raised: fit stops), what settling a step leaves it to do (:class:`Settled`), and
what a recovery reads of a failure: the failing step's item, the devices that failed,
the last good state."""

from __future__ import annotations

import enum
from typing import NamedTuple

from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.loop._pending import Item
from jaxstep._src.loop._pending import Pending
from jaxstep._src.loop._records import Recovery
from jaxstep._src.step import Runtime
from jaxstep._src.step import TrainStep
from jaxstep._src.step import runtime_of


class Resume(NamedTuple):
    """A recovery's outcome: the loop trains ``items`` from ``state`` (its step number
    the next dispatched), then the batches in flight after the failing one, then the
    rest; it records ``record``. ``step``: the step from now on, when devices left the
    run (a new step, ``TrainStep.without_devices``: the loop swaps it in with
    ``state``, which lies on its devices, and carries the rows that no longer divide);
    None: the step stays."""

    state: TrainState
    items: list[Item]
    record: Recovery
    step: TrainStep | None = None

    @property
    def runtime(self) -> Runtime | None:
        """The new step's runtime (None: the step stays)."""
        return None if self.step is None else runtime_of(self.step)


class Settled(enum.Enum):
    """What settling a step leaves the loop to do (the loop acts on it)."""

    #: the step passed (or its failure was a repair inside it): on with the batch in hand
    GO_ON = enum.auto()
    #: a recovery reset the loop (:class:`Resume`): on with its queue, from the first
    RECOVERED = enum.auto()


def item_of(pending: Pending) -> Item:
    """The item the failing step ran."""
    assert pending.item is not None  # every step fit dispatches comes from its queue
    return pending.item


def step_of(pending: Pending) -> TrainStep:
    """The step the failing step ran on."""
    assert pending.step is not None  # every step fit dispatches records it
    return pending.step


def ids_of(error: TrainingWorkerError) -> tuple[int, ...]:
    """The ids of the devices that failed, root cause first, each once."""
    return tuple(dict.fromkeys(f.device_id for f in error.failures))


def state_of(error: TrainingWorkerError) -> TrainState:
    """The last good state of a failed step (a hang, which has none, is not recovered)."""
    assert error.state is not None
    return error.state
