"""``fit(..., resume=True)``: the latest verified checkpoint of ``checkpoint_dir``,
restored in place of the state passed (which then only gives the structure), with the
data position to go on from; every process agrees on the step first."""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Sequence

import jax

from jaxstep.checkpoint import _coordination as coordination
from jaxstep.checkpoint._position import Position
from jaxstep.checkpoint._store import Loaded
from jaxstep.checkpoint._store import as_path
from jaxstep.checkpoint._store import conform
from jaxstep.checkpoint._store import load
from jaxstep.core import TrainState
from jaxstep.step import Runtime

log = logging.getLogger("jaxstep")


def latest(
    step: Runtime, state: TrainState, directory: str | os.PathLike[str]
) -> tuple[TrainState, Position | None]:
    """The latest verified checkpoint of ``directory`` placed for ``step`` (a step's
    runtime; ``state``
    gives its structure), and its data position; ``(state, None)`` with a warning when
    the directory holds none yet."""
    loaded = load(directory) if _has_checkpoint(directory) else None
    coordination.agree_on_restore(
        directory, None if loaded is None else loaded.meta["step"], step.devices
    )
    if loaded is None:
        warnings.warn(
            f"resume=True but {str(directory)!r} holds no checkpoint yet: "
            "training from the given state",
            stacklevel=4,  # fit's caller: fit -> FitCheckpoints.begin -> here
        )
        return state, None
    _check_positions(loaded, step.devices)
    state = step.place_state(conform(step, loaded, template=state))
    log.info("resumed from %s (data position %s)", loaded.path, loaded.position)
    return state, loaded.position


def _check_positions(loaded: Loaded, devices: Sequence[jax.Device]) -> None:
    """A checkpoint of another process count resumes only when its data positions do
    not depend on the process (a callable source: the position is the step)."""
    saved = loaded.meta.get("data_by_process")
    count = len(coordination.processes(devices))
    if saved is None or len(saved) == count:
        return
    if len({json.dumps(v, sort_keys=True) for v in saved.values()}) > 1:
        raise ValueError(
            f"checkpoint {loaded.path} was written by {len(saved)} processes, each at its "
            f"own data position ({saved}), and this run has {count}: the positions cannot "
            f"be mapped. Resume it with {len(saved)} processes, or feed batches from a "
            "callable source (batch = source(step)), whose position is the step"
        )


def _has_checkpoint(directory: str | os.PathLike[str]) -> bool:
    path = as_path(directory)
    return path.is_dir() and any(p.name.isdigit() for p in path.iterdir())
