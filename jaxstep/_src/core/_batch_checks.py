"""The checks of a batch, read through :mod:`jaxstep._src.core.validate`: its leaves (arrays
with an example axis that divides by the devices and the micro-batches), a list of
examples given as one batch, a leaf that changed since the first batch, a batch that
looks pre-split. Each names the leaf and the fix, before anything runs."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxstep._src.core._types import PyTree


def batch(tree: PyTree, n: int, microbatches: int = 1, what: str = "devices") -> int:
    """Checks a batch split over ``n`` devices (``what``: how the message calls them;
    "devices of this process" for one process's rows); returns its leading size."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        raise ValueError("the batch has no arrays; pass a pytree of arrays")
    sizes = {}
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path) or "batch"
        _batch_leaf(name, leaf)
        sizes[name] = leaf.shape[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"batch leaves disagree on the leading (example) axis: {sizes}; every leaf "
            "needs the same number of examples"
        )
    size = next(iter(sizes.values()))
    if size == 0:
        raise ValueError("the batch has 0 examples; drop empty batches before the step")
    if size % n:
        lo, hi = size // n * n, (size // n + 1) * n
        if lo == 0:  # fewer examples than devices
            fix = f"each device needs at least one example: use {n} or another multiple of {n}"
        else:
            fix = f"use a multiple of {n} (e.g. {lo} or {hi}) or drop the last partial batch"
        raise ValueError(f"batch leading axis {size} does not divide by the {n} {what}; {fix}")
    microbatch_rows(size, n, microbatches)
    return int(size)


def _batch_leaf(name: str, leaf: Any) -> None:
    """Raises for a batch leaf the devices cannot take: text, a single number, an
    object that is not an array, an array without an example axis or of a non-numeric
    dtype."""
    if isinstance(leaf, (str, bytes)):
        raise TypeError(
            f"batch leaf {name} is a {type(leaf).__name__} ({leaf[:20]!r}); devices take "
            "numbers: encode text as integer ids (one row per example), or keep it out of "
            "the batch"
        )
    if isinstance(leaf, (bool, int, float, complex)):
        raise ValueError(
            f"batch leaf {name} is a scalar (a Python {type(leaf).__name__}); every batch "
            "leaf needs a leading example axis that is split across the devices: give one "
            f"value per example (e.g. np.full(batch_size, {leaf!r})), or close over a "
            "constant in loss_fn"
        )
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"batch leaf {name} is a {type(leaf).__name__}, not an array; give an array "
            "with one row per example (e.g. np.stack of the examples)"
        )
    if len(shape) == 0:
        raise ValueError(
            f"batch leaf {name} is a scalar; every batch leaf needs a leading example "
            "axis that is split across the devices: give one value per example"
        )
    numeric = jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)
    if not (numeric or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)):
        raise TypeError(
            f"batch leaf {name} has dtype {dtype}, which devices cannot hold; encode "
            "strings as integer ids (e.g. a vocabulary lookup) and keep other objects "
            "out of the batch"
        )


def microbatch_rows(size: int, n: int, microbatches: int) -> None:
    if microbatches > 1 and (size // n) % microbatches:
        per = size // n
        raise ValueError(
            f"each device's chunk has {per} rows, which do not split into microbatches="
            f"{microbatches}; use a global batch whose per-device rows divide by "
            f"{microbatches} (e.g. {n * microbatches * max(1, per // microbatches)})"
        )


def examples_list(tree: Any) -> None:
    """Refuses a list (or tuple) of per-example pytrees passed as one batch."""
    if not (isinstance(tree, (list, tuple)) and len(tree) > 1):
        return
    first: Any = jax.tree.structure(tree[0])
    if jax.tree_util.treedef_is_leaf(first) or any(
        jax.tree.structure(e) != first for e in tree[1:]
    ):
        return
    raise ValueError(
        f"the batch is a list of {len(tree)} examples (each a {type(tree[0]).__name__}); a "
        "batch is one pytree of arrays with the examples stacked on the leading axis: "
        "batch = jax.tree.map(lambda *xs: np.stack(xs), *examples)"
    )


def changed_leaf(name: str, first: tuple[Any, Any], now: tuple[Any, Any], n: int = 0) -> str | None:
    """Checks a batch leaf against the first batch's ``(shape, dtype)``: raises for a new
    dtype, a new number of axes, or a non-leading axis that shrank to 1 (it would
    broadcast silently); returns a warning for another non-leading change (bucketed
    lengths recompile the step), or None."""
    (shape0, dtype0), (shape, dtype) = first, now
    if dtype != dtype0:
        raise TypeError(
            f"batch leaf {name} was {dtype0} in the first batch and is {dtype} now; a leaf "
            "keeps its dtype (a new one recompiles the step and changes the loss): cast "
            f"it, e.g. x.astype(np.{dtype0})"
        )
    if len(shape) == len(shape0) + 1 and shape[0] == n and tuple(shape[2:]) == tuple(shape0[1:]):
        raise ValueError(
            f"batch leaf {name} has shape {tuple(shape)}, the first batch's layout "
            f"{tuple(shape0)} with one more leading axis of the number of devices ({n}): it "
            "looks pre-split as (n_devices, per_device, ...), as pmap code builds it; pass "
            "presplit=True (step(state, batch, presplit=True), fit(..., presplit=True)), "
            "or the global batch. Nothing ran; the state is unchanged"
        )
    if len(shape) != len(shape0):
        raise ValueError(
            f"batch leaf {name} had shape {tuple(shape0)} in the first batch and has "
            f"{tuple(shape)} now; a leaf keeps its number of axes (one fewer would "
            "broadcast silently in the loss): reshape it to the first batch's layout"
        )
    for axis in range(1, len(shape)):
        if shape[axis] == 1 and shape0[axis] > 1:
            raise ValueError(
                f"batch leaf {name} had shape {tuple(shape0)} in the first batch and has "
                f"{tuple(shape)} now: axis {axis} went from {shape0[axis]} to 1, which would "
                "broadcast silently against the model's output; give it the first batch's "
                "width"
            )
    if tuple(shape[1:]) != tuple(shape0[1:]):
        return (
            f"batch leaf {name} changed from {tuple(shape0)} in the first batch to "
            f"{tuple(shape)}: the step will recompile for each new shape (fine for "
            "bucketed sequence lengths; pad to a few fixed lengths to compile fewer). "
            "Warned once per leaf"
        )
    return None


def looks_presplit(tree: Any, n: int) -> str | None:
    """A warning when a global batch looks pre-split ``(n_devices, per_device, ...)``,
    as the pmap tutorial builds it: every leaf's leading axis is the device count and
    they share a second axis. Taken as it is, it trains on ``n`` examples of the
    wrong shape."""
    shapes = [tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(tree)]
    # (n, per_device, features...): a global batch of n examples of 2-d features looks
    # the same, so only leaves of 3 axes or more are taken for pre-split
    if not shapes or any(len(s) < 3 or s[0] != n for s in shapes):
        return None
    if len({s[1] for s in shapes}) != 1 or shapes[0][1] < 2:
        return None
    shown = ", ".join(str(s) for s in shapes[:4])
    return (
        f"every batch leaf's leading axis is the number of devices ({n}) and they share a "
        f"second axis ({shown}): if the batch is pre-split as (n_devices, per_device, ...), "
        "as pmap code builds it, pass presplit=True (step(state, batch, presplit=True), "
        f"fit(..., presplit=True)); as it is, it is a global batch of {n} examples"
    )


def presplit_hint(err: Exception, tree: PyTree, n: int) -> Exception | None:
    """``err`` from tracing the step, with a hint when the batch looks pre-split."""
    shapes: list[tuple[int, ...]] = [tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(tree)]
    if shapes and all(len(s) >= 2 and s[0] == n for s in shapes):
        shown = ", ".join(str(tuple(s)) for s in shapes)
        return ValueError(
            f"tracing the step failed ({type(err).__name__}: {str(err)[:300]}); the batch "
            f"has shapes {shown}, whose leading axis is the number of devices ({n}): if it "
            "is pre-split as (n_devices, per_device, ...), as pmap code builds it, pass "
            "presplit=True (step(state, batch, presplit=True), fit(..., presplit=True)), "
            "or the global batch (n_devices * per_device, ...). Nothing ran; the state is "
            "unchanged"
        )
    return None
