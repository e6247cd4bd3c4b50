"""``fit(..., recover=jaxstep.Recover(...))``: act on each failure's verdict and go on.

A failed step under ``recover`` is diagnosed (the replay of :mod:`jaxstep.loop._diagnose`)
and acted on, within a budget:

- ``transient`` -> the step again from the last good state with the same batch;
- ``data`` -> the step again with the chunks holding the offending examples left out of
  the mean (``on_failure="drop"``'s mechanism); the examples are quarantined;
- ``device`` -> training goes on without the device (``step.devices`` shrinks);
- a loss spike -> back to the last verified checkpoint, the spike's batches skipped;
- a diverged replica -> repaired from the majority, or rolled back;
- a hang -> the emergency save, then the process exits for ``launch --restarts``.

Each action is a :class:`~jaxstep.loop.Recovery` in ``History.recoveries``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Recover:
    """How :func:`jaxstep.fit` recovers from failures instead of raising.

    Attributes:
      retries: how many times a step whose failure does not come back on replay
        (a transient fault) is run again with the same batch, from the last good state.
      quarantine: act on a ``data`` verdict: the step again with the chunks holding the
        offending examples left out of the mean, the examples recorded (and, with
        ``checkpoint_dir``, appended to its quarantine file: :func:`read_quarantine`).
      exclude_devices: act on a ``device`` verdict: go on without the device.
      rollback_batches: act on a loss spike (``make_train_step(loss_spike=...)`` and
        ``fit(checkpoint_dir=...)``): restore the last verified checkpoint before it,
        skip the spike's batch and the ``rollback_batches - 1`` before it, and train the
        other batches since the checkpoint again. None: a spike is not recovered.
      max_recoveries: the most actions one fit call takes; the next failure raises
        :class:`~jaxstep.TrainingWorkerError` as without ``recover``, listing them.
    """

    retries: int = 1
    quarantine: bool = True
    exclude_devices: bool = True
    rollback_batches: int | None = None
    max_recoveries: int = 10

    def __post_init__(self) -> None:
        for name in ("retries", "max_recoveries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Recover({name}=...) must be an int >= 0, got {value!r}")
        for name in ("quarantine", "exclude_devices"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"Recover({name}=...) must be True or False, got {getattr(self, name)!r}"
                )
        k = self.rollback_batches
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(
                f"Recover(rollback_batches=...) must be None or an int >= 1 (the spike's "
                f"batch and the k - 1 before it are skipped), got {k!r}"
            )
