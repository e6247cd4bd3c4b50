"""Where a replay puts the chunks of a batch (:meth:`Runtime.replay`): the order of the
chunks over the devices, checked, and the batch's rows moved to match. Host code only."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxstep._src.core import Batch
from jaxstep._src.core import processes
from jaxstep._src.step._inputs import local_positions


def chunk_order(
    devices: Sequence[jax.Device], rotation: int, order: Sequence[int] | None
) -> np.ndarray:
    """The chunk each device runs in a replay: ``order`` checked, or each process's
    chunks rotated by ``rotation`` among its own devices
    (:func:`jaxstep.distributed.local_rotation`).

    Raises:
      ValueError: ``order`` is not a permutation of the device positions, or gives a
        device a chunk of another process (whose rows are not here).
    """
    if order is None:
        return processes.local_rotation(devices, rotation)
    n = len(devices)
    chunks = np.asarray(order)
    if chunks.shape != (n,) or sorted(chunks.tolist()) != list(range(n)):
        raise ValueError(
            f"replay order must be a permutation of the {n} device positions 0..{n - 1} "
            f"(order[i]: the chunk devices[i] runs), got {list(order)!r}"
        )
    crossing = [
        i
        for i, c in enumerate(chunks.tolist())
        if devices[c].process_index != devices[i].process_index
    ]
    if crossing:
        i = crossing[0]
        raise ValueError(
            f"replay order gives device {devices[i].id} (process "
            f"{devices[i].process_index}) chunk {int(chunks[i])}, whose rows process "
            f"{devices[int(chunks[i])].process_index} holds: each process passes "
            "only its own rows, so a chunk moves only among its process's devices "
            "(jaxstep.distributed.local_rotation)"
        )
    return chunks


def moved_rows(batch: Batch, devices: Sequence[jax.Device], chunks: np.ndarray) -> Batch:
    """``batch`` (this process's rows, its devices' chunks in order) with its chunks
    moved so that this process's ``devices[i]`` gets chunk ``chunks[i]``."""
    local = local_positions(devices)
    at = {p: j for j, p in enumerate(local)}  # position -> its chunk in this batch
    size = jax.tree.leaves(batch)[0].shape[0] // len(local)  # checked by the caller
    source = np.asarray([at[int(chunks[p])] for p in local], np.int64)
    rows = (source[:, None] * size + np.arange(size)[None, :]).reshape(-1)
    return jax.tree.map(lambda x: np.asarray(x)[rows], batch)
