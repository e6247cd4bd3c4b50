"""Flax's partitioning metadata as a ``make_train_step(shard_rule=...)``: the boxes of
what ``model.init`` returns name a mesh axis per dimension; the rule shards each leaf
along the dimension named for the data-parallel group, and keeps the others whole."""

# Imports are absolute, so ``flax`` below is the real Flax package, not jaxstep.flax.
from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import numpy as np
from flax import linen as nn
from flax import nnx
from flax.core import meta

from jaxstep._src.core.names import leaf_name
from jaxstep._src.core.names import without_root

#: ``(logical_name, mesh_axes)`` pairs, as ``nn.logical_axis_rules`` takes them.
Rules = Sequence[tuple[str, Any]]

_PARAMS = "['params']"  # the collection in front of a path written from ``variables``
_SHOWN = 6  # leaves an error or a repr lists before "... and N more"


def shard_rule(
    variables: Mapping[str, Any],
    *,
    axes: str | Sequence[str] = ("fsdp",),
    rules: Sequence[tuple[str, Any]] | None = None,
) -> Callable[[str, tuple[int, ...]], int | None]:
    """A ``make_train_step(shard_rule=...)`` from flax's partitioning metadata.

    Reads the boxes that ``nn.with_partitioning(init, names)`` (``nn.Partitioned``:
    mesh axis names) and ``nn.with_logical_partitioning(init, names)``
    (``nn.LogicallyPartitioned``: logical names, mapped to mesh axes by ``rules``
    with ``nn.logical_to_mesh_axes``, priorities included) put in what
    ``model.init`` returns. Each leaf is sharded along its dimension whose mesh axis
    is one of ``axes`` (a dimension named ``("data", "fsdp")`` counts when either
    name is), and kept whole when none is or it has no box (a bias made without
    ``with_partitioning``). The other mesh axes (``"tensor"``, the ``"layers"`` that
    ``nn.scan(..., metadata_params={nn.PARTITION_NAME: "layers"})`` adds) mean
    nothing to jaxstep, whose one axis is the data-parallel group. Everything is read
    and checked here, once; the rule itself only looks leaves up.

    The rule answers for a path with or without the leading ``['params']``, so
    whether ``step.init`` gets ``variables["params"]`` or the output of
    :func:`linen_split` does not matter; for an optimizer-state leaf (``"opt_state..."``)
    it gives the axis of the parameter it mirrors (its path ends with the
    parameter's, its shape is the parameter's), and None for the others (Adam's
    count). A leaf whose named dimension does not divide by the step's group of
    devices (2 heads over 8) is split anyway, held padded with zeros to the next
    multiple, and the step's log says so at ``step.init``, naming the leaf; a leaf
    under the step's ``shard_min_size`` stays whole.

    Args:
      variables: what ``model.init(key, x)`` returns, boxes kept (also its
        ``["params"]``, or ``jax.eval_shape(model.init, key, x)``: no memory used).
      axes: the mesh axis name(s) that mean "the data-parallel group": the
        dimension named for one of them is the one sharded. MaxText's and
        big_vision's FSDP axis ``"fsdp"`` by default.
      rules: ``(logical_name, mesh_axes)`` pairs, as ``nn.logical_axis_rules`` and
        MaxText's ``logical_axis_rules`` write them, for the logical boxes that hold
        no rules of their own (flax's order: a box's rules, then these, then those
        of an enclosing ``with nn.logical_axis_rules(...)``).

    Returns:
      ``rule(path, shape) -> axis | None`` for ``make_train_step(shard_state=...,
      shard_rule=rule)``; its ``repr`` lists the leaves it shards.

    Raises:
      ValueError: no leaf is partitioned over ``axes`` (the message lists the mesh
        axes the boxes name, or says there are no boxes: the variables were
        unboxed, e.g. by :func:`linen_split`); a leaf is partitioned over ``axes``
        along two dimensions (jaxstep shards a leaf along one: name one of them,
        or narrow ``axes``); a leaf has more names than dimensions; a logical box
        has no rules to map its names; ``rules`` are not pairs. The rule raises
        ValueError for a parameter path or shape that is not in ``variables``.
      TypeError: ``variables`` is not a dict of linen collections (an NNX module or
        state: its shardings are not read yet).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import linen as nn
      >>> init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "fsdp"))
      >>> variables = nn.Dense(16, kernel_init=init).init(jax.random.key(0), jnp.ones((1, 8)))
      >>> rule = shard_rule(variables)
      >>> rule("['kernel']", (8, 16)), rule("['bias']", (16,))
      (1, None)
    """
    return _read(variables, _axes(axes), rules, "shard_rule")


def model_rule(
    variables: Mapping[str, Any],
    *,
    axes: str | Sequence[str] = ("tensor", "model"),
    rules: Sequence[tuple[str, Any]] | None = None,
) -> Callable[[str, tuple[int, ...]], int | None]:
    """A ``make_train_step(model_rule=...)`` from flax's partitioning metadata: what
    :func:`shard_rule` reads, for the model axis. Each leaf is split over a model group
    along its dimension whose mesh axis is one of ``axes`` (MaxText's ``"tensor"``,
    levanter's ``"model"``; with logical names, those ``rules`` map there: MaxText's
    ``("mlp", "tensor")``, ``("heads", "tensor")``, ``("vocab", "tensor")``), and held
    whole on every device of the group when none is. An optimizer-state leaf that
    mirrors a parameter gets its dimension. Unlike ``shard_rule`` nothing is padded: a
    named dimension the group's ``model_parallel`` does not divide is refused at
    ``step.init``, naming the leaf.

    Args:
      variables: what ``model.init(key, x)`` returns, boxes kept (or its ``["params"]``,
        or ``jax.eval_shape(model.init, key, x)``).
      axes: the mesh axis name(s) that mean "the model group".
      rules: ``(logical_name, mesh_axes)`` pairs for logical boxes, as
        ``nn.logical_axis_rules`` takes them.

    Returns:
      ``rule(path, shape) -> dim | None``; its ``repr`` lists the leaves it splits.

    Raises:
      ValueError, TypeError: as :func:`shard_rule`, naming ``model_rule``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import linen as nn
      >>> init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
      >>> variables = nn.Dense(16, kernel_init=init).init(jax.random.key(0), jnp.ones((1, 8)))
      >>> rule = model_rule(variables, rules=[("embed", None), ("mlp", "tensor")])
      >>> rule("['kernel']", (8, 16)), rule("['bias']", (16,))
      (1, None)
    """
    return _read(variables, _axes(axes), rules, "model_rule")


def _read(
    variables: Mapping[str, Any],
    wanted: tuple[str, ...],
    rules: Sequence[tuple[str, Any]] | None,
    kind: str,
) -> _Rule:
    """The rule ``kind`` (``"shard_rule"`` or ``"model_rule"``) over the mesh axes
    ``wanted``, read from ``variables``' boxes."""
    given = None if rules is None else _rules(rules)
    leaves: dict[str, _Leaf] = {}
    several: list[str] = []
    seen: set[str] = set()
    paths = jax.tree_util.tree_leaves_with_path(
        _params(variables, kind), is_leaf=meta.is_axis_metadata
    )
    for path, x in paths:
        name = leaf_name(path)
        shape = tuple(np.shape(x.value if isinstance(x, meta.Partitioned) else meta.unbox(x)))
        mesh = _mesh_axes(name, x, given)
        if len(mesh) > len(shape):
            raise ValueError(
                f"leaf {name} of shape {shape} is partitioned by {mesh}: more names than dimensions"
            )
        seen.update(n for entry in mesh for n in _names(entry))
        dims = [i for i, entry in enumerate(mesh) if _names(entry) & set(wanted)]
        if len(dims) > 1:
            several.append(f"{name} {mesh} (dimensions {dims})")
        leaves[name] = _Leaf(shape, dims[0] if dims else None)
    if several:
        raise ValueError(
            f"jaxstep splits a leaf along one dimension over each axis ({kind}), and "
            f"these are partitioned over {wanted} along several: {', '.join(several)}; "
            "partition only one of their dimensions over those axes, or narrow axes="
        )
    if all(leaf.axis is None for leaf in leaves.values()):
        raise ValueError(_nothing_sharded(wanted, seen, len(leaves), kind))
    return _Rule(wanted, leaves, kind)


class _Leaf(NamedTuple):
    shape: tuple[int, ...]
    axis: int | None


class _Rule:
    """The rule :func:`shard_rule` returns: a look-up in what it read."""

    def __init__(
        self, axes: tuple[str, ...], leaves: dict[str, _Leaf], kind: str = "shard_rule"
    ) -> None:
        self.axes = axes
        self.leaves = leaves
        self.kind = kind
        self.__name__ = f"jaxstep.flax.{kind}"  # what a step's repr shows

    def __call__(self, path: str, shape: tuple[int, ...]) -> int | None:
        shape = tuple(shape)
        name = path.removesuffix(".value")  # a box's array, named as jaxstep names it
        if name not in self.leaves:
            name = without_root(name, _PARAMS) or name
        if name in self.leaves:
            known = self.leaves[name]
            if known.shape != shape:
                raise ValueError(
                    f"{self.kind} was asked about {path} of shape {shape}, but the variables it "
                    f"was built from hold it with shape {known.shape}: build it from the "
                    "variables of the model being trained"
                )
            return known.axis
        if path.startswith("opt_state"):
            # The optimizer's own leaves: a parameter's mirror gets its axis (the longest
            # path that fits), the rest (Adam's count, a factored moment) stay whole.
            for param in sorted(self.leaves, key=len, reverse=True):
                if path.endswith(param) and self.leaves[param].shape == shape:
                    return self.leaves[param].axis
            return None
        raise ValueError(
            f"{self.kind} was asked about {path}, which the variables it was built from do "
            f"not hold (they hold {_listed(list(self.leaves))}): build it from what "
            "model.init returns for the model being trained"
        )

    def __repr__(self) -> str:
        sharded = [f"{n}: {leaf.axis}" for n, leaf in self.leaves.items() if leaf.axis is not None]
        return (
            f"jaxstep.flax.{self.kind}(axes={self.axes}): {len(sharded)} of {len(self.leaves)} "
            f"leaves {'split' if self.kind == 'model_rule' else 'sharded'} ({_listed(sharded)})"
        )


def _axes(axes: str | Sequence[str]) -> tuple[str, ...]:
    wanted = (axes,) if isinstance(axes, str) else tuple(axes)
    if not wanted or not all(isinstance(a, str) for a in wanted):
        raise ValueError(
            f"axes must name the mesh axis (or axes) of the data-parallel group, e.g. "
            f"('fsdp',); got {axes!r}"
        )
    return wanted


def _rules(rules: Rules) -> tuple[tuple[str, Any], ...]:
    """The rules as flax takes them; a mesh entry given as a list (MaxText's YAML) as a
    tuple."""
    out = []
    for rule in rules:
        if isinstance(rule, str) or not isinstance(rule, Sequence) or len(rule) != 2:
            raise ValueError(
                f"rules must be (logical_name, mesh_axes) pairs, as nn.logical_axis_rules "
                f"takes them; got {rule!r} in {rules!r}"
            )
        logical, mesh = rule
        out.append((logical, tuple(mesh) if isinstance(mesh, list) else mesh))
    return tuple(out)


def _params(variables: Mapping[str, Any], kind: str = "shard_rule") -> Any:
    if isinstance(variables, nnx.Module | nnx.State) or not isinstance(variables, Mapping):
        raise TypeError(
            f"jaxstep.flax.{kind} reads linen variables (what model.init returns, boxes "
            f"kept), not a {type(variables).__name__}; for an NNX model write "
            f"{kind}=fn(path, shape) -> axis | None yourself"
        )
    return variables.get("params", variables)


def _mesh_axes(name: str, x: Any, rules: tuple[tuple[str, Any], ...] | None) -> tuple[Any, ...]:
    """The mesh axis entry of each named dimension of the leaf ``x`` (none if unboxed)."""
    if not isinstance(x, meta.Partitioned):
        return ()
    if not isinstance(x, nn.LogicallyPartitioned):
        return tuple(x.names)
    rules = _rules(x.rules) if x.rules else rules or _rules(nn.get_logical_axis_rules())
    if not rules:
        raise ValueError(
            f"leaf {name} has logical names {tuple(x.names)} (nn.with_logical_partitioning) "
            "and no rules map them to mesh axes: pass rules=[(logical_name, mesh_axes), "
            "...], those of nn.logical_axis_rules (MaxText's logical_axis_rules)"
        )
    try:
        return tuple(nn.logical_to_mesh_axes(x.names, rules) or ())
    except ValueError as e:  # a logical name twice
        raise ValueError(f"leaf {name}: {e}") from e


def _names(entry: Any) -> set[str]:
    """The mesh axes one dimension's entry names: none, one, or a tuple of them."""
    if isinstance(entry, str):
        return {entry}
    if isinstance(entry, tuple | list):
        return {e for e in entry if isinstance(e, str)}
    return set()  # None, PartitionSpec.UNCONSTRAINED


def _nothing_sharded(
    wanted: tuple[str, ...], seen: set[str], count: int, kind: str = "shard_rule"
) -> str:
    group = "the model group" if kind == "model_rule" else "the data-parallel group"
    if not seen:
        return (
            f"none of the {count} leaves has a partitioning box naming a mesh axis, so "
            f"nothing would be sharded over {wanted}: build the rule from what model.init "
            "returns, before linen_split or nn.unbox take the boxes off, for a model whose "
            "initializers use nn.with_partitioning or nn.with_logical_partitioning"
        )
    return (
        f"no leaf is partitioned over {wanted}: the boxes name the mesh axes "
        f"{sorted(seen)}; pass axes= the one(s) of {group}"
    )


def _listed(items: list[str]) -> str:
    more = f", ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more
