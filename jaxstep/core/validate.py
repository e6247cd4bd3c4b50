"""Checks of what users pass in: each raises a ValueError/TypeError that names the
offending value and the fix, before anything runs."""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep.core._types import PyTree
from jaxstep.core._weighted import WeightedLoss


def devices(devs: Sequence[Any] | None) -> list[jax.Device]:
    out = list(jax.devices() if devs is None else devs)
    if not out:
        raise ValueError("devices is empty; pass at least one jax.Device, or None for all")
    for d in out:
        if not isinstance(d, jax.Device):
            raise TypeError(
                f"devices must hold jax.Device objects, got {d!r}; e.g. jax.devices()[:4]"
            )
    platforms = sorted({d.platform for d in out})
    if len(platforms) > 1:
        raise ValueError(
            f"devices mix platforms {platforms}; one step runs on one platform: pass e.g. "
            f"jax.devices({platforms[0]!r})"
        )
    ids = [d.id for d in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"devices lists a device twice: ids {ids}")
    return out


def positive_or_none(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def rng_for(loss_fn: Callable[..., Any], has_key: bool) -> None:
    """Refuses, when the step is traced (before it runs: the state is untouched), a
    key that does not match ``loss_fn``'s signature: the step calls
    ``loss_fn(params, batch, rng)`` when the state holds a key (``step.init(...,
    rng=)``) and ``loss_fn(params, batch)`` when it does not; ``model_state`` always
    goes by keyword. A signature Python cannot read, or one taking ``*args``, is not
    checked."""
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    found = [p for p in sig.parameters.values() if p.name != "model_state"]
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in found):
        return
    positional = [p for p in found if p.kind in kinds]
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    if not has_key and len(required) >= 3:
        raise TypeError(
            f"{name}{sig} takes a key ({required[2].name!r}) but the state holds none: "
            "build it with step.init(params, rng=jax.random.key(0)) (every device and "
            f"step then gets its own key), or give {required[2].name!r} a default"
        )
    if has_key and len(positional) < 3:
        raise TypeError(
            f"the state holds a key (step.init(..., rng=)) but {name}{sig} takes none: "
            "the step calls loss_fn(params, batch, rng) when it holds one. Add the "
            "parameter, or init without rng"
        )


def params(tree: PyTree) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = jax.tree_util.keystr(path)
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, float)):
            raise TypeError(
                f"parameter {name} is a {type(leaf).__name__}, not an array; params must "
                "be a pytree of float arrays: keep configuration and modules out of it "
                "(close over them in loss_fn)"
            )
        dtype = jnp.asarray(leaf).dtype
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"parameter {name} has dtype {dtype}; only float parameters can be "
                "trained: cast it (jnp.asarray(x, jnp.float32)) or keep integer constants "
                "out of params"
            )


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


def loss_output(out: Any, has_aux: bool) -> tuple[Any, Any]:
    """Splits what loss_fn returned into (loss, aux), checking both (at trace time).
    The loss is a float scalar or a :class:`jaxstep.WeightedLoss`."""
    if isinstance(out, WeightedLoss) and has_aux:
        raise TypeError(
            "has_aux=True but loss_fn returned a WeightedLoss alone; return "
            "(WeightedLoss(...), aux) or build the step with has_aux=False"
        )
    if isinstance(out, WeightedLoss):
        return _weighted(out), None
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(
                f"has_aux=True but loss_fn returned {type(out).__name__}; return "
                "(loss, aux) or build the step with has_aux=False"
            )
        loss, aux = out
    else:
        if isinstance(out, (tuple, list)):
            raise TypeError(
                f"loss_fn returned a {type(out).__name__} of {len(out)}; return a scalar "
                "loss, or (loss, aux) with has_aux=True"
            )
        loss, aux = out, None
    if isinstance(loss, WeightedLoss):
        return _weighted(loss), aux
    shape, dtype = getattr(loss, "shape", None), getattr(loss, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"loss_fn must return a float scalar loss, got shape {shape} and dtype {dtype}; "
            "reduce it over the examples (e.g. jnp.mean(per_example)) and keep it floating "
            "point"
        )
    return loss, aux


def _weighted(loss: WeightedLoss) -> WeightedLoss:
    for name, want in (("sum", "a float scalar"), ("weight", "a number")):
        x = getattr(loss, name)
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        ok = shape == () and dtype is not None
        if ok and name == "sum":
            ok = bool(jnp.issubdtype(dtype, jnp.floating))  # type: ignore[arg-type]
        if not ok:
            raise TypeError(
                f"WeightedLoss.{name} must be {want} scalar, got shape {shape} and dtype "
                f"{dtype}; e.g. WeightedLoss(jnp.sum(per_token * mask), jnp.sum(mask))"
            )
    return loss


def checks(aux: PyTree) -> tuple[dict[str, jax.Array], Any]:
    """Splits ``aux["checks"]`` (named boolean scalars) from the rest of aux."""
    if not (isinstance(aux, dict) and "checks" in aux):
        return {}, aux
    found = aux["checks"]
    rest = {k: v for k, v in aux.items() if k != "checks"} or None
    if not isinstance(found, dict):
        raise TypeError(
            f"aux['checks'] must be a dict of named boolean scalars, got {type(found).__name__}"
        )
    for name, v in found.items():
        if getattr(v, "shape", None) != () or getattr(v, "dtype", None) != jnp.bool_:
            raise TypeError(
                f"aux['checks'][{name!r}] must be a boolean scalar, got shape "
                f"{getattr(v, 'shape', None)} and dtype {getattr(v, 'dtype', None)}; reduce "
                "it (e.g. jnp.all(x < 10.0))"
            )
    return {k: found[k] for k in sorted(found)}, rest


def model_state(aux: PyTree, old: PyTree) -> tuple[Any, Any]:
    """Splits ``aux["model_state"]`` (the new model state) from the rest of aux, and
    checks it matches the old one's structure (at trace time). ``old`` None: the
    step has no model state and aux is returned as it is."""
    if old is None:
        return None, aux
    if isinstance(aux, dict) and "model_state" not in aux:
        raise TypeError(
            "the state holds a model_state, so loss_fn must return the new one in "
            f"aux['model_state']; its aux has no 'model_state' key (keys: {sorted(aux)}). "
            "Return it, e.g. {'model_state': updates['batch_stats'], ...}, or init the "
            "state without model_state"
        )
    if not isinstance(aux, dict):
        raise TypeError(
            "the state holds a model_state, so loss_fn must return (loss, aux) with the new "
            "one in aux['model_state'] (build the step with has_aux=True); got aux of type "
            f"{type(aux).__name__}"
        )
    new = aux["model_state"]
    rest = {k: v for k, v in aux.items() if k != "model_state"} or None
    want: Any = jax.tree.structure(old)
    got: Any = jax.tree.structure(new)
    if want != got:
        raise TypeError(
            f"aux['model_state'] must have the structure of the model_state given to "
            f"loss_fn: expected {want}, got {got}"
        )
    for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise TypeError(
                f"aux['model_state'] changed a leaf from {a.shape} {a.dtype} to "
                f"{b.shape} {b.dtype}; return the updated state with the same shapes"
            )
    return new, rest


def model_state_leaves(tree: PyTree, has_aux: bool) -> None:
    """Checks a model state given to ``step.init`` (arrays only; needs has_aux)."""
    if not has_aux:
        raise TypeError(
            "step.init(..., model_state=...) needs a step built with has_aux=True: loss_fn "
            "returns the new model state as aux['model_state']"
        )
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            raise TypeError(
                f"model_state leaf {jax.tree_util.keystr(path)} is a {type(leaf).__name__}, "
                "not an array; keep modules and configuration out of the model state"
            )


def microbatch_rows(size: int, n: int, microbatches: int) -> None:
    if microbatches > 1 and (size // n) % microbatches:
        per = size // n
        raise ValueError(
            f"each device's chunk has {per} rows, which do not split into microbatches="
            f"{microbatches}; use a global batch whose per-device rows divide by "
            f"{microbatches} (e.g. {n * microbatches * max(1, per // microbatches)})"
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


def trainable(tree: Any) -> None:
    """Refuses params with nothing to train (None, an empty pytree) and non-finite
    values, naming the leaf: a NaN given to ``init`` would otherwise surface at step 0
    as if an update had overflowed."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        raise ValueError(
            f"params has no arrays to train (got {tree!r}); pass the model's parameters, "
            "e.g. step.init(model.init(key, x)['params'])"
        )
    for path, leaf in leaves:
        # device arrays are reduced where they live: no copy of the model to the host
        xp = jnp if isinstance(leaf, jax.Array) else np
        if not bool(xp.all(xp.isfinite(leaf))):
            bad = int(np.size(leaf) - np.count_nonzero(np.isfinite(np.asarray(leaf))))
            raise ValueError(
                f"parameter {jax.tree_util.keystr(path)} holds {bad} non-finite value(s) "
                "before any update ran: the initialisation (or the checkpoint it came from) "
                "is broken; fix it, or restore the last good checkpoint"
            )


def key(rng: Any) -> None:
    """Refuses an ``rng`` that is not a PRNG key (a typed ``jax.random.key`` or a raw
    ``jax.random.PRNGKey``'s uint32 data)."""
    dtype = getattr(rng, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if getattr(rng, "shape", None) != ():
            raise TypeError(
                f"rng must be one PRNG key, got keys of shape {rng.shape}; pass "
                "rng=jax.random.key(0): every device and step derives its own from it"
            )
        return
    if isinstance(rng, (jax.Array, np.ndarray)) and dtype == np.uint32 and rng.ndim == 1:
        return  # jax.random.PRNGKey(0): raw key data
    shown = repr(rng) if isinstance(rng, (int, float, str)) else type(rng).__name__
    seed = rng if isinstance(rng, int) else 0
    raise TypeError(
        f"rng={shown} is not a PRNG key; pass rng=jax.random.key({seed}) (every device and "
        "step then derives its own key from it)"
    )


def alive(state: Any) -> None:
    """Refuses a state whose arrays were donated to an earlier step (deleted)."""
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise ValueError(
                "this state was donated to an earlier call and its arrays are deleted: "
                "use the state that call returned, state = jaxstep.fit(step, state, "
                "batches) or state, out = step(state, batch) (make_train_step(donate=False) "
                "keeps the old one alive, at the cost of memory)"
            )


def aux_leaves(aux: Any) -> None:
    """Refuses aux entries the step cannot return (text, objects), naming the key."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
            continue
        name = "aux" + jax.tree_util.keystr(path)
        shown = f" ({leaf[:20]!r})" if isinstance(leaf, (str, bytes)) else ""
        raise TypeError(
            f"{name} is a {type(leaf).__name__}{shown}; aux leaves leave the step as "
            "arrays: return numbers or arrays (log text on the host, from the metrics)"
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


def axis_hint(err: Exception, axis_name: str) -> Exception | None:
    """``err`` from tracing the step, when the model uses an axis name the step does not
    bind (``BatchNorm(axis_name="batch")`` with the default ``axis_name``)."""
    found = re.search(r"unbound axis name: ([^\s.,]+)", str(err))
    if not isinstance(err, NameError) or found is None:
        return None
    name = found.group(1).strip("'\"")
    return ValueError(
        f"loss_fn (or the model, e.g. BatchNorm(axis_name={name!r})) uses the axis name "
        f"{name!r}, but this step binds its device axis as {axis_name!r}: build it with "
        f"make_train_step(..., axis_name={name!r}). Nothing ran; the state is unchanged"
    )


def not_variables(params: Any) -> None:
    """Warns when ``params`` is a whole Flax ``variables`` dict: every leaf of it is
    trained, BatchNorm statistics included (and weight decay reaches them)."""
    if not (isinstance(params, Mapping) and "params" in params and len(params) > 1):
        return
    others = sorted(str(k) for k in params if k != "params")
    warnings.warn(
        f"params looks like a whole Flax variables dict (collections 'params' and "
        f"{others}): every leaf is trained as a parameter, {others[0]} included, and "
        "weight decay (adamw) reaches it. Pass the collections apart: params, model_state "
        "= jaxstep.flax.linen_split(variables); state = step.init(params, "
        "model_state=model_state)",
        stacklevel=3,
    )


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
