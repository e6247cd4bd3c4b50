"""What a recovery hands the loop to go on with (:class:`Resume`), and what it reads of
a failure: the failing step's item, the devices that failed, the last good state."""

from __future__ import annotations

from typing import NamedTuple

from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.loop._pending import Item
from jaxstep._src.loop._pending import Pending
from jaxstep._src.loop._records import Recovery
from jaxstep._src.step import Runtime


class Resume(NamedTuple):
    """A recovery's outcome: the loop trains ``items`` from ``state`` (its step number
    the next dispatched), then the batches in flight after the failing one, then the
    rest; it records ``record``. ``runtime``: the step's runtime from now on, when
    devices left the run (the loop hands it to the step and to every action, and
    carries the rows that no longer divide); None: the runtime stays."""

    state: TrainState
    items: list[Item]
    record: Recovery
    runtime: Runtime | None = None


def item_of(pending: Pending) -> Item:
    """The item the failing step ran."""
    assert pending.item is not None  # every step fit dispatches comes from its queue
    return pending.item


def ids_of(error: TrainingWorkerError) -> tuple[int, ...]:
    """The ids of the devices that failed, root cause first, each once."""
    return tuple(dict.fromkeys(f.device_id for f in error.failures))


def state_of(error: TrainingWorkerError) -> TrainState:
    """The last good state of a failed step (a hang, which has none, is not recovered)."""
    assert error.state is not None
    return error.state
