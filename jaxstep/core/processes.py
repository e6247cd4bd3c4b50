"""The processes of a run: which process feeds which rows of a global batch, the global
array built from each process's own rows (no communication), and the host a process
runs on (published in the ``jax.distributed`` coordination service's key-value store).
Public through :mod:`jaxstep.distributed`.

Chunk ``i`` of a global batch runs on ``devices[i]``; when the devices span processes,
each process passes the chunks of the devices it holds, in the step's device order,
concatenated (:func:`local_rows`).
"""

from __future__ import annotations

import functools
import json
import os
import socket
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxstep.core._types import Batch


def local_positions(devices: Sequence[jax.Device]) -> list[int]:
    """Positions (in the step's device order) of the devices this process holds."""
    me = jax.process_index()
    return [i for i, d in enumerate(devices) if d.process_index == me]


def local_rows(devices: Sequence[jax.Device], global_batch_size: int) -> np.ndarray:
    """The rows of the global batch this process passes, in the order it passes them.

    Chunk ``i`` of a global batch of ``global_batch_size`` rows runs on
    ``devices[i]``; a process passes the chunks of its own devices, in device order,
    concatenated. With devices ``[0, 1, 2, 3, 2048, ..., 2051]`` process 0 passes
    rows ``0 .. B/2-1`` and process 1 the rest.

    Example: ``local_batch = jax.tree.map(lambda x: x[local_rows(step.devices,
    len(x))], global_batch)`` (every process reading the same global batch).
    """
    n = len(devices)
    if global_batch_size % n:
        raise ValueError(
            f"global batch size {global_batch_size} does not divide by the {n} devices"
        )
    size = global_batch_size // n
    return np.concatenate(
        [np.arange(i * size, (i + 1) * size) for i in local_positions(devices)]
        or [np.zeros((0,), np.int64)]
    )


def local_batch(batch: Batch, devices: Sequence[jax.Device]) -> Any:
    """This process's rows of a global host batch (see :func:`local_rows`)."""
    return jax.tree.map(lambda x: np.asarray(x)[local_rows(devices, len(x))], batch)


def spans_processes(devices: Sequence[jax.Device]) -> bool:
    """True when ``devices`` belong to more than one process: batches are then local."""
    return len({d.process_index for d in devices}) > 1


def place_local_batch(
    batch: Batch,
    devices: Sequence[jax.Device],
    sharding: Any,
    positions: Sequence[int] | None = None,
) -> Any:
    """The global batch array built from this process's rows (see :func:`local_rows`):
    chunk j of the local rows goes to the j-th local device in the step's order. One
    transfer per local device, no communication between processes. ``positions``:
    ``local_positions(devices)``, when the caller keeps it (O(local devices) per call)."""
    positions = local_positions(devices) if positions is None else positions
    n_local, n = len(positions), len(devices)

    def one(x: Any) -> jax.Array:
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x  # placed already
        x = np.asarray(x)
        size = x.shape[0] // n_local
        shards = [
            jax.device_put(x[j * size : (j + 1) * size], devices[p])
            for j, p in enumerate(positions)
        ]
        return jax.make_array_from_single_device_arrays((size * n, *x.shape[1:]), sharding, shards)

    return jax.tree.map(one, batch)


def local_rows_per_device(batch: Batch, devices: Sequence[jax.Device]) -> int:
    """Rows per device of a batch as this process passes it: its own rows when the
    devices span processes, else (or for a placed global array) the whole batch."""
    first = jax.tree.leaves(batch)[0]
    size = int(first.shape[0])
    if spans_processes(devices) and not (
        isinstance(first, jax.Array) and not first.is_fully_addressable
    ):
        return size // len(local_positions(devices))
    return size // len(devices)


KEY = "jaxstep/"  # every key jaxstep sets in the store starts with this


def client() -> Any:
    """The distributed runtime client, or None (single process, not initialised)."""
    from jax._src import distributed as _distributed  # no public handle to the client

    return _distributed.global_state.client


@functools.cache
def _host_info(process_index: int) -> dict[str, Any]:
    c = client()
    if c is None or process_index == jax.process_index():
        return {"host": socket.gethostname(), "pid": os.getpid()}
    try:
        return dict(json.loads(c.blocking_key_value_get(f"{KEY}host/{process_index}", 5000)))
    except Exception:  # the process never published (not started via initialize)
        return {"host": None, "pid": None}


def host_name(process_index: int) -> str | None:
    """The host name of a process (published by :func:`jaxstep.distributed.initialize`),
    or None."""
    return _host_info(int(process_index))["host"]


def process_pid(process_index: int) -> int | None:
    """The pid of a process (published by :func:`jaxstep.distributed.initialize`), or
    None."""
    return _host_info(int(process_index))["pid"]
