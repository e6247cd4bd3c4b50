"""The processes of a run: which process feeds which rows of a global batch, the global
array built from each process's own rows (no communication), and the host a process
runs on (published in the ``jax.distributed`` coordination service's key-value store).
Public through :mod:`jaxstep.distributed`.

Chunk ``i`` of a global batch runs on ``devices[i]``; when the devices span processes,
each process passes the chunks of the devices it holds, in the step's device order,
concatenated (:func:`local_rows`).
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import os
import socket
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxstep._src.core._types import Batch


def local_positions(devices: Sequence[jax.Device]) -> list[int]:
    """Positions (in the step's device order) of the devices this process holds.

    Args:
      devices: the step's devices (``step.devices``).

    Returns:
      The positions, in increasing order.

    Example:
      One process holds all 8 fake CPU devices:

      >>> import jax
      >>> from jaxstep.distributed import local_positions
      >>> local_positions(jax.devices())
      [0, 1, 2, 3, 4, 5, 6, 7]
    """
    me = jax.process_index()
    return [i for i, d in enumerate(devices) if d.process_index == me]


def local_rows(devices: Sequence[jax.Device], global_batch_size: int) -> np.ndarray:
    """The rows of the global batch this process passes, in the order it passes them.

    Chunk ``i`` of a global batch of ``global_batch_size`` rows runs on
    ``devices[i]``; a process passes the chunks of its own devices, in device order,
    concatenated. With devices ``[0, 1, 2, 3, 2048, ..., 2051]`` process 0 passes
    rows ``0 .. B/2-1`` and process 1 the rest.

    Args:
      devices: the step's devices (``step.devices``).
      global_batch_size: the rows of the global batch.

    Returns:
      The row indices, an int array.

    Raises:
      ValueError: ``global_batch_size`` does not divide by the number of devices.

    Example:
      Every process reads the same global batch and keeps its own rows (what
      :func:`local_batch` does)::

        rows = local_rows(step.devices, len(global_batch["x"]))
        batch = jax.tree.map(lambda x: x[rows], global_batch)

      Process 0's rows of a batch of 8 over two processes of two devices each:

      >>> class D:
      ...     def __init__(self, p):
      ...         self.process_index = p
      >>> local_rows([D(0), D(0), D(1), D(1)], 8).tolist()
      [0, 1, 2, 3]
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


def local_rotation(devices: Sequence[jax.Device], k: int = 1) -> np.ndarray:
    """The chunk each device runs when every process's chunks are rotated by ``k`` among
    that process's own devices: ``order[i]`` is the chunk ``devices[i]`` gets.

    A process holds only its own rows, so a replay can move a chunk only to another
    device of the same process: with positions ``P = [p0, p1, ...]`` (step order) of one
    process, ``devices[P[j]]`` gets chunk ``P[(j + k) % len(P)]``. With one process it is
    ``(i + k) % n``; a process with one device keeps its chunk. Reads only the device
    list, so every process computes the same array.

    Args:
      devices: the step's devices (anything with a ``process_index``).
      k: how far to rotate.

    Returns:
      ``order``, an int array: ``order[i]`` is the chunk ``devices[i]`` gets.

    Example:
      Two processes, of two and three devices:

    >>> class D:
    ...     def __init__(self, p):
    ...         self.process_index = p
    >>> local_rotation([D(0), D(0), D(1), D(1), D(1)]).tolist()
    [1, 0, 3, 4, 2]
    """
    order = np.arange(len(devices))
    by_process: dict[int, list[int]] = {}
    for i, d in enumerate(devices):
        by_process.setdefault(d.process_index, []).append(i)
    for positions in by_process.values():
        order[positions] = np.roll(positions, -k)
    return order


def local_batch(batch: Batch, devices: Sequence[jax.Device]) -> Any:
    """This process's rows of a global host batch (see :func:`local_rows`).

    Args:
      batch: the global batch, a pytree of host arrays (every process reads the same).
      devices: the step's devices (``step.devices``).

    Returns:
      The same pytree holding this process's rows, as numpy arrays: what this process
      passes to the step (or to ``fit``).

    Raises:
      ValueError: the batch's leading axis does not divide by the number of devices.

    Example:
      >>> import jax
      >>> import numpy as np
      >>> from jaxstep.distributed import local_batch
      >>> batch = {"x": np.arange(16).reshape(8, 2)}
      >>> local_batch(batch, jax.devices())["x"].shape  # one process: every row
      (8, 2)
    """
    return jax.tree.map(lambda x: np.asarray(x)[local_rows(devices, len(x))], batch)


def spans_processes(devices: Sequence[jax.Device]) -> bool:
    """Whether ``devices`` belong to more than one process: batches are then local
    (each process passes its own rows).

    Args:
      devices: the step's devices.

    Returns:
      True when they span processes.

    Example:
      >>> import jax
      >>> from jaxstep.distributed import spans_processes
      >>> spans_processes(jax.devices())  # 8 fake CPU devices, one process
      False
    """
    return len({d.process_index for d in devices}) > 1


def place_local_batch(
    batch: Batch,
    devices: Sequence[jax.Device],
    sharding: Any,
    positions: Sequence[int] | None = None,
    per_chunk: int = 1,
) -> Any:
    """The global batch array built from this process's rows (see :func:`local_rows`):
    chunk j of the local rows goes to the j-th local device in the step's order. One
    transfer per local device, no communication between processes. ``per_chunk``:
    devices that hold each chunk (a model group's, under ``model_parallel``; the
    devices then in the mesh's order, a group after another).

    Args:
      batch: this process's rows, a pytree of host arrays (a leaf already placed with
        ``sharding`` is kept as it is).
      devices: the step's devices.
      sharding: the global batch's ``jax.sharding.Sharding`` (the chunks over
        ``devices``).
      positions: :func:`local_positions` of ``devices``, when the caller keeps it (it
        costs O(local devices) a call).
      per_chunk: devices that hold each chunk (``model_parallel``: a model group's
        ``m``; ``devices`` then every device of the mesh, a group after another).

    Returns:
      The same pytree of global ``jax.Array`` s.

    Example:
      >>> import jax
      >>> import numpy as np
      >>> from jax.sharding import NamedSharding, Mesh, PartitionSpec as P
      >>> from jaxstep.distributed import place_local_batch
      >>> devices = jax.devices()
      >>> sharding = NamedSharding(Mesh(np.array(devices), ("devices",)), P("devices"))
      >>> x = place_local_batch({"x": np.ones((16, 3))}, devices, sharding)["x"]
      >>> x.shape, len(x.addressable_shards), x.addressable_shards[1].data.shape
      ((16, 3), 8, (2, 3))
    """
    positions = local_positions(devices) if positions is None else positions
    n_local, n = len(positions), len(devices)

    def one(x: Any) -> jax.Array:
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x  # placed already
        x = np.asarray(x)
        size = x.shape[0] * per_chunk // n_local
        shards = [  # the j-th local device holds local chunk j // per_chunk
            jax.device_put(x[j // per_chunk * size : (j // per_chunk + 1) * size], devices[p])
            for j, p in enumerate(positions)
        ]
        shape = (size * n // per_chunk, *x.shape[1:])
        return jax.make_array_from_single_device_arrays(shape, sharding, shards)

    return jax.tree.map(one, batch)


def local_rows_per_device(batch: Batch, devices: Sequence[jax.Device]) -> int:
    """Rows per device of a batch as this process passes it: its own rows when the
    devices span processes, else (or for a placed global array) the whole batch.

    Args:
      batch: a batch as this process passes it to the step.
      devices: the step's devices.

    Returns:
      The rows each device's chunk holds.

    Example:
      >>> import jax
      >>> import numpy as np
      >>> from jaxstep.distributed import local_rows_per_device
      >>> local_rows_per_device({"x": np.zeros((16, 3))}, jax.devices())
      2
    """
    first = jax.tree.leaves(batch)[0]
    size = int(first.shape[0])
    if spans_processes(devices) and not (
        isinstance(first, jax.Array) and not first.is_fully_addressable
    ):
        return size // len(local_positions(devices))
    return size // len(devices)


KEY = "jaxstep/"  # every key jaxstep sets in the store starts with this

# shares so far, by the processes sharing: every process counts its calls alike
_shares: collections.defaultdict[tuple[int, ...], itertools.count[int]] = collections.defaultdict(
    itertools.count
)


def share(
    name: str, value: Any, devices: Sequence[jax.Device], timeout_s: float = 120.0
) -> dict[int, Any]:
    """What each process of ``devices`` says: this process publishes ``value`` (JSON) in
    the coordination service's key-value store and reads every other one's.

    Every process of ``devices`` calls it, in the same order as its other calls for the
    same processes (a count, the same everywhere, keeps each call's keys apart), as it
    runs the steps of those devices: after a step they all ran, each is there. Without
    several processes (or ``jax.distributed``): ``{this process: value}``. The call's
    keys are deleted once every process has read them: a long run does not grow the
    store.

    Args:
      name: what is shared (part of the keys, and of the timeout's message).
      value: this process's value, anything JSON encodes.
      devices: the devices whose processes share.
      timeout_s: seconds to wait for each other process's value.

    Returns:
      ``{process index: value}`` for every process of ``devices``.

    Raises:
      TimeoutError: a process did not publish within ``timeout_s`` (lost, or elsewhere).

    Example:
      Without several processes, each call hears only its own process:

      >>> import jax
      >>> from jaxstep.distributed import share
      >>> share("steps", 12, jax.devices())
      {0: 12}
    """
    me = jax.process_index()
    among = tuple(sorted({int(d.process_index) for d in devices}))
    store = client()
    if store is None or len(among) < 2:
        return {me: value}
    key = f"{KEY}share/{'-'.join(map(str, among))}/{next(_shares[among])}/{name}"
    store.key_value_set(f"{key}/{me}", json.dumps(value), True)
    out = {me: value}
    for p in among:
        if p == me:
            continue
        try:
            out[p] = json.loads(store.blocking_key_value_get(f"{key}/{p}", int(timeout_s * 1000)))
        except Exception as err:  # the runtime raises its own error type on a timeout
            raise TimeoutError(
                f"process {p} did not share {name!r} within {timeout_s:g} s ({err}): lost, "
                "or not running the same step"
            ) from None
    release(key, len(among))
    return out


def release(key: str, readers: int) -> None:
    """This process is done reading the keys under ``key`` (a folder of the store, one
    call's): it says so, and the last of the ``readers`` processes to say so deletes the
    folder (the count with it), so nothing a call set outlives its reads. Best effort:
    a store that is gone keeps nothing anyway."""
    store = client()
    if store is None:
        return
    try:
        if store.key_value_increment(f"{key}/read", 1) >= readers:
            store.key_value_delete(key)
    except Exception:  # the store lives in process 0, which may be gone
        pass


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
    """The host name of a process, as :func:`jaxstep.distributed.initialize` published
    it (this process's own without it).

    Args:
      process_index: the process (``jax.Device.process_index``).

    Returns:
      The host name, or None when that process did not publish one.

    Example:
      >>> import socket
      >>> from jaxstep.distributed import host_name
      >>> host_name(0) == socket.gethostname()  # one process: its own
      True
    """
    return _host_info(int(process_index))["host"]


def process_pid(process_index: int) -> int | None:
    """The pid of a process, as :func:`jaxstep.distributed.initialize` published it
    (this process's own without it).

    Args:
      process_index: the process (``jax.Device.process_index``).

    Returns:
      The pid, or None when that process did not publish one.

    Example:
      >>> import os
      >>> from jaxstep.distributed import process_pid
      >>> process_pid(0) == os.getpid()  # one process: its own
      True
    """
    return _host_info(int(process_index))["pid"]
