"""The sharding rule of ``make_train_step(shard_state=...)``: which leaves of the
state are sharded over a group of the step's devices (all of them, or ``n / replicas``
with ``replicas``), and along which axis.

By default a leaf is sharded along its largest axis whose size divides by the group's
device count (the first such axis on ties); a leaf with no such axis, or with fewer
than ``shard_min_size`` elements, stays replicated. A ``shard_rule`` of the user's
(``fn(path, shape) -> axis | None``) replaces that rule (``shard_min_size`` still
keeps the smaller leaves whole): it is asked for each parameter, and each
optimizer-state leaf that mirrors a parameter (Adam's moments: the same path at the
end, the same shape) takes its parameter's axis; any other
optimizer-state leaf (a count, a factored moment) stays whole. Under ``"optimizer"``
the default rule is applied to each optimizer-state leaf's own shape (Adam's moments
get their parameter's axis; a factored or scalar leaf gets what fits it) and the
parameters stay replicated; under ``"params"`` to the parameters too. The gradients are
reduce-scattered along their parameter's axis under both. Everything else (model
state, the loss scale, keys, counters, the monitor) stays replicated.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import Protocol

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxstep._src.core import PyTree
from jaxstep._src.core import TrainState
from jaxstep._src.core.names import keystrs
from jaxstep._src.program._model_dims import mirrored
from jaxstep._src.program._model_dims import model_dims_of
from jaxstep._src.program._padding import Kept
from jaxstep._src.program._padding import Pad
from jaxstep._src.program._padding import cut
from jaxstep._src.program._padding import grown
from jaxstep._src.program._padding import pad_to
from jaxstep._src.program._padding import with_size

#: ``shard_rule(path, shape) -> axis | None``: ``path`` as ``jax.tree_util.keystr``
#: writes it (``"['dense1']['kernel']"``, the names errors use), ``shape`` the leaf's.
ShardRule = Callable[[str, tuple[int, ...]], "int | None"]


class Rule(Protocol):
    """What a plan is made from (the step's :class:`~jaxstep._src.program.Options`)."""

    @property
    def shard_state(self) -> Any: ...
    @property
    def shard_min_size(self) -> int: ...
    @property
    def shard_rule(self) -> ShardRule | None: ...
    @property
    def group_size(self) -> int: ...
    @property
    def kept(self) -> Kept | None: ...
    @property
    def optimizer(self) -> Any: ...


#: The default ``shard_min_size``, in elements (256 KiB of float32). Below it the two
#: collectives a sharded leaf adds (a reduce-scatter and an all-gather in place of one
#: all-reduce) cost more than the 7/8 of its update they save: measured alone on 8 CPU
#: devices, a sharded Adam leaf took 1.2-1.5x the replicated one's time up to 2**14
#: elements and 0.3-0.6x from 2**16 on (docs/sharding.md). Leaves that small hold
#: little memory (biases, norm scales: 0.1% of GPT-2 small). DeepSpeed's ZeRO-3 keeps
#: parameters under 1e5 elements whole, big_vision's FSDP those under 4 MiB.
DEFAULT_SHARD_MIN_SIZE = 2**16


def shard_axis(shape: Sequence[int], n: int, min_size: int, avoid: int | None = None) -> int | None:
    """The axis a leaf of ``shape`` is sharded along over ``n`` devices, or None
    (replicated): its largest axis whose size divides by ``n`` (the first on ties);
    None when no axis divides or the leaf has fewer than ``min_size`` elements.
    ``avoid``: an axis split over the model axis already (``model_parallel``), never
    picked.

    >>> shard_axis((512, 784), 8, 0), shard_axis((7, 9), 8, 0), shard_axis((64,), 8, 100)
    (1, None, None)
    """
    if math.prod(shape) < min_size or n <= 1:
        return None
    best: int | None = None
    for i, size in enumerate(shape):
        if i == avoid:
            continue
        if size > 0 and size % n == 0 and (best is None or size > shape[best]):
            best = i
    return best


def shard_spec(axis: int | None, name: str) -> P:
    """The ``PartitionSpec`` of a leaf sharded along ``axis`` over the mesh axis
    ``name`` (``P()``: replicated)."""
    return P() if axis is None else P(*([None] * axis), name)


class Plan(NamedTuple):
    """Where each leaf of a state is sharded, in tree order (None: replicated).

    ``grads``: the gradients' axes (the parameters' shapes under the rule), under both
    layouts; ``params``: the parameters' (``grads`` under ``"params"``, all None under
    ``"optimizer"``); ``opt``: the optimizer state's, each leaf by its own shape.
    After an exclusion (:class:`Kept`): ``grad_pads``, each parameter's ``(logical,
    padded)`` length along its gradient's axis when it is padded (under ``"params"`` the
    parameter itself, under ``"optimizer"`` its gradient and update inside the step),
    else None; ``opt_pads``, each optimizer-state leaf's ``(axis, (logical, padded))``
    when it is held padded, else None; empty: nothing is padded."""

    grads: tuple[int | None, ...]
    params: tuple[int | None, ...]
    opt: tuple[int | None, ...]
    grad_pads: tuple[Pad | None, ...] = ()
    opt_pads: tuple[tuple[int, Pad] | None, ...] = ()

    @classmethod
    def of(cls, rule: Rule, state: Any) -> Plan:
        """The plan for ``state`` (a :class:`TrainState`, of arrays or shapes, or
        anything with ``params`` and ``opt_state``) under ``rule`` (the step's options:
        ``shard_state``, the group's size, ``shard_min_size``, ``shard_rule``).

        Raises:
          ValueError: the user's ``shard_rule`` gave an axis a leaf does not have, or
            one whose size does not divide by the group's device count (naming both).
          TypeError: it gave something other than an int or None.
        """
        if rule.shard_state is not None and rule.kept is not None:
            return cls.padded(rule.kept, rule.group_size)
        params = [tuple(np.shape(x)) for x in jax.tree.leaves(state.params)]
        opt = [tuple(np.shape(x)) for x in jax.tree.leaves(state.opt_state)]
        if rule.shard_state is None:
            return cls((None,) * len(params), (None,) * len(params), (None,) * len(opt))
        m = rule.group_size
        on_model, opt_on_model = _on_model(rule, state)
        if rule.shard_rule is None:
            size = rule.shard_min_size
            grads = tuple(shard_axis(s, m, size, d) for s, d in zip(params, on_model, strict=True))
            opt_axes = tuple(
                shard_axis(s, m, size, d) for s, d in zip(opt, opt_on_model, strict=True)
            )
        else:
            held = _PADDED.get(rule.shard_rule, {}).get(_key(rule, params))
            if held is not None:  # a state this rule pads, seen before (either shape)
                return cls.padded(held, m)
            names = keystrs(state.params)
            size = rule.shard_min_size
            asked = zip(names, params, strict=True)
            grads = tuple(_asked(rule.shard_rule, name, s, m, size) for name, s in asked)
            for name, s, a, d in zip(names, params, grads, on_model, strict=True):
                if a is not None and a == d:
                    raise ValueError(
                        f"shard_rule({name!r}, {s}) returned axis {a}, which model_rule "
                        f"splits over the model axis already: a dimension is split over "
                        "one axis; return another axis (or None) from shard_rule, or "
                        "another dimension from model_rule"
                    )
            mirrors = dict(zip(names, zip(params, grads, strict=True), strict=True))
            opt_axes = tuple(
                mirrored(name, shape, mirrors)
                for name, shape in zip(keystrs(state.opt_state, "opt_state"), opt, strict=True)
            )
            if any(a is not None and s[a] % m for a, s in zip(grads, params, strict=True)):
                return cls._padding(rule, state, cls(grads, _held(rule, grads), opt_axes))
        return cls(grads, _held(rule, grads), opt_axes)

    @classmethod
    def _padding(cls, rule: Rule, state: Any, plan: Plan) -> Plan:
        """``plan`` (a user's rule's, some axis of which does not divide by the group)
        with those leaves held padded to the next multiple, as after an exclusion
        (:meth:`keep`): a model whose sizes the user did not choose (lm1b's 2 heads
        over 8 devices) is sharded, not refused. Remembered for the rule, under both
        the logical parameter shapes (``state``'s) and the padded ones, so a placed
        state finds the same plan."""
        m = rule.group_size
        kept = plan.keep(state, rule.optimizer, m)
        padded = cls.padded(kept, m)
        memo = _PADDED.setdefault(rule.shard_rule, {})
        memo[_key(rule, kept.param_shapes)] = kept
        held = tuple(
            s if p is None else with_size(s, p[0], p[1][1])
            for s, p in zip(kept.param_shapes, padded.param_pads, strict=True)
        )
        memo[_key(rule, held)] = kept
        return padded

    @classmethod
    def padded(cls, kept: Kept, m: int) -> Plan:
        """The plan of ``kept`` over groups of ``m`` devices: its axes, a pad for each
        gradient whose axis's length does not divide by ``m``, and each optimizer-state
        leaf's pad where the optimizer builds it larger."""
        grad_pads = tuple(
            None if a is None or s[a] % m == 0 else (s[a], -(-s[a] // m) * m)
            for a, s in zip(kept.grads, kept.param_shapes, strict=True)
        )
        opt_pads = tuple(
            grown(s, t) for s, t in zip(kept.opt_shapes, kept.opt_physical, strict=True)
        )
        if not any((*grad_pads, *opt_pads)):
            return cls(kept.grads, kept.params, kept.opt)
        return cls(kept.grads, kept.params, kept.opt, grad_pads, opt_pads)

    def keep(self, state: Any, optimizer: Any, m: int) -> Kept:
        """This plan as a :class:`Kept` of ``state`` (logical shapes: a host copy) over
        groups of ``m`` devices: the optimizer-state leaves' shapes from
        ``optimizer.init`` of the padded parameters, and the axis of a leaf that keeps
        its shape and no longer divides by ``m`` dropped (whole)."""
        shapes = lambda tree: tuple(tuple(np.shape(x)) for x in jax.tree.leaves(tree))  # noqa: E731
        params, opt = shapes(state.params), shapes(state.opt_state)
        draft = Plan.padded(Kept(self.grads, self.params, self.opt, params, opt, opt), m)
        try:
            physical = shapes(jax.eval_shape(optimizer.init, draft.grad_view(state.params)))
        except Exception:  # an init that cannot be traced: each leaf padded on its axis
            physical = tuple(
                s if a is None or s[a] % m == 0 else with_size(s, a, -(-s[a] // m) * m)
                for a, s in zip(self.opt, opt, strict=True)
            )
        if len(physical) != len(opt):
            physical = opt  # (a structure that depends on the shapes: not padded)
        axes = tuple(
            None if a is None or t[a] % m else a for a, t in zip(self.opt, physical, strict=True)
        )
        return Kept(self.grads, self.params, axes, params, opt, physical)

    def grad_view(self, params: PyTree) -> PyTree:
        """``params`` (arrays or ``jax.ShapeDtypeStruct`` s) as their gradients are
        inside the step: each leaf whose gradient is padded, padded (zeros at its end;
        as it is where it is already)."""
        leaves, treedef = jax.tree.flatten(params)
        return jax.tree.unflatten(treedef, [self.grad_padded(i, x) for i, x in enumerate(leaves)])

    def grad_padded(self, i: int, x: Any) -> Any:
        """Gradient (or parameter) ``i`` padded with zeros along its axis when its
        gradient is padded (a ``jax.ShapeDtypeStruct``: its shape), else ``x``."""
        pad, a = (self.grad_pads[i] if self.grad_pads else None), self.grads[i]
        if pad is None or a is None:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(with_size(x.shape, a, pad[1]), x.dtype)
        return pad_to(x, a, pad[1])

    @property
    def sharded(self) -> bool:
        """Whether any leaf is sharded."""
        return any(a is not None for a in (*self.grads, *self.opt))

    @property
    def pads(self) -> bool:
        """Whether a leaf is held padded."""
        return any((*self.grad_pads, *self.opt_pads))

    @property
    def param_pads(self) -> tuple[tuple[int, Pad] | None, ...]:
        """Each parameter's axis and pad as the state holds it (under ``"optimizer"``
        none: the parameters are whole)."""
        if not self.grad_pads:
            return (None,) * len(self.params)
        return tuple(
            None if p is None or a is None else (a, p)
            for a, p in zip(self.params, self.grad_pads, strict=True)
        )

    def state_pads(self, state: Any) -> list[tuple[int, Pad] | None]:
        """Per leaf of ``jax.tree.leaves(state)`` (a :class:`TrainState`): its axis and
        pad when the state holds it padded, else None."""
        paths = jax.tree_util.tree_leaves_with_path(state)
        out: list[tuple[int, Pad] | None] = [None] * len(paths)
        if not self.pads:
            return out
        seen = {"params": 0, "opt_state": 0}
        for k, (path, _) in enumerate(paths):
            field = getattr(path[0], "name", None) if path else None
            if field not in seen:
                continue
            i = seen[field]
            seen[field] += 1
            out[k] = (self.param_pads if field == "params" else self.opt_pads)[i]
        return out

    def logical(self, tree: Any) -> Any:
        """``tree`` (host or device arrays: a :class:`TrainState`, or its ``params`` or
        ``opt_state`` alone, as ``jaxstep.testing.replicas(step, state.params)`` reads
        them) with its padded leaves cut to their logical shapes (as it is when nothing
        is padded, a leaf is logical already, or the tree is none of these)."""
        if not self.pads:
            return tree
        if isinstance(tree, TrainState):
            return _map_pads(self, tree, lambda x, a, pad: cut(x, a, pad[0]))
        leaves, treedef = jax.tree.flatten(tree)
        for pads in (self.param_pads, self.opt_pads):
            fits = len(pads) == len(leaves) and all(
                p is None or (np.ndim(x) > p[0] and np.shape(x)[p[0]] == p[1][1])
                for x, p in zip(leaves, pads, strict=True)
            )
            if fits and any(pads):
                cuts = zip(leaves, pads, strict=True)
                out = [x if p is None else cut(x, p[0], p[1][0]) for x, p in cuts]
                return jax.tree.unflatten(treedef, out)
        return tree

    def physical(self, state: Any) -> Any:
        """``state`` with its leaves that the layout holds padded padded (zeros at the
        end of their axis), where they are logical: what the step's programs take."""
        return _map_pads(self, state, lambda x, a, pad: pad_to(x, a, pad[1]))

    def specs(self, state: TrainState, name: str) -> TrainState:
        """``state``'s ``PartitionSpec`` s (a TrainState of them), over mesh axis ``name``."""
        everything = jax.tree.map(lambda _: P(), state)
        return dataclasses.replace(
            everything,
            params=_as(state.params, self.params, name),
            opt_state=_as(state.opt_state, self.opt, name),
        )

    def grad_specs(self, params: PyTree, name: str) -> PyTree:
        """The reduced gradients' ``PartitionSpec`` s (a tree like ``params``)."""
        return _as(params, self.grads, name)


def _map_pads(plan: Plan, state: Any, fn: Callable[[Any, int, Pad], Any]) -> Any:
    if not plan.pads:
        return state
    leaves, treedef = jax.tree.flatten(state)
    pads = plan.state_pads(state)
    out = [x if p is None else fn(x, p[0], p[1]) for x, p in zip(leaves, pads, strict=True)]
    return jax.tree.unflatten(treedef, out)


def _asked(rule: ShardRule, name: str, shape: tuple[int, ...], m: int, min_size: int) -> int | None:
    """The user's rule's axis for one leaf, checked against its shape and the group;
    None (whole) for a leaf under ``min_size`` elements whatever the rule says, as
    under the default rule (a LayerNorm scale split 8 ways costs more than it saves)."""
    axis = rule(name, shape)
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise TypeError(
            f"shard_rule({name!r}, {shape}) returned {axis!r}; return an axis (an int) or None"
        )
    if not -len(shape) <= axis < len(shape):
        raise ValueError(
            f"shard_rule({name!r}, {shape}) returned axis {axis}, which a leaf of shape "
            f"{shape} does not have: return one of 0..{len(shape) - 1} (or None)"
        )
    axis = int(axis) % len(shape)
    return None if math.prod(shape) < min_size else axis


#: per user's rule, the padded layouts it was seen to need (:meth:`Plan._padding`),
#: by (layout, group size, parameter shapes): a cache of what the rule, the optimizer
#: and the logical shapes decide, so a placed (padded) state finds its plan again
_PADDED: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Kept]] = weakref.WeakKeyDictionary()


def padding_of(rule: Rule) -> Kept | None:
    """The layout that holds leaves padded under ``rule`` (a step's options): the one
    an exclusion kept, else the one the user's rule was seen to need (one model per
    rule: None when it needed none, or several); what cuts a tree read from the
    devices (a state, its parameters or its optimizer state) to its logical shapes."""
    if rule.kept is not None or rule.shard_rule is None:
        return rule.kept
    own = _key(rule, ())[:-1]
    seen = {id(k): k for key, k in _PADDED.get(rule.shard_rule, {}).items() if key[:-1] == own}
    return next(iter(seen.values())) if len(seen) == 1 else None


def _on_model(rule: Rule, state: Any) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
    """Each parameter's and optimizer-state leaf's dimension over the model axis
    (``model_parallel``: never the one a sharded layout splits over the data axis)."""
    n_params, n_opt = len(jax.tree.leaves(state.params)), len(jax.tree.leaves(state.opt_state))
    if getattr(rule, "model_parallel", 1) == 1:
        return (None,) * n_params, (None,) * n_opt
    return model_dims_of(rule, state.params, state.opt_state)  # type: ignore[arg-type]


def _key(rule: Rule, params: Sequence[tuple[int, ...]]) -> tuple[Any, ...]:
    return (rule.shard_state, rule.group_size, rule.shard_min_size, tuple(params))


def _held(rule: Rule, grads: tuple[int | None, ...]) -> tuple[int | None, ...]:
    """The parameters' axes: their gradients' under ``"params"``, whole under
    ``"optimizer"``."""
    return grads if rule.shard_state == "params" else (None,) * len(grads)


def _as(tree: PyTree, axes: Sequence[int | None], name: str) -> PyTree:
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [shard_spec(a, name) for a in axes][: len(leaves)])


def nbytes_per_device(state: Any, plan: Plan, n: int) -> int:
    """Bytes of ``state``'s arrays one device holds under ``plan`` on ``n`` devices."""
    sharded = {
        id(x): a
        for tree, axes in ((state.params, plan.params), (state.opt_state, plan.opt))
        for x, a in zip(jax.tree.leaves(tree), axes, strict=True)
    }
    total = 0
    for x in jax.tree.leaves(state):
        size = int(getattr(x, "nbytes", 0))
        total += size // n if sharded.get(id(x)) is not None else size
    return total
