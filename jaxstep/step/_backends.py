"""How the one per-device body is compiled and fed: ``jax.shard_map`` (the main
backend) or ``jax.pmap`` (for code written in that style: state and outputs carry a
leading device axis). Both place chunk i of the global batch on ``devices[i]``.

The body is ``body(state, batch, extras) -> (state, StepOutput, changed)``; ``extras``
is a dict of small arrays the step threads through (the chunk each device holds, and
the faults' bookkeeping), each either replicated or split over the devices; ``changed``
holds those the step changes (``fired``; never ``chunk``).

Copies between host and devices are named by direction: ``place_*`` puts host data on
the step's devices, ``read_*`` returns numpy copies of device data (through
:func:`jaxstep.core.to_host`, whose inverse is ``from_host``), and ``one_replica`` is
one device's copy of a state, left on that device."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Protocol

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxstep.core import Batch
from jaxstep.core import PyTree
from jaxstep.core import StepOutput
from jaxstep.core import from_host
from jaxstep.core import processes
from jaxstep.core import to_host
from jaxstep.program import AXIS

Body = Callable[[Any, Any, Any], tuple[Any, Any, Any]]
Compiled = Callable[[Any, Any, Any], tuple[Any, Any, Any]]


class Backend(Protocol):
    """What the step needs from a backend; see the two below."""

    name: str
    stacked: bool  # state leaves carry a leading device axis
    devices: list[jax.Device]

    def __init__(self, devices: Sequence[jax.Device], axis_name: str = AXIS) -> None: ...
    def compile(self, body: Body, donate: bool, split: Mapping[str, bool]) -> Compiled: ...
    def compile_state_fn(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]: ...
    def place_state(self, state: PyTree) -> PyTree: ...
    def place_batch(self, batch: Batch, leaves: Sequence[Any] | None = None) -> Batch: ...
    def place_extras(self, extras: Mapping[str, Any], split: Mapping[str, bool]) -> Any: ...
    def read_table(self, health: jax.Array) -> np.ndarray: ...
    def read_first(self, tree: PyTree) -> PyTree: ...
    def read_at(self, tree: PyTree, position: int) -> PyTree: ...
    def one_replica(self, tree: PyTree) -> PyTree: ...


class ShardMapBackend:
    """State replicated (``P()``), batch split on its leading axis (``P(axis_name)``)."""

    name = "shard_map"
    stacked = False

    def __init__(self, devices: Sequence[jax.Device], axis_name: str = AXIS):
        self.devices = list(devices)
        # Across processes each one passes its own rows: where its devices sit, once.
        self._local = (
            processes.local_positions(self.devices)
            if processes.spans_processes(self.devices)
            else None
        )
        self.axis = axis_name
        self.mesh = Mesh(np.array(self.devices, dtype=object), (axis_name,))
        self.replicated = NamedSharding(self.mesh, P())
        self.split = NamedSharding(self.mesh, P(axis_name))
        self._equivalent: dict[tuple[int, int], tuple[Any, bool]] = {}

    def compile(self, body: Body, donate: bool, split: Mapping[str, bool]) -> Compiled:
        axis = self.axis

        def stacked_aux(state: PyTree, batch: Batch, extras: PyTree) -> tuple[Any, Any, Any]:
            new_state, out, extras = body(state, batch, extras)
            # One entry per device along a new leading axis, as pmap would return it.
            return new_state, out._replace(aux=jax.tree.map(lambda x: x[None], out.aux)), extras

        extra_specs = {k: P(axis) if s else P() for k, s in split.items()}
        changed_specs = {k: s for k, s in extra_specs.items() if k != "chunk"}  # body's out
        mapped = jax.shard_map(
            stacked_aux,
            mesh=self.mesh,
            in_specs=(P(), P(axis), extra_specs),
            # metrics and health replicated, aux per device (info holds no arrays)
            out_specs=(P(), StepOutput._make((P(), P(), P(axis), P())), changed_specs),
            # Without the varying-type check: under it, replicated parameters would have
            # to be cast to device-varying before differentiating (else their gradients
            # come back already summed over the devices and no check before the
            # collective sees one device's values), and a user's scan whose carry starts
            # from constants (flax.linen.RNN) fails to trace. The body's collectives are
            # explicit; the outputs declared replicated are replicated by construction.
            check_vma=False,
        )
        return jax.jit(mapped, donate_argnums=(0,) if donate else ())

    def compile_state_fn(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fn(state) -> state`` run on every device's copy."""
        return jax.jit(
            jax.shard_map(fn, mesh=self.mesh, in_specs=P(), out_specs=P(), check_vma=False)
        )

    def place_state(self, state: PyTree) -> PyTree:
        return jax.device_put(state, self.replicated)

    def place_batch(self, batch: Batch, leaves: Sequence[Any] | None = None) -> Batch:
        """``leaves``: ``jax.tree.leaves(batch)``, when the caller has them."""
        leaves = jax.tree.leaves(batch) if leaves is None else leaves
        for x in leaves:
            if not (isinstance(x, jax.Array) and self._is_split(x)):
                break
        else:
            return batch  # already where it belongs: no device_put (~0.7 ms of host time)
        if self._local is not None:
            return processes.place_local_batch(batch, self.devices, self.split, self._local)
        return jax.device_put(batch, self.split)

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
                sharding.is_equivalent_to(self.split, x.ndim) and _auto_mesh(sharding),
            )
        return entry[1]

    def place_extras(self, extras: Mapping[str, Any], split: Mapping[str, bool]) -> Any:
        return {
            k: jax.device_put(v, self.split if split[k] else self.replicated)
            for k, v in extras.items()
        }

    def read_table(self, health: jax.Array) -> np.ndarray:
        return np.asarray(health.addressable_data(0))

    def read_first(self, tree: PyTree) -> PyTree:
        """Numpy of the first addressable copy of every leaf (one read each)."""
        return to_host(lambda x: np.asarray(x.addressable_data(0)), tree)

    def one_replica(self, tree: PyTree) -> PyTree:
        """The first addressable device's copy of every leaf, on that device: a copy
        (read and put back, as under pmap), so a later step's donation leaves it
        alone."""

        def one(x: Any) -> Any:
            if not isinstance(x, jax.Array):
                return np.asarray(x)
            data = x.addressable_data(0)
            host = to_host(lambda d: np.array(np.asarray(d)), data)
            return jax.device_put(from_host(host), next(iter(data.devices())))

        return jax.tree.map(one, tree)

    def read_at(self, tree: PyTree, position: int) -> PyTree:
        """The numpy copy of ``tree`` held by ``devices[position]`` (typed keys as
        :class:`jaxstep.core.HostKey`)."""
        device = self.devices[position]
        return to_host(
            lambda x: next(np.asarray(s.data) for s in x.addressable_shards if s.device == device),
            tree,
        )


def _auto_mesh(sharding: jax.sharding.Sharding) -> bool:
    """Whether ``sharding``'s mesh has only ``Auto`` axes. An array placed on a mesh
    with ``Explicit`` axes (``jax.make_mesh``'s default since JAX 0.9, as the
    shard_map tutorial builds it) carries its axis names into the types of what it
    flows into: the step must take it on its own mesh first (``jax.device_put``
    between equivalent shardings moves no data)."""
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ())
    return all(t == jax.sharding.AxisType.Auto for t in types)


def _own_placement(batch: Any, own: NamedSharding) -> Any:
    """``batch`` with every device array on ``own`` (the step's devices, rows split
    over its axis): an array placed on the user's mesh (other axis names, ``Explicit``
    axes) cannot be reshaped under pmap as it is."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and not _auto_mesh(x.sharding):
            return jax.device_put(x, own)
        return x

    return jax.tree.map(one, batch)


class PmapBackend:
    """The same body under ``jax.pmap``: every state leaf has a leading device axis."""

    name = "pmap"
    stacked = True

    def __init__(self, devices: Sequence[jax.Device], axis_name: str = AXIS):
        self.devices = list(devices)
        self.axis = axis_name
        # in_axes=None broadcasts every leaf (typed PRNG keys too) to all devices.
        self._replicate = jax.pmap(
            lambda _, x: x, axis_name=axis_name, in_axes=(0, None), devices=self.devices
        )
        self._split = jax.pmap(lambda x: x, axis_name=axis_name, devices=self.devices)
        # built once: a mesh and its sharding cost ~50 us, every batch
        mesh = Mesh(np.array(self.devices, dtype=object), (axis_name,))
        self._own = NamedSharding(mesh, P(axis_name))

    def compile(self, body: Body, donate: bool, split: Mapping[str, bool]) -> Compiled:
        return jax.pmap(
            body, axis_name=self.axis, devices=self.devices, donate_argnums=(0,) if donate else ()
        )

    def compile_state_fn(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fn(state) -> state`` run on every device's copy."""
        return jax.pmap(fn, axis_name=self.axis, devices=self.devices)

    def place_state(self, state: PyTree) -> PyTree:
        return self._replicate(np.arange(len(self.devices)), state)

    def place_batch(self, batch: Batch, leaves: Sequence[Any] | None = None) -> Batch:
        n = len(self.devices)
        batch = _own_placement(batch, self._own)
        return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)

    def place_extras(self, extras: Mapping[str, Any], split: Mapping[str, bool]) -> Any:
        return {
            k: self._split(np.asarray(v)) if split[k] else self.place_state(v)
            for k, v in extras.items()
        }

    def read_table(self, health: jax.Array) -> np.ndarray:
        return np.asarray(health.addressable_data(0))[0]

    def read_first(self, tree: PyTree) -> PyTree:
        """Numpy of the first addressable copy of every leaf, without the device axis."""
        return to_host(lambda x: np.asarray(x.addressable_data(0))[0], tree)

    def one_replica(self, tree: PyTree) -> PyTree:
        """The first addressable device's copy of every leaf, without the device axis,
        on that device. Read from the shard and put back: ``x[0]`` compiled a program
        per leaf shape (~2 s per call on a large state); this compiles nothing."""

        def one(x: Any) -> Any:
            if not isinstance(x, jax.Array):
                return np.asarray(x)[0]
            shard = x.addressable_shards[0]
            # a copy: the shard's buffer goes when a later step donates the state
            host = to_host(lambda d: np.array(np.asarray(d)[0]), shard.data)
            return jax.device_put(from_host(host), shard.device)

        return jax.tree.map(one, tree)

    def read_at(self, tree: PyTree, position: int) -> PyTree:
        """The numpy copy of ``tree`` held by ``devices[position]``, read from that
        device's shard alone (typed keys as :class:`jaxstep.core.HostKey`)."""
        device = self.devices[position]

        def read(x: Any) -> np.ndarray:
            if not isinstance(x, jax.Array):
                return np.asarray(x)[position]
            return next(np.asarray(s.data)[0] for s in x.addressable_shards if s.device == device)

        return to_host(read, tree)


BACKENDS: dict[str, type[Backend]] = {"shard_map": ShardMapBackend, "pmap": PmapBackend}
