"""The sharding rule of ``make_train_step(shard_state=...)``: which leaves of the
state are sharded over the step's devices, and along which axis.

A leaf is sharded along its largest axis whose size divides by the number of devices
(the first such axis on ties); a leaf with no such axis, or with fewer than
``shard_min_size`` elements, stays replicated. Under ``"optimizer"`` the rule is
applied to each optimizer-state leaf's own shape (Adam's moments get their parameter's
axis; a factored or scalar leaf gets what fits it) and the parameters stay
replicated; under ``"params"`` to the parameters too. The gradients are
reduce-scattered along their parameter's axis under both. Everything else (model
state, the loss scale, keys, counters, the monitor) stays replicated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxstep.core import PyTree
from jaxstep.core import TrainState

#: The default ``shard_min_size``, in elements (256 KiB of float32). Below it the two
#: collectives a sharded leaf adds (a reduce-scatter and an all-gather in place of one
#: all-reduce) cost more than the 7/8 of its update they save: measured alone on 8 CPU
#: devices, a sharded Adam leaf took 1.2-1.5x the replicated one's time up to 2**14
#: elements and 0.3-0.6x from 2**16 on (docs/sharding.md). Leaves that small hold
#: little memory (biases, norm scales: 0.1% of GPT-2 small). DeepSpeed's ZeRO-3 keeps
#: parameters under 1e5 elements whole, big_vision's FSDP those under 4 MiB.
DEFAULT_SHARD_MIN_SIZE = 2**16


def shard_axis(shape: Sequence[int], n: int, min_size: int) -> int | None:
    """The axis a leaf of ``shape`` is sharded along over ``n`` devices, or None
    (replicated): its largest axis whose size divides by ``n`` (the first on ties);
    None when no axis divides or the leaf has fewer than ``min_size`` elements.

    >>> shard_axis((512, 784), 8, 0), shard_axis((7, 9), 8, 0), shard_axis((64,), 8, 100)
    (1, None, None)
    """
    if math.prod(shape) < min_size or n <= 1:
        return None
    best: int | None = None
    for i, size in enumerate(shape):
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
    ``"optimizer"``); ``opt``: the optimizer state's, each leaf by its own shape."""

    grads: tuple[int | None, ...]
    params: tuple[int | None, ...]
    opt: tuple[int | None, ...]

    @classmethod
    def of(cls, layout: str | None, n: int, min_size: int, state: Any) -> Plan:
        """The plan for ``state`` (a :class:`TrainState`, of arrays or shapes) on ``n``
        devices under ``layout`` (``shard_state``; None: nothing sharded)."""
        shape = lambda x: tuple(np.shape(x))  # noqa: E731
        if layout is None:
            return cls(
                tuple(None for _ in jax.tree.leaves(state.params)),
                tuple(None for _ in jax.tree.leaves(state.params)),
                tuple(None for _ in jax.tree.leaves(state.opt_state)),
            )
        grads = tuple(shard_axis(shape(x), n, min_size) for x in jax.tree.leaves(state.params))
        opt = tuple(shard_axis(shape(x), n, min_size) for x in jax.tree.leaves(state.opt_state))
        params = grads if layout == "params" else tuple(None for _ in grads)
        return cls(grads, params, opt)

    @property
    def sharded(self) -> bool:
        """Whether any leaf is sharded."""
        return any(a is not None for a in (*self.grads, *self.opt))

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
