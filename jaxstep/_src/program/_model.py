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


def unit_fingerprint(
    options: Options, state: Any, leaves: list[jax.Array], given: jax.Array | None = None
) -> jax.Array:
    """:func:`~jaxstep._src.program._cross_checks.fingerprint` of ``leaves`` (those of
    ``state``'s params, optimizer state and model state, in order) over every device
    of this unit, inside the body. Without a model axis it is the device's own. Under
    ``model_parallel`` each device of the group fingerprints what it holds (its block
    of a split leaf, its own copy of a whole one: a shard_map nested over the model
    axis, where XLA would read one copy of a whole leaf per group) and the group's
    fingerprint of a leaf is their sum, each weighted by an odd constant of its model
    position: a corrupted block, or one device's corrupted copy of a whole leaf,
    changes it, and the groups compare theirs along the data axis as devices do.
    ``given``: this group's ``(m, leaves)`` from :func:`chip_prints` (the step's own
    check reads them there); None: read here (a program that only fingerprints)."""
    if options.model_parallel == 1:
        return cross_checks.fingerprint(leaves)
    weights = _weights(options.model_parallel)
    if given is None:
        given = chips_inside(options, state, leaves)
    return jnp.sum(given * weights[:, None], axis=0, dtype=jnp.uint32)


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


def group_prints(
    options: Options,
    state: Any,
    given: jax.Array,
    sharded: Sequence[bool],
    base: jax.Array | None = None,
) -> jax.Array:
    """A model group's fingerprint of each leaf of (params, optimizer state, model
    state) under a sharded layout, from its devices' own (``given``, ``(m, leaves)``,
    :func:`chip_prints` on the layout's specs), compared along the data axis as a
    device's are: a leaf every group holds alike (not ``sharded`` over the data axis)
    gives the devices' weighted sum (:func:`unit_fingerprint`: a corrupted copy or block
    changes it); a shard of the data axis has no twin in another group, but when the
    model axis does not split it too, each device of the group holds a copy of the same
    block: it gives how far those copies disagree (a weighted sum of their differences
    from the first's, 0 in a healthy group, so a group with one corrupted copy differs
    from the others); a shard split over both axes has no copy anywhere (0). ``base``:
    what the layout compares of each shard besides (FSDP's gathered parameters: a bad
    link shows there), added to a shard's value."""
    weights = _weights(options.model_parallel)[:, None]
    summed = jnp.sum(given * weights, axis=0, dtype=jnp.uint32)
    apart = jnp.sum((given - given[:1]) * weights, axis=0, dtype=jnp.uint32)  # wraps
    dims, opt = model_dims_of(options, state.params, state.opt_state)
    n_ms = len(jax.tree.leaves(state.model_state))
    split = [d is not None for d in (*dims, *opt)] + [False] * n_ms
    copies = jnp.asarray([s and not x for s, x in zip(sharded, split, strict=True)])
    alone = jnp.asarray([s and x for s, x in zip(sharded, split, strict=True)])
    base = jnp.zeros_like(summed) if base is None else base
    return jnp.where(copies, base + apart, jnp.where(alone, base, summed))


def _weights(m: int) -> jax.Array:
    """An odd constant for each model position (odd: invertible modulo 2**32, so one
    device's changed fingerprint always changes a weighted sum)."""
    return jnp.asarray(
        np.asarray([(0x9E3779B1 * (2 * j + 1)) % 2**32 | 1 for j in range(m)], np.uint32)
    )


__all__ = [
    "chip_prints",
    "chips_inside",
    "group_prints",
    "model_shardings",
    "model_specs",
    "split_leaves",
    "unit_fingerprint",
]
