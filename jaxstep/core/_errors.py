"""TrainingWorkerError: which device failed, at which step, in which tensor, why,
and what to try next; with the last good state attached."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxstep.core._causes import CAUSES
from jaxstep.core._causes import HINTS
from jaxstep.core._causes import VERDICT_HINTS
from jaxstep.core._causes import describe
from jaxstep.core._causes import rank
from jaxstep.core.health import HealthTable
from jaxstep.core.health import Status


@dataclasses.dataclass(frozen=True)
class Failure:
    """One failing device of one step."""

    device_id: int
    process_index: int
    step: int
    status: Status
    reason: str
    leaf: str | None
    rows: tuple[int, int] | None = None  # [start, stop) of the global batch on it
    microbatch: int | None = None  # the first failing micro-batch (microbatches > 1)
    host: str | None = None  # host name of the process holding the device (many hosts)


class TrainingWorkerError(RuntimeError):
    """A training step failed on one or more devices.

    The message starts with ``training worker on device {device_id} failed: `` and the
    fields repeat it for code: ``device_id`` (``jax.Device.id``), ``process_index``,
    ``step``, ``status``, ``reason``, ``leaf``, every failing device of the step in
    ``failures`` (root cause first, then the step's device order) and the last good
    ``state``; ``batches`` (the failing batch and those pulled after it, untrained) and
    ``checkpoint`` (where ``fit``'s emergency save went) when :func:`jaxstep.fit` raised
    it.

    ``alike``: every device of the step failed, several of them first in the chain
    alike (:func:`failed_alike`), so the step alone cannot tell which started it (a
    collective in the model, cross-device BatchNorm, carries one device's failure to
    all; or the cause is the model or the update). The first line then says that the
    device named is only the first in device order, not a cause found, until a replay
    (``diagnosis``) finds the devices it started from, which then lead.
    """

    def __init__(
        self,
        failures: Sequence[Failure],
        state: Any = None,
        *,
        note: str | None = None,
        history: Any = None,
        diagnosis: Any = None,
        state_is_good: bool = True,
        batches: Sequence[Any] = (),
        checkpoint: str | None = None,
        alike: bool = False,
        hint: str | None = None,
    ):
        if not failures:
            raise ValueError("TrainingWorkerError needs at least one Failure")
        self.failures = tuple(failures)
        first = self.failures[0]
        self.device_id = first.device_id
        self.process_index = first.process_index
        self.step = first.step
        self.status = first.status
        self.reason = first.reason
        self.leaf = first.leaf
        self.microbatch = first.microbatch
        self.state = state
        self.note = note
        self.history = history
        self.diagnosis = diagnosis
        #: False when ``state`` is the state as it stands but not a good one (its
        #: parameters were already non-finite when the periodic check found them).
        self.state_is_good = state_is_good
        #: The failing batch and every batch pulled after it and not trained, in order:
        #: ``fit(step, error.state, itertools.chain(error.batches, rest))`` loses nothing.
        self.batches = list(batches)
        #: Where the emergency save went (None without ``fit(checkpoint_dir=...)``).
        self.checkpoint = checkpoint
        #: Every device of the step failed alike: the device named is only the first.
        self.alike = alike
        #: What to try when the status's own hint would mislead (a replay's verdict wins).
        self.hint = hint
        super().__init__(self._message())

    def _message(self) -> str:
        first = self.failures[0]
        roots = self._diagnosed_roots()
        where = "" if first.microbatch is None else f", micro-batch {first.microbatch}"
        lines = [
            f"training worker on device {first.device_id} failed: {first.reason} "
            f"at step {first.step}{where} ({_where(first)}){self._alike_words(roots)}"
        ]
        if self.note:
            lines.append(self.note)
        for other in self.failures[1:]:
            follows = ""
            if self._spread(other):
                follows = (
                    f" (likely follows from device {first.device_id}'s input: a collective "
                    "in the model carries it)"
                )
            elif roots and other.device_id not in roots:
                follows = (
                    f" (follows from device {first.device_id}'s rows, replay found: a "
                    "collective in the model carries it)"
                )
            lines.append(
                f"  also failed at this step: device {other.device_id} "
                f"({_where(other)}): {other.reason}{follows}"
            )
        if self.diagnosis is not None:
            lines.append(f"diagnosis: {self.diagnosis}")
        primary = next((s for s, _ in CAUSES if s in first.status), None)
        if primary is not None:
            rows = _rows(self._lead() if self.alike and not roots else [first])
            hint = VERDICT_HINTS.get(getattr(self.diagnosis, "verdict", ""))
            if hint is None or primary in (Status.DIVERGED, Status.HUNG):
                hint = HINTS[primary].format(rows=rows, leaf=first.leaf)
            if self.hint is not None and self.diagnosis is None:
                hint = self.hint.format(rows=rows, leaf=first.leaf)
            lines.append("what to try: " + hint)
        if self.state is not None and self.state_is_good:
            lines.append(
                f"the last good state (step {first.step}) is in error.state; resume with "
                "jaxstep.fit(step, error.state, ...) once the cause is fixed"
            )
        elif self.state is not None:
            lines.append(
                "error.state is the state as it stands, NOT a good one: restore from your "
                "last checkpoint"
            )
        if self.batches:
            after = len(self.batches) - 1
            held = (
                "the failing batch, untrained"
                if after == 0
                else f"the failing batch and the {after} pulled after it, untrained"
            )
            if self.state is None:  # nothing to resume from in this process
                lines.append(
                    f"error.batches holds {held}; with no state here (error.state is None), "
                    "fit(..., checkpoint_dir=..., resume=True) in a restarted process trains "
                    "them again from the latest verified checkpoint's data position"
                )
            else:
                lines.append(
                    f"error.batches holds {held}: fit(step, error.state, "
                    "itertools.chain(error.batches, rest)) loses none"
                )
        if self.checkpoint is not None:
            held = "state, failing batch" if self.state is not None else "failing batch"
            lines.append(f"emergency save ({held}, this report): {self.checkpoint}")
        return "\n".join(lines)

    def _lead(self) -> list[Failure]:
        """The failures first in the chain (the first failure's rank)."""
        lead = rank(self.failures[0].status)
        return [f for f in self.failures if rank(f.status) == lead]

    def _alike_words(self, roots: tuple[int, ...]) -> str:
        """What the first line adds when every device failed alike and no replay found
        where it started: the device named is only the first, and how to find the cause."""
        if not self.alike or roots:
            return ""
        first, n, k = self.failures[0], len(self.failures), len(self._lead())
        who = f"all {n} devices of the step failed" + (" alike" if k == n else f", {k} alike")
        if Status.HUNG in first.status:
            how = "the Python stacks each process logged show where each device waits"
        elif Status.DIVERGED in first.status:
            how = "no majority of the copies agrees, so none can be called the odd one"
        elif self.diagnosis is not None:
            how = "the replay below could not tell them apart either"
        elif self.state is None:
            how = "with no state to replay from, the cause cannot be found here"
        else:
            how = (
                "to find where it started, replay it: jaxstep.diagnose(step, error, batch) on "
                "the failing batch (from fit: error.batches[0]), or fit(..., diagnose=True)"
            )
        return (
            f"; {who}: device {first.device_id} is only the first in device order, not a "
            f"cause found ({how})"
        )

    @property
    def root_causes(self) -> tuple[Failure, ...]:
        """The failures that do not follow from another device's: ``failures`` less
        those a collective in the model carried from the first (a finite input whose
        loss is not finite beside the device whose input was not finite; or, after a
        replay diagnosis, every device whose own rows pass alone). What
        :func:`jaxstep.testing.assert_fails` calls blamed."""
        roots = self._diagnosed_roots()
        first, *others = self.failures
        kept = [f for f in others if not (self._spread(f) or (roots and f.device_id not in roots))]
        return (first, *kept)

    def _spread(self, other: Failure) -> bool:
        """A finite input with a non-finite loss, beside a first device whose input was
        not finite: what a collective in the model (cross-device BatchNorm) does."""
        first = self.failures[0]
        return (
            other is not first
            and Status.INPUT_NONFINITE in first.status
            and Status.INPUT_NONFINITE not in other.status
            and Status.LOSS_NONFINITE in other.status
        )

    def _diagnosed_roots(self) -> tuple[int, ...]:
        return tuple(getattr(self.diagnosis, "root_devices", ()) or ())

    def with_diagnosis(self, diagnosis: Any) -> TrainingWorkerError:
        """A copy of this error with ``diagnosis`` set (and shown in the message). When
        the diagnosis found where a failure that spread through a collective started
        (``diagnosis.root_devices``), those devices lead ``failures``."""
        roots = tuple(getattr(diagnosis, "root_devices", ()) or ())
        failures = self.failures
        if roots and failures[0].device_id not in roots:
            failures = tuple(
                sorted(
                    failures,
                    key=lambda f: roots.index(f.device_id) if f.device_id in roots else len(roots),
                )
            )
        return self.replace(diagnosis=diagnosis, failures=failures)

    def with_note(self, line: str) -> TrainingWorkerError:
        """A copy of this error with ``line`` added to its note (shown in the message,
        after the first line)."""
        return self.replace(note=line if not self.note else f"{self.note}\n{line}")

    def replace(self, **changes: Any) -> TrainingWorkerError:
        """A copy of this error with some of its constructor's arguments changed (``note``,
        ``diagnosis``, ``batches``, ``checkpoint``, ...); the message follows them."""
        fields = {
            "failures": self.failures,
            "state": self.state,
            "note": self.note,
            "history": self.history,
            "diagnosis": self.diagnosis,
            "state_is_good": self.state_is_good,
            "batches": self.batches,
            "checkpoint": self.checkpoint,
            "alike": self.alike,
            "hint": self.hint,
        }
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"TrainingWorkerError has no field(s) {sorted(unknown)}")
        fields.update(changes)
        return TrainingWorkerError(fields.pop("failures"), **fields)

    def __reduce__(self):
        from jaxstep.core._state import to_host

        state = None if self.state is None else to_host(np.asarray, self.state)
        batches = [to_host(np.asarray, b) for b in self.batches]
        return (
            _rebuild,
            (
                self.failures,
                state,
                self.note,
                self.history,
                self.diagnosis,
                self.state_is_good,
                batches,
                self.checkpoint,
                self.alike,
                self.hint,
            ),
        )


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


def _where(failure: Failure) -> str:
    host = f", host {failure.host}" if failure.host else ""
    return f"process {failure.process_index}{host}"


def _rows(failures: Sequence[Failure]) -> str:
    """The rows of the global batch ``failures`` ran on (``?``: unknown)."""
    spans = [f.rows for f in failures if f.rows is not None]
    if not spans:
        return "?"
    return f"{min(lo for lo, _ in spans)}..{max(hi for _, hi in spans) - 1}"


def _rebuild(
    failures,
    state,
    note,
    history,
    diagnosis,
    state_is_good=True,
    batches=(),
    checkpoint=None,
    alike=False,
    hint=None,
):
    from jaxstep.core._state import from_host

    return TrainingWorkerError(
        failures,
        None if state is None else from_host(state),
        note=note,
        history=history,
        diagnosis=diagnosis,
        state_is_good=state_is_good,
        batches=[from_host(b) for b in batches],
        checkpoint=checkpoint,
        alike=alike,
        hint=hint,
    )


def failures_from_table(
    table: HealthTable,
    devices: Sequence[Any],
    names: Mapping[str, Sequence[str]],
    rows_per_device: int | None,
    microbatches: int = 1,
    hosts: Callable[[int], str | None] | None = None,
) -> list[Failure]:
    """Turns a decoded health table into Failures, root cause first: the device whose
    failure came earliest in the chain input -> loss -> gradient -> parameters leads
    (a NaN input on one device outranks the non-finite losses a collective in the
    model spread from it), then device order. ``hosts`` maps a process index to its
    host name (runs over many hosts)."""
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
            )
        )
    return sorted(out, key=lambda f: rank(f.status))  # stable: device order within a rank
