"""Where a leaf lies over the model axis: the user's ``model_rule`` asked for each
parameter (``path`` as ``jax.tree_util.keystr`` writes it, its global shape) and its
answers checked, and the one rule both axes share for the optimizer state: a leaf that
mirrors a parameter (Adam's moments: the same path at the end, the same shape) takes
its parameter's dimension, any other leaf is whole.

Both the model axis's layout (``_model``) and the data axis's plan (``_shards``: a
leaf's data-axis dimension avoids its model dimension) read it; it reads neither.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import Protocol

import jax
import numpy as np

from jaxstep._src.core import PyTree
from jaxstep._src.core.names import keystrs


class ModelRuled(Protocol):
    """What the model dimensions are read from (the step's ``Options``)."""

    @property
    def model_parallel(self) -> int: ...
    @property
    def model_rule(self) -> Callable[[str, tuple[int, ...]], int | None] | None: ...


#: while a program of the step is traced: the rule's answers for the state's global
#: shapes, by the leaves' names (:func:`global_dims`)
_TRACED: contextvars.ContextVar[tuple[Any, ...] | None] = contextvars.ContextVar(
    "jaxstep_model_dims", default=None
)


@contextlib.contextmanager
def global_dims(options: ModelRuled, state: Any) -> Iterator[None]:
    """While a program of the step on ``state`` (global arrays) is traced, the rule's
    answers for ``state``'s leaves stand for those of their blocks: inside the body a
    sharded layout's leaf is its block along the data axis, a shape the rule was never
    asked about (and ``jaxstep.flax.model_rule`` refuses, as it should a model it was
    not built from). The rule is asked here, once, with the global shapes."""
    if options.model_parallel == 1 or options.model_rule is None:
        yield
        return
    dims, opt = model_dims_of(options, state.params, state.opt_state)
    names = (tuple(keystrs(state.params)), tuple(keystrs(state.opt_state, "opt_state")))
    token = _TRACED.set((names, dims, opt))
    try:
        yield
    finally:
        _TRACED.reset(token)


def _traced(params: PyTree, opt_state: PyTree | None = None) -> Any:
    """The answers :func:`global_dims` holds for these leaves (by name), or None."""
    known = _TRACED.get()
    if known is None:
        return None
    (param_names, opt_names), dims, opt = known
    if tuple(keystrs(params)) != param_names:
        return None
    if opt_state is not None and tuple(keystrs(opt_state, "opt_state")) != opt_names:
        return None
    return dims, opt


def model_dims(options: ModelRuled, params: PyTree) -> tuple[int | None, ...]:
    """Each parameter's dimension over the model axis (tree order; None: whole), the
    rule's answers checked against the shapes and the group.

    Raises:
      TypeError: the rule returned something other than an int or None.
      ValueError: a dimension the leaf does not have, or one whose size the group's
        ``model_parallel`` devices do not divide (naming the leaf, its shape and the
        fix).
    """
    shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(params)]
    if options.model_parallel == 1 or options.model_rule is None:
        return (None,) * len(shapes)
    if (known := _traced(params)) is not None:  # blocks of a traced step's state
        return tuple(known[0])
    m = options.model_parallel
    dims: list[int | None] = []
    for name, shape in zip(keystrs(params), shapes, strict=True):
        dim = options.model_rule(name, shape)
        if dim is None:
            dims.append(None)
            continue
        if isinstance(dim, bool) or not isinstance(dim, int | np.integer):
            raise TypeError(
                f"model_rule({name!r}, {shape}) returned {dim!r}; return a dimension (an "
                "int) or None (whole on every device of a model group)"
            )
        if not -len(shape) <= dim < len(shape):
            raise ValueError(
                f"model_rule({name!r}, {shape}) returned dimension {dim}, which a leaf of "
                f"shape {shape} does not have: return one of 0..{len(shape) - 1} (or None)"
            )
        dim = int(dim) % len(shape)
        if shape[dim] % m:
            raise ValueError(
                f"model_rule({name!r}, {shape}) splits dimension {dim} (size {shape[dim]}) "
                f"over model_parallel={m} devices, which does not divide it: return a "
                f"dimension whose size divides by {m} (or None: whole), or pass a "
                f"model_parallel that divides {shape[dim]}"
            )
        dims.append(dim)
    return tuple(dims)


def model_dims_of(
    options: ModelRuled, params: PyTree, opt_state: PyTree
) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
    """Each parameter's and each optimizer-state leaf's dimension over the model axis
    (tree order; None: whole): the rule's for the parameters, the mirrored
    parameter's for an optimizer leaf (Adam's moments), whole for the rest."""
    if (known := _traced(params, opt_state)) is not None:  # blocks of a traced step's state
        return tuple(known[0]), tuple(known[1])
    dims = model_dims(options, params)
    names = keystrs(params)
    mirrors = {
        name: (tuple(np.shape(x)), d)
        for name, x, d in zip(names, jax.tree.leaves(params), dims, strict=True)
    }
    opt = tuple(
        _mirror(name, tuple(np.shape(x)), mirrors) if any(d is not None for d in dims) else None
        for name, x in zip(keystrs(opt_state, "opt_state"), jax.tree.leaves(opt_state), strict=True)
    )
    return dims, opt


def _mirror(
    name: str, shape: tuple[int, ...], mirrors: dict[str, tuple[tuple[int, ...], int | None]]
) -> int | None:
    """An optimizer-state leaf's model dimension: its parameter's when it mirrors one
    (its path ends with the parameter's; the same shape, or, held padded along the
    data axis after an exclusion, the same rank and the same size along that
    dimension), else None."""
    exact = mirrored(name, shape, mirrors)
    if exact is not None:
        return exact
    for param in sorted(mirrors, key=len, reverse=True):
        param_shape, dim = mirrors[param]
        if dim is not None and name.endswith(param) and len(shape) == len(param_shape):
            return dim if shape[dim] == param_shape[dim] else None
    return None


def mirrored(
    name: str, shape: tuple[int, ...], mirrors: dict[str, tuple[tuple[int, ...], int | None]]
) -> int | None:
    """An optimizer-state leaf's axis: its parameter's when it mirrors one (its path
    ends with the parameter's, its shape is the parameter's), else None (whole: a
    count, a scalar; the rule is asked about parameters alone)."""
    for param in sorted(mirrors, key=len, reverse=True):  # the longest path that fits
        param_shape, axis = mirrors[param]
        if name.endswith(param) and shape == param_shape:
            return axis
    return None
