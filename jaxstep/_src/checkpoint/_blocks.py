"""A sharded state's leaves in a checkpoint (``make_train_step(shard_state=...)``).

A checkpoint holds every leaf whole, with its logical shape, whatever the layout that
wrote it: it restores onto any layout and device count. With one process the writer
reads the sharded leaves whole (``jax.device_get`` of the global arrays). With several,
no process holds another's shards, and an orbax save of arrays that span processes
would need every process in its barriers, where jaxstep's rule is that a lost peer can
only make a read time out (:mod:`jaxstep._src.checkpoint._coordination`). So each process
writes its own blocks (one copy of each shard, ``replica_id == 0``) as plain numpy
files, ``<root>/blocks/<step>/process_<i>.npz`` (each block with its index in the whole
array), the writer writes the step once every part is in (the replicated leaves, and an
one-element placeholder for each sharded one), and reading the step assembles the leaves.
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxstep._src.program import Pads
from jaxstep._src.program import cut

#: where the blocks of step ``k`` are, under the store's root
DIRECTORY = "blocks"


def local_copies(tree: Any, stacked: bool, copy: Any) -> list[Any]:
    """The leaves a checkpoint is written from, copied on the devices (dispatched, not
    waited for): one device's replica of each replicated leaf (``copy``: the jitted
    copy of such leaves, keys as key data), and each leaf sharded over the devices as a
    copy of the global array (every device copies its shard)."""
    leaves = jax.tree.leaves(tree)
    spread = [i for i, x in enumerate(leaves) if _sharded(x)]
    if not spread or stacked:
        return list(copy([x.addressable_data(0) for x in leaves], stacked))
    held = [i for i in range(len(leaves)) if i not in set(spread)]
    out: list[Any] = [None] * len(leaves)
    for i, x in zip(held, copy([leaves[i].addressable_data(0) for i in held], False), strict=True):
        out[i] = x
    for i, x in zip(spread, _copy_global([leaves[i] for i in spread]), strict=True):
        out[i] = x
    return out


@jax.jit
def _copy_global(leaves: list[jax.Array]) -> list[jax.Array]:
    return [jax.numpy.copy(x) for x in leaves]


def _sharded(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.sharding.is_fully_replicated


def spread(tree: Any) -> bool:
    """Whether a leaf of ``tree`` is sharded across processes (each writes its blocks)."""
    return any(_sharded(x) and not x.is_fully_addressable for x in jax.tree.leaves(tree))


def to_host(
    leaves: Sequence[Any], pads: Pads = None
) -> tuple[list[np.ndarray], dict[str, Any] | None]:
    """Numpy of ``leaves`` (:func:`local_copies`, or a state's leaves, keys as key data):
    each whole when this process holds all of it. Otherwise (a leaf sharded across
    processes) a one-element placeholder in its place, and this process's blocks of it in
    the second value (None when there are none), for :func:`write`. ``pads``: the leaves
    a layout holds padded, cut to their logical shapes (a block in the padding dropped)."""
    cuts: list[Any] = list(pads) if pads else [None] * len(leaves)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return logical([np.asarray(x) for x in jax.device_get(list(leaves))], pads), None
    host: list[np.ndarray] = []
    blocks: dict[str, Any] = {}
    for i, x in enumerate(leaves):
        if not _sharded(x):
            host.append(np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x))
            continue
        host.append(np.zeros((1,), x.dtype))  # orbax saves no empty array
        for k, shard in enumerate(s for s in x.addressable_shards if s.replica_id == 0):
            bounds = [
                (s.start or 0, x.shape[d] if s.stop is None else s.stop)
                for d, s in enumerate(shard.index)
            ]
            data = np.asarray(shard.data)
            if cuts[i] is not None:  # the part of the block inside the logical shape
                axis, (length, _) = cuts[i]
                start, stop = bounds[axis]
                if start >= length:
                    continue
                bounds[axis] = (start, min(stop, length))
                data = cut(data, axis, min(stop, length) - start)
            blocks[f"{i}_{k}"] = data
            blocks[f"{i}_{k}_at"] = np.asarray(bounds, np.int64).reshape(-1, 2)
    return host, blocks


def logical(leaves: Sequence[Any], pads: Pads) -> list[Any]:
    """Host ``leaves`` with each one a layout holds padded cut to its logical shape."""
    if not pads:
        return list(leaves)
    return [x if p is None else cut(x, p[0], p[1][0]) for x, p in zip(leaves, pads, strict=True)]


def write(root: Any, number: int, process: int, blocks: dict[str, Any]) -> None:
    """Writes this process's ``blocks`` of step ``number`` under ``root``."""
    where = root / DIRECTORY / str(number)
    where.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, **blocks)
    (where / f"process_{process}.npz").write_bytes(buffer.getvalue())


def assemble(root: Any, number: int, meta: dict[str, Any], leaves: list[Any]) -> list[Any]:
    """``leaves`` as read from step ``number``, each placeholder filled from the
    processes' blocks (``meta["blocks"]``: the processes that wrote them, the leaves'
    shapes and dtypes).

    Raises:
      ValueError: a process's part is missing (lost before it was written).
    """
    info = meta["blocks"]
    shapes, dtypes = info["shapes"], info["dtypes"]
    out = list(leaves)
    filled: dict[int, np.ndarray] = {}
    for process in info["processes"]:
        path = root / DIRECTORY / str(number) / f"process_{process}.npz"
        if not path.exists():
            raise ValueError(
                f"checkpoint step {number} in {str(root)!r} is missing the shards of process "
                f"{process} ({path}): it was lost before writing them. Restore an earlier "
                "checkpoint"
            )
        with np.load(io.BytesIO(path.read_bytes())) as saved:
            for key in saved.files:
                if key.endswith("_at"):
                    continue
                i = int(key.split("_")[0])
                whole = filled.setdefault(i, np.zeros(shapes[str(i)], dtypes[str(i)]))
                at = saved[f"{key}_at"]
                whole[tuple(slice(int(a), int(b)) for a, b in at)] = saved[key]
    for i, whole in filled.items():
        out[i] = whole
    return out


def describe(leaves: Sequence[Any], processes: Sequence[int], pads: Pads = None) -> dict[str, Any]:
    """``meta["blocks"]`` for a step whose sharded ``leaves`` the ``processes`` wrote
    (``pads``: the leaves a layout holds padded, with their logical shapes)."""
    spread = {i: x for i, x in enumerate(leaves) if _sharded(x)}
    shapes = {i: list(x.shape) for i, x in spread.items()}
    for i, p in enumerate(pads or ()):
        if p is not None and i in shapes:
            shapes[i][p[0]] = p[1][0]
    return {
        "processes": list(processes),
        "shapes": {str(i): s for i, s in shapes.items()},
        "dtypes": {str(i): str(x.dtype) for i, x in spread.items()},
    }


def forget_older(root: Any, keep: Sequence[int], written: int) -> None:
    """Deletes the blocks of steps older than ``written`` (the step just written) no
    longer in the store (orbax deleted them). A newer step's blocks are left alone: the
    other processes may have written theirs before this one finished ``written``."""
    base = root / DIRECTORY
    if not base.exists():
        return
    for path in base.iterdir():
        number = int(path.name) if path.name.isdigit() else None
        if number is not None and number < written and number not in keep:
            if hasattr(path, "rmtree"):
                path.rmtree()
            else:
                shutil.rmtree(path, ignore_errors=True)
