"""The record of a run: one entry per finished step (from its health table), and
the hooks :func:`jaxstep.fit` calls."""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep.errors import TrainingWorkerError
from jaxstep.health import HealthTable


class Callback(Protocol):
    """Hooks into :func:`fit`; define the methods you need (all optional)."""

    def on_step_end(self, table: HealthTable) -> None: ...

    def on_failure(self, error: TrainingWorkerError) -> None: ...

    def on_fit_start(self, step: Any, history: History) -> None: ...

    def on_fit_end(self, history: History) -> None: ...


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
    #: the mean over devices of each scalar entry of the step's ``aux`` (e.g. accuracy)
    metrics: list[dict[str, float]] = dataclasses.field(default_factory=list)
    #: global examples over the wall time since the previous step finished (the first
    #: step's includes compiling)
    examples_per_sec: list[float] = dataclasses.field(default_factory=list)

    def append(
        self,
        table: HealthTable,
        metrics: dict[str, float] | None = None,
        examples_per_sec: float = float("nan"),
    ) -> None:
        self.step.append(table.step)
        self.loss.append(table.mean_loss)
        self.device_loss.append(table.loss)
        self.device_grad_norm.append(table.grad_norm)
        self.status.append(table.status)
        self.skipped.append(table.skipped)
        self.metrics.append(dict(metrics or {}))
        self.examples_per_sec.append(float(examples_per_sec))

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
            "examples_per_sec": np.asarray(self.examples_per_sec, np.float64),
        }


def scalar_aux(aux: Any, n: int) -> dict[str, float]:
    """The mean over devices of each scalar entry of a step's ``aux`` (one value per
    device, leading axis ``n``), named by its keys joined with ``/``. Called once the
    step has finished: reading these few numbers does not wait."""
    found = {}
    for path, x in jax.tree_util.tree_leaves_with_path(aux):
        if getattr(x, "shape", None) == (n,) and jnp.issubdtype(x.dtype, jnp.number):
            name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            found[name or "aux"] = float(np.mean(np.asarray(x, np.float64)))
    return found
