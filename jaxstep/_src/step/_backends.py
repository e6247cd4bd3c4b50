"""How the one per-device body is compiled and fed: ``jax.shard_map`` (the main
backend) or ``jax.pmap`` (for code written in that style: state and outputs carry a
leading device axis). Both place chunk i of the global batch on ``devices[i]``.

A step is a :class:`jaxstep._src.program.Step`, ``step(mesh, extra_specs, state, batch,
extras) -> (state, StepOutput, changed)`` on global arrays (or its ``per_device`` at
``pmap``'s stacked edge); ``extras`` is a dict of small arrays the step threads through
(the chunk each device holds, and the faults' bookkeeping), each either replicated or
split over the devices; ``changed`` holds those the step changes (``fired``; never
``chunk``).

Copies between host and devices are named by direction: ``place_*`` puts host data on
the step's devices, ``read_*`` returns numpy copies of device data (through
:func:`jaxstep._src.core.to_host`, whose inverse is ``from_host``), and ``one_replica`` is
one device's copy of a state, left on that device."""

from __future__ import annotations

import types
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxstep._src.core import Batch
from jaxstep._src.core import PyTree
from jaxstep._src.core import TrainState
from jaxstep._src.core import from_host
from jaxstep._src.core import to_host
from jaxstep._src.program import MODEL_AXIS
from jaxstep._src.program import Grid
from jaxstep._src.program import Options
from jaxstep._src.program import Pads
from jaxstep._src.program import Plan
from jaxstep._src.program import Step
from jaxstep._src.program import global_dims
from jaxstep._src.program import merged
from jaxstep._src.program import model_dims_of
from jaxstep._src.program import model_shardings
from jaxstep._src.program import model_specs
from jaxstep._src.program import padding_of
from jaxstep._src.program import shard_spec
from jaxstep._src.step._placement import BatchPlacement

Compiled = Callable[[Any, Any, Any], tuple[Any, Any, Any]]


class Backend(Protocol):
    """What the step needs from a backend; see the two below."""

    name: str
    stacked: bool  # state leaves carry a leading device axis
    devices: list[jax.Device]
    grid: Grid  # the devices as replica groups (one group but under replicas)
    mesh: Mesh  # the step's devices (under model_parallel, with their model groups)

    def __init__(self, options: Options) -> None: ...
    def compile(self, step: Step, donate: bool, split: Mapping[str, bool]) -> Compiled: ...
    def init_sharded(self, optimizer: Any, params: PyTree) -> tuple[PyTree, PyTree]: ...
    def compile_state_fn(
        self, fn: Callable[[Any], Any], out_specs: Any = None
    ) -> Callable[[Any], Any]: ...
    def plan(self, state: Any) -> Plan | None: ...
    def pads(self, state: Any) -> Pads: ...
    def place_state(self, state: PyTree) -> PyTree: ...
    def place_batch(self, batch: Batch, leaves: Sequence[Any] | None = None) -> Batch: ...
    def place_extras(self, extras: Mapping[str, Any], split: Mapping[str, bool]) -> Any: ...
    def read_table(self, health: jax.Array) -> np.ndarray: ...
    def read_first(self, tree: PyTree) -> PyTree: ...
    def read_at(self, tree: PyTree, position: int) -> PyTree: ...
    def one_replica(self, tree: PyTree) -> PyTree: ...


class ShardMapBackend:
    """State replicated (``P()``), batch split on its leading axis (``P(axis_name)``);
    under ``shard_state``, the state's leaves sharded by the rule
    (:class:`jaxstep._src.program.Plan`) over a group of the devices (all of them, or
    ``n / replicas``: :class:`jaxstep._src.program.Grid`): global arrays with their logical
    shapes, on the state's mesh."""

    name = "shard_map"
    stacked = False

    def __init__(self, options: Options):
        self.options = options
        self.devices = list(options.devices)
        self.shard_state = options.shard_state
        self.axis = axis_name = options.axis_name
        # one axis; under model_parallel (axis_name, MODEL_AXIS), a model group a row
        self.mesh = options.mesh
        self.grid = Grid(self.mesh, options.replicas)
        self.replicated = NamedSharding(self.mesh, P())
        self.split = NamedSharding(self.mesh, P(axis_name))
        self.placement = BatchPlacement(self.mesh, axis_name)

    def compile(self, step: Step, donate: bool, split: Mapping[str, bool]) -> Compiled:
        """``step`` on the global arrays, jitted: its ``shard_map`` is its own (the
        update after it under a sharded layout)."""
        extra_specs = {k: P(self.axis) if s else P() for k, s in split.items()}
        model = self.options.model_parallel > 1

        def run(state: PyTree, batch: Batch, extras: PyTree) -> tuple[Any, Any, Any]:
            new_state, out, changed = step(self.mesh, extra_specs, state, batch, extras)
            if model and self.plan(new_state) is None:  # split over the model axis as before
                # (a sharded layout's constraint, both axes, is its own: _sharded.run)
                shardings = model_shardings(self.options, new_state)
                new_state = jax.lax.with_sharding_constraint(new_state, shardings)
            return new_state, out, changed

        return jax.jit(run, donate_argnums=(0,) if donate else ())

    def compile_state_fn(
        self, fn: Callable[[Any], Any], out_specs: Any = None
    ) -> Callable[[Any], Any]:
        """``fn(state) -> state`` run on every device's copy (a sharded layout: on its
        shards; ``out_specs``: of a result other than the state)."""
        if self.shard_state is None:
            out = P() if out_specs is None else out_specs
            return jax.jit(self.options.on_devices(fn, P(), out))

        grid = self.grid

        def run(state: Any) -> Any:  # on each device's blocks (tiled: no data moves)
            plan = self.plan(state)
            assert plan is not None  # a TrainState under a layout
            specs, blocks = grid.state_specs(plan, state), grid.block_specs(plan, state)
            out = blocks if out_specs is None else out_specs
            manual = {} if self.options.model_parallel == 1 else {"axis_names": {self.axis}}
            mapped = jax.shard_map(
                fn, mesh=self.mesh, in_specs=(blocks,), out_specs=out, check_vma=False, **manual
            )
            with global_dims(self.options, state):  # fn sees blocks: the rule's global answers
                result = mapped(grid.to_blocks(state, specs))
            return grid.from_blocks(result, specs) if out_specs is None else result

        return jax.jit(run)

    def plan(self, state: Any) -> Plan | None:
        """Where ``state``'s leaves are sharded (None: replicated, no layout)."""
        if self.shard_state is None or not isinstance(state, TrainState):
            return None
        return Plan.of(self.options, state)

    def pads(self, state: Any) -> Pads:
        """Per leaf of ``state``, the axis and pad of a leaf its layout holds padded
        (after an exclusion: :class:`jaxstep._src.program.Kept`); None: none is."""
        plan = self.plan(state)
        return plan.state_pads(state) if plan is not None and plan.pads else None

    def place_state(self, state: PyTree) -> PyTree:
        """``state`` on the devices (a layout's leaves split; a leaf it holds padded,
        after an exclusion, padded first: :class:`jaxstep._src.program.Kept`)."""
        plan = self.plan(state)
        if plan is None and self.options.model_parallel > 1 and isinstance(state, TrainState):
            return jax.device_put(state, model_shardings(self.options, state))
        if plan is None:
            return jax.device_put(state, self.replicated)
        state = plan.physical(state)
        mesh, specs = self.grid.state_mesh, self.grid.state_specs(plan, state)
        if self.options.model_parallel > 1:  # each leaf also split over the model axis
            specs = jax.tree.map(
                merged, specs, model_specs(self.options, state), is_leaf=lambda x: isinstance(x, P)
            )
        return jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    def init_sharded(self, optimizer: Any, params: PyTree) -> tuple[PyTree, PyTree]:
        """The parameters and the optimizer state of a first state, each leaf placed
        by the rule; the optimizer state made on the devices, shard by shard (``jit``
        of ``optimizer.init`` with the rule's shardings: left alone it would return
        whole leaves on one device)."""
        shapes = jax.eval_shape(optimizer.init, params)
        assert self.shard_state is not None
        plan = Plan.of(self.options, types.SimpleNamespace(params=params, opt_state=shapes))
        mesh, axis = self.grid.state_mesh, self.grid.state_axis

        on_model = model_dims_of(self.options, params, shapes)

        def named(tree: PyTree, axes: Sequence[int | None], model: Sequence[int | None]) -> PyTree:
            specs = [  # over the data axis by the plan, the model axis by model_rule
                merged(shard_spec(a, axis), shard_spec(d, MODEL_AXIS))
                for a, d in zip(axes, model, strict=True)
            ]
            return jax.tree.unflatten(
                jax.tree.structure(tree), [NamedSharding(mesh, s) for s in specs]
            )

        # Copies laid out by the rule, never the caller's own buffers: the step donates
        # its state and must not delete the caller's arrays (jax.device_put onto the
        # devices of a single-device array keeps its buffer for that device, whatever
        # may_alias says).
        # After an exclusion the optimizer sees each parameter whose gradient is padded
        # padded (zeros at the end, as inside the step); under "params" the state holds
        # it so, under "optimizer" the parameters stay whole with their own shape.
        view = params
        if plan.pads:
            view = plan.grad_view(params)
            shapes = jax.eval_shape(optimizer.init, view)
        held = self.shard_state == "params" or not plan.pads  # the state holds the view
        copy = jax.jit(
            lambda p: jax.tree.map(jnp.copy, p),
            out_shardings=named(view if held else params, plan.params, on_model[0]),
        )
        params = copy(view if held else params)
        init = jax.jit(optimizer.init, out_shardings=named(shapes, plan.opt, on_model[1]))
        opt_state = init(params if held else view)
        return params, opt_state

    def place_batch(self, batch: Batch, leaves: Sequence[Any] | None = None) -> Batch:
        """``leaves``: ``jax.tree.leaves(batch)``, when the caller has them."""
        return self.placement.place(batch, leaves)

    def place_extras(self, extras: Mapping[str, Any], split: Mapping[str, bool]) -> Any:
        return {
            k: jax.device_put(v, self.split if split[k] else self.replicated)
            for k, v in extras.items()
        }

    def read_table(self, health: jax.Array) -> np.ndarray:
        return np.asarray(health.addressable_data(0))

    def read_first(self, tree: PyTree) -> PyTree:
        """Numpy of the first addressable copy of every leaf (one read each; a sharded
        leaf whole, see :func:`whole`)."""
        host = to_host(lambda x: whole(x, np.asarray(x.addressable_data(0))), tree)
        return self._logical(host)

    def one_replica(self, tree: PyTree) -> PyTree:
        """The first addressable device's copy of every leaf, on that device: a copy
        (read and put back, as under pmap), so a later step's donation leaves it
        alone. A sharded leaf comes whole (gathered through the host)."""

        def one(x: Any) -> Any:
            if not isinstance(x, jax.Array):
                return np.asarray(x)
            data = x.addressable_data(0)
            host = to_host(lambda d: np.array(whole(x, np.asarray(d))), data)
            return jax.device_put(from_host(host), next(iter(data.devices())))

        return self._logical(jax.tree.map(one, tree))

    def read_at(self, tree: PyTree, position: int) -> PyTree:
        """The numpy copy of ``tree`` held by ``devices[position]`` (typed keys as
        :class:`jaxstep._src.core.HostKey`); a leaf sharded over the devices comes whole
        (:func:`whole`: gathered from the blocks of ``position``'s group)."""
        device = self.devices[position]
        grid = self.grid
        group = grid.groups[position // grid.m]  # a replica group: its model groups whole
        among = {d for i in group for d in self.options.groups[i]} if grid.grouped else None
        if self.options.model_parallel > 1 and self.shard_state is None:
            # a leaf split over the model axis alone, from this model group's blocks (a
            # sharded layout's leaf is split over the groups too: gathered whole)
            among = set(self.options.groups[position])
        host = to_host(
            lambda x: whole(
                x,
                next(np.asarray(s.data) for s in x.addressable_shards if s.device == device),
                among,
            ),
            tree,
        )
        return self._logical(host)

    def _logical(self, tree: PyTree) -> PyTree:
        """A state, its parameters or its optimizer state read from the devices, with
        the leaves the layout holds padded (after an exclusion) cut to their logical
        shapes (any other tree as it is)."""
        kept = padding_of(self.options)
        if self.shard_state is None or kept is None:
            return tree
        return Plan.padded(kept, self.options.group_size).logical(tree)


def owned(given: PyTree, placed: PyTree) -> PyTree:
    """``placed`` (``given`` put on the devices) with each leaf that came from a
    ``jax.Array`` of the caller's and is whole on a device copied there: ``device_put``
    onto a device that holds the caller's array keeps its buffer (whatever
    ``may_alias`` says), and the step donates its state, which would delete the
    caller's arrays (``other.place_state(step.host_state(state))`` and then a ``fit``
    left the host copy deleted). A split leaf is new buffers already; numpy is copied."""
    leaves, treedef = jax.tree.flatten(placed)
    shared = [
        isinstance(x, jax.Array) and isinstance(y, jax.Array) and y.is_fully_replicated
        for x, y in zip(jax.tree.leaves(given), leaves, strict=True)
    ]
    if not any(shared):
        return placed
    picked = [y for y, s in zip(leaves, shared, strict=True) if s]
    copies = iter(_copy_leaves(picked))
    return jax.tree.unflatten(
        treedef, [next(copies) if s else y for y, s in zip(leaves, shared, strict=True)]
    )


@jax.jit
def _copy_leaves(leaves: list[jax.Array]) -> list[jax.Array]:
    return [jnp.array(x, copy=True) for x in leaves]


def whole(x: Any, copy: np.ndarray, among: set[jax.Device] | None = None) -> np.ndarray:
    """``x`` as one numpy array: ``copy`` (one device's) when every device holds it
    whole; a leaf sharded over the devices gathered from their shards (those of the
    devices ``among``, a replica group, when given; across processes with
    ``multihost_utils.process_allgather``: a collective, which every process must call
    alike)."""
    if not isinstance(x, jax.Array) or x.is_fully_replicated:
        return copy
    if among is not None and x.is_fully_addressable:  # one group's blocks, not a twin's
        out = np.empty(x.shape, x.dtype)
        for s in x.addressable_shards:
            if s.device in among:
                out[s.index] = np.asarray(s.data)
        return out
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
