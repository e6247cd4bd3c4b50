"""TrainingWorkerError: which device failed, at which step, in which tensor, why,
and what to try next; with the last good state attached."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxstep._src.core._causes import CAUSES
from jaxstep._src.core._causes import HINTS
from jaxstep._src.core._causes import VERDICT_HINTS
from jaxstep._src.core._causes import rank
from jaxstep._src.core._failures import Failure
from jaxstep._src.core.health import Status


class TrainingWorkerError(RuntimeError):
    """A training step failed on one or more devices.

    The message starts with ``training worker on device {device_id} failed: ``, says
    what failed and where, and what to try next; the fields repeat it for code. It
    pickles. :func:`jaxstep.fit` raises it; ``step.failures(table)`` gives its
    ``failures`` for a step run by hand.

    Args:
      failures: every failing device of the step, the root cause first.
      state: the last good state.
      note: lines shown in the message after the first.
      history: the run's :class:`jaxstep.History`, when a loop raised it.
      diagnosis: a replay's :class:`jaxstep.Diagnosis`, or None.
      state_is_good: see the attribute.
      batches: see the attribute.
      checkpoint: see the attribute.
      alike: see the attribute.
      hint: what to try, when the status's own hint would mislead.

    Attributes:
      device_id: the ``jax.Device.id`` of the root-cause device (not its position).
      group: the ids of every device of the root-cause unit: its model group under
        ``make_train_step(model_parallel=m)`` (``device_id`` is the first), else
        ``(device_id,)``.
      process_index: the process holding that device.
      step: the ``state.step`` the failed step started from.
      status: the device's :class:`jaxstep.Status` flags.
      reason: the status in words, with the leaf.
      leaf: the ``jax.tree_util.keystr`` of the first non-finite leaf, or None.
      microbatch: the first failing micro-batch (``microbatches > 1``), or None.
      failures: every failing device of the step as a :class:`jaxstep.Failure`, root
        cause first (input, then loss, gradient, model state, parameters), then in the
        step's device order.
      state: the last good :class:`jaxstep.TrainState`, usable as it is:
        ``fit(step, err.state, ...)`` resumes from it.
      state_is_good: False when ``state`` is the state as it stands but not a good one
        (its parameters were already non-finite when the periodic check found them).
      diagnosis: the replay's :class:`jaxstep.Diagnosis` (``fit(diagnose=True)``, or
        a failure every device had alike), else None.
      note: the lines the message shows after the first, or None.
      history: the run's :class:`jaxstep.History` when ``fit`` raised it, else None.
      batches: the failing batch and every batch pulled after it and not trained, in
        order: ``fit(step, err.state, itertools.chain(err.batches, rest))`` loses
        nothing.
      checkpoint: where ``fit``'s emergency save went (None without
        ``fit(checkpoint_dir=...)``).
      alike: every device of the step failed, several of them alike and first in the
        chain, so the step alone cannot tell which started it (a collective in the
        model, such as cross-device BatchNorm, carries one device's failure to all; or
        the cause is the model or the update). The first line then says that the
        device named is only the first in device order, until a replay
        (``diagnosis``) finds the devices it started from, which then lead.
      hint: what to try, when the status's own hint would mislead (a replay's
        verdict wins, except over a divergence, which is not replayed), or None.

    Example:
      >>> import jaxstep
      >>> from jaxstep.testing import Fault, tiny_step
      >>> tiny = tiny_step(faults=[Fault("grad", device_id=3, step=1)])
      >>> try:
      ...     jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3), diagnose=False)
      ... except jaxstep.TrainingWorkerError as err:
      ...     error = err
      >>> str(error).splitlines()[0]
      "training worker on device 3 failed: non-finite gradient in ['b'] at step 1 (process 0)"
      >>> error.device_id, error.step, error.status.name, int(error.state.step), len(error.batches)
      (3, 1, 'GRAD_NONFINITE', 1, 2)
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
        self.group = first.group
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
        self.state_is_good = state_is_good
        # a list is kept as it is: fit's may still receive a batch its data thread was
        # pulling when fit stopped (iterating it waits for that batch)
        self.batches = batches if isinstance(batches, list) else list(batches)
        self.checkpoint = checkpoint
        self.alike = alike
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
            # a divergence is not replayed: the diagnosis adds nothing to the error's hint
            if self.hint is not None and (self.diagnosis is None or primary is Status.DIVERGED):
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
            elif self.state_is_good:
                lines.append(
                    f"error.batches holds {held}: fit(step, error.state, "
                    "itertools.chain(error.batches, rest)) loses none"
                )
            else:  # resuming from error.state would train on a bad state
                lines.append(
                    f"error.batches holds {held}: train them again after the checkpoint "
                    "you go back to, with the batches since it"
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
        (``diagnosis.root_devices``), those devices lead ``failures``.

        Args:
          diagnosis: a :class:`jaxstep.Diagnosis` of this failure.

        Returns:
          The new error; this one is unchanged.
        """
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
        after the first line).

        Args:
          line: the text to add.

        Returns:
          The new error; this one is unchanged.
        """
        return self.replace(note=line if not self.note else f"{self.note}\n{line}")

    def replace(self, **changes: Any) -> TrainingWorkerError:
        """A copy of this error with some of its constructor's arguments changed; the
        message follows them.

        Args:
          **changes: constructor arguments by name (``note``, ``diagnosis``,
            ``batches``, ``checkpoint``, ...).

        Returns:
          The new error; this one is unchanged.

        Raises:
          TypeError: a name is not one of the constructor's arguments.
        """
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
        from jaxstep._src.core._state import to_host

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


def _where(failure: Failure) -> str:
    host = f", host {failure.host}" if failure.host else ""
    group = failure.group
    if len(group) > 1:  # model_parallel: the unit that failed is a model group
        host += f", model group: devices {', '.join(str(d) for d in group)}"
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
    from jaxstep._src.core._state import from_host

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
