"""What a recovery did, as :class:`History` keeps it: one :class:`Recovery` per action
``fit(..., recover=...)`` took (``History.recoveries``)."""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import get_args

from jaxstep._src.core import RecoveryAction
from jaxstep._src.core import Verdict

#: ``Recovery.verdict`` values, and the ``Recovery.action`` values (a record may come
#: from JSON, where nothing typed it: checked when built).
VERDICTS: tuple[Verdict, ...] = get_args(Verdict)
ACTIONS: tuple[RecoveryAction, ...] = get_args(RecoveryAction)


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One action :func:`jaxstep.fit` took to recover from a failure
    (``fit(..., recover=jaxstep.Recover())``), in ``History.recoveries``.

    Attributes:
      step: the step that failed (``state.step`` when it ran).
      verdict: ``"transient"``, ``"data"``, ``"device"``, ``"spike"`` or ``"diverged"``.
      action: ``"retried"`` (the same batch again from the last good state),
        ``"quarantined"`` (the step again with the chunks holding ``examples`` left
        out of the mean; when a collective in the model carried them to every device,
        the step's batch is skipped instead: ``skipped_batches``), ``"excluded"``
        (training goes on without ``device_ids``),
        ``"rolled back"`` (to the last verified checkpoint, ``skipped_batches`` left
        out) or ``"repaired"`` (a diverged replica copied from the majority).
      device_ids: the ``jax.Device.id`` s the verdict is about (failing, excluded,
        repaired).
      examples: the offending examples, as indices into the failing global batch.
      skipped_batches: batches never trained, counting the stream's first batch as 0.
      batch: the failing step's batch, counting the stream's first batch as 0 (None
        when unknown).
      detail: what happened, in words.
      example_ids: with ``Recover(example_id=...)``: the values of that batch leaf for
        ``examples``, in their order (what names them in the data, shuffled or not).

    Example:
      >>> import jaxstep
      >>> from jaxstep.testing import Fault, tiny_step
      >>> tiny = tiny_step(faults=[Fault("input", device_id=2, step=1, mode="data")])
      >>> history = jaxstep.History()
      >>> state = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3), history=history,
      ...                     recover=jaxstep.Recover())
      >>> [record] = history.recoveries
      >>> record.verdict, record.action, record.device_ids, record.batch, record.examples
      ('data', 'quarantined', (2,), 1, (4,))
    """

    step: int
    verdict: Verdict
    action: RecoveryAction
    device_ids: tuple[int, ...] = ()
    examples: tuple[int, ...] = ()
    skipped_batches: tuple[int, ...] = ()
    batch: int | None = None
    detail: str = ""
    example_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}; expected one of {VERDICTS}")
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; expected one of {ACTIONS}")

    def __str__(self) -> str:
        text = f"step {self.step}: {self.verdict} -> {self.action}"
        if self.device_ids:
            text += f" (device {', '.join(map(str, self.device_ids))})"
        if self.examples:
            text += f"; examples {list(self.examples)}"
        if self.batch is not None:
            text += f" of batch {self.batch}"
        if self.example_ids:
            text += f" (ids {list(self.example_ids)})"
        if self.skipped_batches:
            text += f"; skipped batches {list(self.skipped_batches)}"
        if self.detail:
            text += f"; {self.detail}"
        return text

    def to_json(self) -> dict[str, Any]:
        """The record as JSON data (the metric writers' ``recoveries`` entries).

        Returns:
          A dict of the fields, tuples as lists.
        """
        return {
            "step": self.step,
            "verdict": self.verdict,
            "action": self.action,
            "device_ids": list(self.device_ids),
            "examples": list(self.examples),
            "skipped_batches": list(self.skipped_batches),
            "batch": self.batch,
            "detail": self.detail,
            "example_ids": list(self.example_ids),
        }
