"""The model axis (``make_train_step(model_parallel=m, model_rule=...)``): which
dimension of each parameter is split over a model group's ``m`` devices.

The step's mesh is ``(axis_name, MODEL_AXIS)`` of shape ``(n, m)``: the data axis
across model groups (each takes a chunk of the batch and holds the state whole along
it), the model axis inside a group. The body is manual over the data axis and leaves
the model axis to XLA (``jax.shard_map(..., axis_names={axis_name})``): ``loss_fn``
sees every parameter with its global shape, and XLA partitions the matrices over the
group as the leaves' shardings (``P(..., MODEL_AXIS, ...)`` along the rule's
dimension) and the user's ``with_sharding_constraint`` s say. Each group's own
gradient is checked before anything crosses the data axis: the group is the unit that
checks itself.

The rule is asked once for each parameter (``path`` as ``jax.tree_util.keystr``
writes it, its global shape); an optimizer-state leaf that mirrors a parameter (Adam's
moments: the same path at the end, the same shape) takes its dimension, any other
leaf (counts, the model state, keys, the monitor) is whole on every device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxstep._src.program import _cross_checks as cross_checks
from jaxstep._src.program._model_dims import model_dims
from jaxstep._src.program._model_dims import model_dims_of
from jaxstep._src.program._options import MODEL_AXIS
from jaxstep._src.program._options import Options
from jaxstep._src.program._shards import shard_spec


def merged(a: P, b: P) -> P:
    """The ``PartitionSpec`` of a leaf split by both ``a`` (over the data axis, a
    sharded layout's) and ``b`` (over the model axis): each dimension's entry from
    whichever names it (a rule never names one dimension in both: the plan avoids it)."""
    n = max(len(a), len(b))
    ea, eb = (*a, *([None] * (n - len(a)))), (*b, *([None] * (n - len(b))))
    out = [x if x is not None else y for x, y in zip(ea, eb, strict=True)]
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def model_specs(options: Options, state: Any) -> Any:
    """``state``'s ``PartitionSpec`` s on the step's mesh (a tree like it): each
    parameter split over :data:`MODEL_AXIS` along its rule's dimension, each optimizer
    leaf that mirrors one likewise, everything else whole (``P()``)."""
    whole = jax.tree.map(lambda _: P(), state)
    if options.model_parallel == 1 or options.model_rule is None:
        return whole
    dims, opt = model_dims_of(options, state.params, state.opt_state)
    as_specs = lambda tree, axes: jax.tree.unflatten(  # noqa: E731
        jax.tree.structure(tree), [shard_spec(a, MODEL_AXIS) for a in axes]
    )
    return whole.replace(
        params=as_specs(state.params, dims), opt_state=as_specs(state.opt_state, opt)
    )


def model_shardings(options: Options, state: Any) -> Any:
    """:func:`model_specs` as ``NamedSharding`` s on the step's mesh."""
    mesh = options.mesh
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        model_specs(options, state),
        is_leaf=lambda x: isinstance(x, P),
    )


def split_leaves(options: Options, state: Any) -> bool:
    """Whether the rule splits any parameter of ``state`` over the model axis."""
    if options.model_parallel == 1 or options.model_rule is None:
        return False
    return any(d is not None for d in model_dims(options, state.params))


def chip_prints(options: Options, state: Any, data_specs: Any = None) -> jax.Array:
    """Every device's fingerprints of what it holds of ``state``'s params, optimizer
    state and model state (its block of a split leaf, its own copy of a whole one),
    ``(n, m, leaves)``, split over the data axis: made at the top of the replica-check
    step, on the state as it came in, by a ``shard_map`` manual over both axes. Inside
    the body the partitioner may take a whole leaf from one device's copy (sharding
    propagation reslices it for the loss: measured, a corrupted copy on the group's
    second device went unseen and was overwritten), so the copies are read before.
    ``data_specs``: a sharded layout's specs over the data axis (each device then reads
    its block along both axes)."""
    specs = model_specs(options, state)
    if data_specs is not None:
        specs = jax.tree.map(merged, data_specs, specs, is_leaf=lambda x: isinstance(x, P))
    spec_leaves = jax.tree.leaves(
        (specs.params, specs.opt_state, specs.model_state), is_leaf=lambda x: isinstance(x, P)
    )
    leaves = jax.tree.leaves((state.params, state.opt_state, state.model_state))

    def each(*held: jax.Array) -> jax.Array:
        return cross_checks.fingerprint(list(held))[None, None]

    return jax.shard_map(
        each,
        mesh=options.mesh,
        in_specs=tuple(spec_leaves),
        out_specs=P(options.axis_name, MODEL_AXIS),
        check_vma=False,
    )(*leaves)


def chips_inside(options: Options, state: Any, leaves: list[jax.Array]) -> jax.Array:
    """Inside the body (manual over the data axis): each device of this model group's
    fingerprints of what it holds of ``leaves`` (those of ``state``'s params, optimizer
    state and model state), ``(m, leaves)``, by a ``shard_map`` nested over the model
    axis (where XLA would read one copy of a whole leaf per group)."""
    specs = model_specs(options, state)
    spec_leaves = jax.tree.leaves(
        (specs.params, specs.opt_state, specs.model_state), is_leaf=lambda x: isinstance(x, P)
    )

    def each(*held: jax.Array) -> jax.Array:
        return cross_checks.fingerprint(list(held))[None]

    return jax.shard_map(
        each,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=tuple(spec_leaves),
        out_specs=P(MODEL_AXIS),
        axis_names=frozenset({MODEL_AXIS}),
        check_vma=False,
    )(*leaves)  # (m, leaves): each device's


def unit_prints(
    options: Options,
    state: Any,
    alone: Sequence[bool] | None = None,
    given: jax.Array | None = None,
    base: jax.Array | None = None,
) -> jax.Array:
    """This unit's fingerprint of each leaf of ``state``'s (params, optimizer state,
    model state), as the units compare them along the data axis: the one place that
    says what a unit's copy of a leaf is, whatever the layout. Inside the body.

    - A leaf every unit holds alike, or a block with twins in the other replica groups
      (``replicas``: compared among them): its fingerprint; under ``model_parallel``
      the weighted sum of its model group's devices' own (``given``, ``(m, leaves)``,
      :func:`chip_prints`, read before the body; None: read here), each weighted by an
      odd constant of its model position, so that one corrupted block, or one
      device's corrupted copy of a whole leaf, changes it (XLA would read one copy per
      group).
    - ``alone``: the leaves held as shards of the data axis with no twin (one replica
      group): no other unit holds the block, so its value is ``base`` (what the layout
      compares of it besides: FSDP's gathered parameters, where a bad link shows; None:
      0). Under ``model_parallel``, when the model axis does not split it, each device
      of the group holds a copy of the block: how far those copies disagree is added (a
      weighted sum of their differences from the first's, 0 in a healthy group, so a
      group with one corrupted copy differs from the others)."""
    leaves = jax.tree.leaves((state.params, state.opt_state, state.model_state))
    m = options.model_parallel
    chips = None
    if m == 1:  # a shard's own bits are not read: nothing holds them twice
        own = cross_checks.fingerprint(
            leaves if alone is None else cross_checks.without_shards(leaves, alone)
        )
    else:
        chips = chips_inside(options, state, leaves) if given is None else given
        own = jnp.sum(chips * _weights(m)[:, None], axis=0, dtype=jnp.uint32)
    if alone is None:
        return own
    shards = jnp.zeros_like(own) if base is None else base
    if chips is not None:  # a block the model axis does not split: the group's copies
        apart = jnp.sum((chips - chips[:1]) * _weights(m)[:, None], axis=0, dtype=jnp.uint32)
        dims, opt = model_dims_of(options, state.params, state.opt_state)
        split = [d is not None for d in (*dims, *opt)]
        split += [False] * (len(leaves) - len(split))  # the model state: whole
        shards = shards + jnp.where(jnp.asarray(split), 0, apart).astype(jnp.uint32)
    return jnp.where(jnp.asarray(np.asarray(alone, bool)), shards, own)


def _weights(m: int) -> jax.Array:
    """An odd constant for each model position (odd: invertible modulo 2**32, so one
    device's changed fingerprint always changes a weighted sum)."""
    return jnp.asarray(
        np.asarray([(0x9E3779B1 * (2 * j + 1)) % 2**32 | 1 for j in range(m)], np.uint32)
    )


__all__ = [
    "chip_prints",
    "chips_inside",
    "model_shardings",
    "model_specs",
    "split_leaves",
    "unit_prints",
]
