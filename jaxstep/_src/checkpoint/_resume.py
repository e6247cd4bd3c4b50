"""A fit call's checkpointing begins (:func:`begin_fit`): with ``resume=True`` the latest
verified checkpoint of ``checkpoint_dir`` is restored in place of the state passed
(which then only gives the structure), with the data position to go on from (every
process agrees on the step first); the data is opened there."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxstep._src.checkpoint import _coordination as coordination
from jaxstep._src.checkpoint._options import CheckpointOptions
from jaxstep._src.checkpoint._position import Position
from jaxstep._src.checkpoint._position import Source
from jaxstep._src.checkpoint._position import is_callable_source
from jaxstep._src.checkpoint._saver import Saver
from jaxstep._src.checkpoint._store import Loaded
from jaxstep._src.checkpoint._store import Store
from jaxstep._src.checkpoint._store import as_path
from jaxstep._src.checkpoint._store import conform
from jaxstep._src.checkpoint._store import load
from jaxstep._src.core import TrainState
from jaxstep._src.core import log
from jaxstep._src.core import warn
from jaxstep._src.step import Runtime


def begin_fit(
    step: Runtime,
    state: TrainState,
    batches: Any,
    options: CheckpointOptions | None = None,
    *,
    lookahead: int = 0,
    **keywords: Any,
) -> tuple[TrainState, Source, Saver]:
    """One fit call's checkpointing begins: restores the latest verified checkpoint
    when ``options.resume``, and opens
    ``batches`` at the data position (``keywords``: the options, when ``options`` is
    not given). ``step``: the step's runtime; ``lookahead``: batches fit pulls ahead
    of the one it trains (its prefetch).

    Returns:
      (the state to train from, the batches to pull, the run's :class:`Saver`).
    """
    if options is None:
        options = CheckpointOptions(**keywords)
    directory, every = options.checkpoint_dir, options.checkpoint_every
    among = coordination.processes(step.devices)
    if directory is not None and jax.process_count() > 1 and 0 not in among:
        raise ValueError(
            f"checkpoint_dir with a step on the devices of process(es) {among} only: "
            "process 0 writes the checkpoints (orbax writes host arrays from process 0 "
            "alone), so the step's devices must include process 0's (the default, "
            "jax.devices())"
        )
    position = None
    if options.resume:  # the state passed only gives the structure
        assert directory is not None
        state, position = latest(step, state, directory)
    else:
        step.check_state(state)
    resuming = position is not None
    first = int(np.asarray(state.step).reshape(-1)[0])
    if position is None:
        position = Position(first if is_callable_source(batches) else 0, "")
    source = Source(
        batches,
        position,
        resuming=resuming,
        checkpointing=every is not None,
        lookahead=lookahead,
    )
    store = None
    if directory is not None:
        store = Store(directory, keep=options.keep, create=True)
        # (On resume, steps after the restored one were passed over as unreadable or
        # unverified: they are never restored, and never overwritten.)
        ahead = [n for n in store.steps() if n > first]
        if ahead and every is not None and not resuming:
            store.close()
            raise ValueError(
                f"{str(directory)!r} holds checkpoints of steps {ahead}, ahead of "
                f"this state (step {first}): they come from another run, and "
                "resume=True would pick them. Use a new checkpoint_dir, delete them, or "
                "pass resume=True to go on from the latest"
            )
    return state, source, Saver(step, store, every, source, first)


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
        warn(
            f"resume=True but {str(directory)!r} holds no checkpoint yet: "
            "training from the given state"
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
