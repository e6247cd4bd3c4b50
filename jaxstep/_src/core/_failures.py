"""The failures of a step: one :class:`Failure` a failing device, read from the health
table root cause first (the earliest in input -> loss -> gradient -> model state ->
parameters leads), and whether the step can tell which device started them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from jaxstep._src.core._causes import describe
from jaxstep._src.core._causes import rank
from jaxstep._src.core.health import HealthTable
from jaxstep._src.core.health import Status


@dataclasses.dataclass(frozen=True)
class Failure:
    """One failing device of one step: an entry of ``TrainingWorkerError.failures``
    (and of ``step.failures(table)``).

    Attributes:
      device_id: the ``jax.Device.id`` of the device (not its position).
      process_index: the process that holds the device.
      step: the ``state.step`` the failed step started from.
      status: why it failed, a :class:`jaxstep.Status` (flags combine).
      reason: the status in words, with the leaf (``"non-finite gradient in
        ['dense2']['kernel']"``).
      leaf: the ``jax.tree_util.keystr`` of the first non-finite (or diverged) leaf,
        or None.
      rows: ``(start, stop)``: the rows of the global batch the device held, when
        known.
      microbatch: the first failing micro-batch (``microbatches > 1``), else None.
      host: the host name of the process holding the device (runs on several
        hosts), else None.
      group: the ids of every device of the failing unit: under
        ``make_train_step(model_parallel=m)`` its model group (``device_id`` is the
        group's first), else ``(device_id,)``.

    Example:
      >>> import jaxstep
      >>> from jaxstep.testing import Fault, tiny_step
      >>> tiny = tiny_step(faults=[Fault("grad", device_id=3, step=0)])
      >>> state, out = tiny.step(tiny.state(), tiny.batches(1)[0])
      >>> [failure] = tiny.step.failures(tiny.step.table(out))
      >>> failure.device_id, failure.step, failure.status.name, failure.reason
      (3, 0, 'GRAD_NONFINITE', "non-finite gradient in ['b']")
    """

    device_id: int
    process_index: int
    step: int
    status: Status
    reason: str
    leaf: str | None
    rows: tuple[int, int] | None = None
    microbatch: int | None = None
    host: str | None = None
    group: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.group:
            object.__setattr__(self, "group", (self.device_id,))


def failures_from_table(
    table: HealthTable,
    devices: Sequence[Any],
    names: Mapping[str, Sequence[str]],
    rows_per_device: int | None,
    microbatches: int = 1,
    hosts: Callable[[int], str | None] | None = None,
    groups: Callable[[int], tuple[int, ...]] | None = None,
) -> list[Failure]:
    """Turns a decoded health table into Failures, root cause first: the device whose
    failure came earliest in the chain input -> loss -> gradient -> parameters leads
    (a NaN input on one device outranks the non-finite losses a collective in the
    model spread from it), then device order. ``hosts`` maps a process index to its
    host name (runs over many hosts); ``groups`` a device id to its model group's ids
    (``model_parallel``)."""
    out = []
    for i, dev in enumerate(devices):
        status = Status(int(table.status[i]))
        if not status:
            continue
        leaves = {
            flag: names[kind][int(column[i])]
            for flag, column, kind in (
                (Status.INPUT_NONFINITE, table.input_leaf, "input"),
                (Status.GRAD_NONFINITE, table.grad_leaf, "params"),
                (Status.OVERFLOW, table.grad_leaf, "params"),
                (Status.MODEL_STATE_NONFINITE, table.model_state_leaf, "model_state"),
                (Status.PARAM_NONFINITE, table.param_leaf, "params"),
                (Status.DIVERGED, table.diverged_leaf, "state"),
            )
            if flag in status and column[i] >= 0
        }
        # The leaf of the first cause: the input leaf if the data was bad, and so on.
        leaf = next(iter(leaves.values()), None)
        check = names["checks"][int(table.check[i])] if table.check[i] >= 0 else None
        rows = (i * rows_per_device, (i + 1) * rows_per_device) if rows_per_device else None
        micro = int(table.microbatch[i]) if microbatches > 1 and table.microbatch[i] >= 0 else None
        if rows is not None and micro is not None and rows_per_device:
            size = rows_per_device // microbatches
            rows = (rows[0] + micro * size, rows[0] + (micro + 1) * size)
        out.append(
            Failure(
                device_id=int(dev.id),
                process_index=int(dev.process_index),
                step=table.step,
                status=status,
                reason=describe(status, leaves, check),
                leaf=leaf,
                rows=rows,
                microbatch=micro,
                host=None if hosts is None else hosts(dev.process_index),
                group=() if groups is None else groups(int(dev.id)),
            )
        )
    return sorted(out, key=lambda f: rank(f.status))  # stable: device order within a rank


def failed_alike(failures: Sequence[Failure], devices: int) -> bool:
    """Whether the step cannot tell which of its devices started ``failures`` (root
    cause first, as :func:`failures_from_table` orders them): every one of its
    ``devices`` failed, and more than one failed first in the chain (the same earliest
    cause). One device's bad rows fail every device alike through a collective in the
    model; when only some devices fail, each failed on its own rows."""
    if devices < 2 or len({f.device_id for f in failures}) < devices:
        return False
    lead = rank(failures[0].status)
    return sum(rank(f.status) == lead for f in failures) > 1
