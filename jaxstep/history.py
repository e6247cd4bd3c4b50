"""The record of a run: one entry per finished step (from its health table), and
the hooks :func:`jaxstep.fit` calls."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from jaxstep.errors import TrainingWorkerError
from jaxstep.health import HealthTable


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
