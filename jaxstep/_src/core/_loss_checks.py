"""The checks, at trace time, of what ``loss_fn`` takes and returns, read through
:mod:`jaxstep._src.core.validate`: its key argument, the loss (a float scalar or a
:class:`jaxstep.WeightedLoss`), the user checks and the model state in its aux, the
aux leaves, an axis name the step does not bind. Each names the value and the fix."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep._src.core._types import PyTree
from jaxstep._src.core._weighted import WeightedLoss


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
