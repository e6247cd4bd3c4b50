"""The ``pmap`` backend: the same per-device body, for code written in that style (state
and outputs carry a leading device axis).

The step compiles what ``jax.pmap`` compiles in JAX 0.10 (``jax._src.pmap``: a ``jit`` of
``shard_map`` over the stacked arrays, each device's block squeezed going in and its
results expanded coming out), called directly: ``jax.pmap``'s own Python on every call
(its argument flattening, its host-array handling) was most of a small step's host
time. The batch comes split on its leading axis as under ``shard_map`` (the same
placement, ahead of the step with ``fit``'s prefetch). The state's own moves (placing
it stacked, the small programs beside the step) keep ``jax.pmap``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxstep._src.core import Batch
from jaxstep._src.core import PyTree
from jaxstep._src.core import from_host
from jaxstep._src.core import to_host
from jaxstep._src.program import Grid
from jaxstep._src.program import Options
from jaxstep._src.program import Pads
from jaxstep._src.program import Plan
from jaxstep._src.program import Step
from jaxstep._src.step._backends import Compiled
from jaxstep._src.step._placement import BatchPlacement


class PmapBackend:
    """The same body under ``jax.pmap``: every state leaf has a leading device axis."""

    name = "pmap"
    stacked = True

    def __init__(self, options: Options):
        self.devices = list(options.devices)
        self.axis = axis_name = options.axis_name
        # in_axes=None broadcasts every leaf (typed PRNG keys too) to all devices.
        self._replicate = jax.pmap(
            lambda _, x: x, axis_name=axis_name, in_axes=(0, None), devices=self.devices
        )
        self._split = jax.pmap(lambda x: x, axis_name=axis_name, devices=self.devices)
        self.mesh = Mesh(np.array(self.devices, dtype=object), (axis_name,))
        self.grid = Grid(self.mesh, 1)  # no sharded state: one group
        self.placement = BatchPlacement(self.mesh, axis_name)

    def compile(self, step: Step, donate: bool, split: Mapping[str, bool]) -> Compiled:
        """``step``'s per-device body (the replicated layout) over the devices as
        ``jax.pmap`` maps it: the stacked layout converted at the edge, each input's
        block squeezed, each result expanded back to a leading device axis."""
        body = step.per_device

        def blocks(state: PyTree, batch: Batch, extras: PyTree) -> tuple[Any, Any, Any]:
            squeeze = functools.partial(jax.lax.squeeze, dimensions=[0])
            out = body(jax.tree.map(squeeze, state), batch, jax.tree.map(squeeze, extras))
            return jax.tree.map(functools.partial(jax.lax.expand_dims, dimensions=[0]), out)

        axis = P(self.axis)
        mapped = jax.shard_map(
            blocks, mesh=self.mesh, in_specs=axis, out_specs=axis, check_vma=False
        )
        return jax.jit(mapped, donate_argnums=(0,) if donate else ())

    def compile_state_fn(
        self, fn: Callable[[Any], Any], out_specs: Any = None
    ) -> Callable[[Any], Any]:
        """``fn(state) -> state`` run on every device's copy."""
        return jax.pmap(fn, axis_name=self.axis, devices=self.devices)

    def plan(self, state: Any) -> Plan | None:
        return None

    def pads(self, state: Any) -> Pads:
        return None

    def init_sharded(self, optimizer: Any, params: PyTree) -> tuple[PyTree, PyTree]:
        raise NotImplementedError("Options refuses a shard_state under pmap")

    def place_state(self, state: PyTree) -> PyTree:
        return self._replicate(np.arange(len(self.devices)), state)

    def place_batch(self, batch: Batch, leaves: Sequence[Any] | None = None) -> Batch:
        """Split on the leading axis, as under ``shard_map`` (each device's block is its
        chunk: nothing to squeeze)."""
        return self.placement.place(batch, leaves)

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
        device's shard alone (typed keys as :class:`jaxstep._src.core.HostKey`)."""
        device = self.devices[position]

        def read(x: Any) -> np.ndarray:
            if not isinstance(x, jax.Array):
                return np.asarray(x)[position]
            return next(np.asarray(s.data)[0] for s in x.addressable_shards if s.device == device)

        return to_host(read, tree)
