"""The step's devices as ``replicas`` groups (``make_train_step(replicas=k)``): k groups
of ``m = n / k`` consecutive devices in the step's order. A sharded state is split over
the ``m`` devices of a group and whole in each group (MaxText's ``dcn_data`` x
``ici_fsdp``, PyTorch FSDP2's HSDP), so every shard has ``k - 1`` twins: the devices at
the same place in the other groups.

Two meshes of the same devices: the step's own, one axis (``axis_name``) over all ``n``
devices, where the body runs and the user's collectives (``pmean(x, axis_name)``) span
every device; and the state's, ``("data", "fsdp")`` of shape ``(k, m)``, where a sharded
leaf is ``P("fsdp")`` along its axis: logical shapes, each block held by its ``k``
twins. Inside the step a sharded leaf is handed to the body as its blocks tiled over
all ``n`` devices (``k`` copies along its axis: the same buffers, no data moves: an
identity ``shard_map`` on the state's mesh), and the collectives of a group use
``axis_index_groups`` on the step's axis: a gather and a reduce-scatter inside a group,
an all-reduce of the scattered block across its twins. With ``k = 1`` there is one
group, the state's mesh is the step's, and nothing is tiled.

Under ``model_parallel = p`` the step's mesh is ``(axis_name, "model")`` of shape
``(n, p)``, a unit a model group, and the state's ``("data", "fsdp", "model")`` of
shape ``(k, m, p)``: the same collectives, on the step's axis, each run by every
device of a model group on its own block of a leaf the model rule splits
(:meth:`Links.of_leaf`).
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxstep._src.core import PyTree
from jaxstep._src.program._chips import MODEL_AXIS
from jaxstep._src.program._shards import Plan
from jaxstep._src.program._shards import shard_spec

#: The state mesh's axes under ``replicas > 1``: across groups (the data parallelism
#: between them, MaxText's ``data``) and inside a group (the sharding, ``fsdp``).
REPLICA_AXIS, SHARD_AXIS = "data", "fsdp"


Groups = tuple[tuple[int, ...], ...]


class Links(NamedTuple):
    """A group's collectives on the step's axis, hashable (a ``custom_vjp``'s static
    argument): the axis, the groups a gather and a reduce-scatter run inside (None:
    all the devices), the sets of twins a scattered block is summed across (None:
    one group), and, under ``model_parallel``, the leaf's dimension split over the
    model axis (None: whole on every device of a model group; :meth:`of_leaf`)."""

    axis: str
    within: Groups | None
    twins: Groups | None
    model: int | None = None

    def of_leaf(self, model: int | None) -> Links:
        """These links for a leaf split over the model axis along ``model``."""
        return self._replace(model=model)

    def gather(self, x: jax.Array, axis: int) -> jax.Array:
        """A leaf's whole from its blocks, inside this device's group."""
        return self._per_chip(
            lambda b: jax.lax.all_gather(
                b, self.axis, axis=axis, tiled=True, axis_index_groups=self.within
            ),
            x,
        )

    def scatter(self, g: jax.Array, axis: int) -> jax.Array:
        """This device's block of the sum over every device of ``g``: reduce-scattered
        inside the group, then summed across the block's twins."""

        def each(g: jax.Array) -> jax.Array:
            block = jax.lax.psum_scatter(
                g, self.axis, scatter_dimension=axis, tiled=True, axis_index_groups=self.within
            )
            if self.twins is not None:
                block = jax.lax.psum(block, self.axis, axis_index_groups=self.twins)
            return block

        return self._per_chip(each, g)

    def _per_chip(self, fn: Any, x: jax.Array) -> jax.Array:
        """``fn`` on ``x``; a leaf split over the model axis by each device of the model
        group on its own block (a ``shard_map`` nested over the model axis). Left to
        XLA, a collective over the data axis in the partly automatic body replicates
        its operand over the model axis first: measured, every split 1024x1024 kernel
        of an FSDP x TP step was all-gathered whole, 3.6x the step's time."""
        if self.model is None:
            return fn(x)
        spec = shard_spec(self.model, MODEL_AXIS)
        return jax.shard_map(
            fn,
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=spec,
            out_specs=spec,
            axis_names=frozenset({MODEL_AXIS}),
            check_vma=False,
        )(x)


class Grid:
    """``n`` devices as ``k`` groups of ``m``, on the step's one-axis mesh ``mesh``."""

    def __init__(self, mesh: Mesh, replicas: int):
        self.mesh = mesh
        self.axis: str = mesh.axis_names[0]
        self.n = int(mesh.devices.shape[0])  # units: a model group each (a device without)
        self.k = replicas
        self.m = self.n // replicas
        #: the units (positions on the step's axis) of each group, and each set of twins
        self.groups = [[g * self.m + j for j in range(self.m)] for g in range(self.k)]
        self.twins = [[g * self.m + j for g in range(self.k)] for j in range(self.m)]
        if self.k > 1:  # under a model axis it stays the state mesh's last axis
            devices = mesh.devices.reshape(self.k, self.m, *mesh.devices.shape[1:])
            self.state_mesh = Mesh(devices, (REPLICA_AXIS, SHARD_AXIS, *mesh.axis_names[1:]))
            self.state_axis = SHARD_AXIS
        else:
            self.state_mesh, self.state_axis = mesh, self.axis

    @property
    def grouped(self) -> bool:
        """Whether there are several groups (every shard has twins)."""
        return self.k > 1

    # -- collectives of a group, inside the step (the step's axis) -----------------

    @property
    def links(self) -> Links:
        """The group's collectives (:class:`Links`)."""
        if not self.grouped:
            return Links(self.axis, None, None)
        as_tuples = lambda sets: tuple(tuple(s) for s in sets)  # noqa: E731
        return Links(self.axis, as_tuples(self.groups), as_tuples(self.twins))

    def twin_sources(self, bad: jax.Array) -> jax.Array:
        """For ``(n,)`` flags of devices whose copy is off: per device, the position of
        the first twin of its (itself included) that is not, or of its first twin when
        all are (nothing to copy from)."""
        by_place = ~bad.reshape(self.k, self.m)  # (group, place in the group)
        first = jnp.argmax(by_place, axis=0) * self.m + jnp.arange(self.m)  # (m,)
        return jnp.tile(first, self.k)

    # -- the state's layout --------------------------------------------------------

    def state_specs(self, plan: Plan, state: Any) -> Any:
        """``state``'s ``PartitionSpec`` s on the state's mesh (a tree like it)."""
        return plan.specs(state, self.state_axis)

    def block_specs(self, plan: Plan, state: Any) -> Any:
        """``state``'s ``PartitionSpec`` s on the step's mesh, as the body takes it: each
        sharded leaf's blocks tiled over every device (one group: split over them)."""
        return plan.specs(state, self.axis)

    def to_blocks(self, tree: PyTree, specs: PyTree) -> PyTree:
        """``tree`` (on the state's mesh, laid out by ``specs``) as the body takes it on
        the step's mesh: each sharded leaf ``k`` times along its axis, the blocks in
        device order (the same buffers: no data moves). Identity with one group."""
        if not self.grouped:
            return tree
        return jax.tree.map(lambda x, s: self._retile(x, s, inward=True), tree, specs)

    def from_blocks(self, tree: PyTree, specs: PyTree) -> PyTree:
        """The inverse of :meth:`to_blocks`: each device's block of a sharded leaf taken
        as the leaf's block on the state's mesh (its twins hold the same bits: the step
        keeps them so, and the replica check compares them)."""
        if not self.grouped:
            return tree
        return jax.tree.map(lambda x, s: self._retile(x, s, inward=False), tree, specs)

    def _retile(self, x: jax.Array, spec: P, *, inward: bool) -> jax.Array:
        """One leaf between the two layouts, by an identity ``shard_map`` on the state's
        mesh (each device keeps its block); a whole leaf as it is."""
        if SHARD_AXIS not in tuple(spec):
            return x
        tiled = P(*[(REPLICA_AXIS, SHARD_AXIS) if a == SHARD_AXIS else a for a in spec])
        specs = (spec, tiled) if inward else (tiled, spec)
        return jax.shard_map(
            lambda b: b,
            mesh=self.state_mesh,
            in_specs=specs[0],
            out_specs=specs[1],
            # a model axis (``model_parallel``) left to XLA: the leaf's split over it
            # stays as it is, whichever dimension the model rule put it on
            axis_names=frozenset({REPLICA_AXIS, SHARD_AXIS}),
            check_vma=False,  # the twins hold the same block: the step keeps them so
        )(x)
