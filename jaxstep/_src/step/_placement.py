"""How a step's batches reach its devices (:class:`BatchPlacement`): split on the leading
axis, chunk ``i`` on ``devices[i]``, one global array per leaf. A batch already placed
so (fit's prefetch thread, or the user's own mesh with the same layout) is taken as it
is; host arrays are transferred chunk by chunk, by a plan made once per batch layout.

``jax.device_put`` of a host array costs ~90 Python calls a leaf (measured with
``sys.setprofile``, jax 0.10.2), most of a small model's host time per step; the plan
keeps each leaf's abstract value, sharding and row ranges, and hands the chunks to the
runtime's own batched transfer (``jax.device_put``'s last step) in one call a leaf. Where
that call is missing (another jaxlib), or for anything but a plain host array of its
final dtype, ``jax.device_put`` places it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxstep._src.core import Batch
from jaxstep._src.core import processes

try:  # the runtime's batched transfer: what jax.device_put ends in for host arrays
    from jax._src.lib import xla_client as _xc

    _batched_device_put: Any = _xc.batched_device_put
except (ImportError, AttributeError):  # pragma: no cover (another jaxlib)
    _batched_device_put = None


class BatchPlacement:
    """The placement of a step's batches on ``mesh``'s devices, split over ``axis``."""

    def __init__(self, mesh: Mesh, axis: str):
        self.devices: list[jax.Device] = list(mesh.devices.flat)
        self.split = NamedSharding(mesh, P(axis))
        #: devices per chunk: a model group (``model_parallel``) takes one chunk whole
        self._per_chunk = len(self.devices) // mesh.shape[axis]
        # Across processes each one passes its own rows: where its devices sit, once.
        self._local = (
            processes.local_positions(self.devices)
            if processes.spans_processes(self.devices)
            else None
        )
        self._equivalent: dict[tuple[int, int], tuple[Any, bool]] = {}
        self._plans: dict[tuple[Any, ...], tuple[Any, list[tuple[int, int]]] | None] = {}

    def place(self, batch: Batch, leaves: Sequence[Any] | None = None) -> Batch:
        """``batch`` on the devices (``leaves``: ``jax.tree.leaves(batch)``, when the
        caller has them)."""
        if leaves is None:
            leaves = jax.tree.leaves(batch)
        if self._local is None and all([type(x) is np.ndarray for x in leaves]):
            return self._transfer(batch, leaves)
        for x in leaves:
            if not (isinstance(x, jax.Array) and self._is_split(x)):
                break
        else:
            return batch  # already where it belongs: no device_put
        if self._local is not None:
            return processes.place_local_batch(
                batch, self.devices, self.split, self._local, self._per_chunk
            )
        return jax.device_put(batch, self.split)

    def _transfer(self, batch: Batch, leaves: Sequence[np.ndarray]) -> Batch:
        """Host arrays, chunk by chunk, by the plan of their layout."""
        placed = []
        for x in leaves:
            plan = self._plan(x)
            if plan is None:
                placed.append(jax.device_put(x, self.split))
                continue
            aval, ranges = plan
            chunks = [x[lo:hi] for lo, hi in ranges]
            placed.append(_batched_device_put(aval, self.split, chunks, self.devices, True))
        return jax.tree.unflatten(jax.tree.structure(batch), placed)

    def _plan(self, x: np.ndarray) -> tuple[Any, list[tuple[int, int]]] | None:
        """A host leaf's abstract value and each device's rows, or None: left to
        ``jax.device_put`` (its dtype changes on the way, or no batched transfer)."""
        key = (x.shape, x.dtype)
        if key not in self._plans:
            plan = None
            want = jax.dtypes.canonicalize_dtype(x.dtype)
            if _batched_device_put is not None and x.ndim and np.dtype(want) == x.dtype:
                per = self._per_chunk
                size = x.shape[0] * per // len(self.devices)
                ranges = [
                    (i // per * size, (i // per + 1) * size) for i in range(len(self.devices))
                ]
                plan = (jax.core.ShapedArray(x.shape, x.dtype), ranges)
            self._plans[key] = plan
        return self._plans[key]

    def _is_split(self, x: jax.Array) -> bool:
        """Whether ``x`` is split like ``self.split`` (any mesh axis name), cached per
        sharding object: a batch placed by the user's own mesh needs no ``device_put``.
        Keyed by identity (hashing a sharding costs more than the rest of the check);
        the entry holds the sharding, so its id is not reused while cached."""
        sharding = x.sharding
        key = (id(sharding), x.ndim)
        entry = self._equivalent.get(key)
        if entry is None or entry[0] is not sharding:
            entry = self._equivalent[key] = (
                sharding,
                sharding.is_equivalent_to(self.split, x.ndim) and auto_mesh(sharding),
            )
        return entry[1]


def auto_mesh(sharding: jax.sharding.Sharding) -> bool:
    """Whether ``sharding``'s mesh has only ``Auto`` axes. An array placed on a mesh
    with ``Explicit`` axes (``jax.make_mesh``'s default since JAX 0.9, as the
    shard_map tutorial builds it) carries its axis names into the types of what it
    flows into: the step must take it on its own mesh first (``jax.device_put``
    between equivalent shardings moves no data)."""
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ())
    return all(t == jax.sharding.AxisType.Auto for t in types)
