"""Checks of what users pass in: each raises a ValueError/TypeError that names the
offending value and the fix, before anything runs.

The layers read every check here, as ``validate.name(...)``: those of the step's
arguments and of a state's parts are written below; those of a batch
(:mod:`jaxstep._src.core._batch_checks`) and of what ``loss_fn`` takes and returns
(:mod:`jaxstep._src.core._loss_checks`) are written beside it and listed here."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep._src.core._batch_checks import batch as batch
from jaxstep._src.core._batch_checks import changed_leaf as changed_leaf
from jaxstep._src.core._batch_checks import examples_list as examples_list
from jaxstep._src.core._batch_checks import looks_presplit as looks_presplit
from jaxstep._src.core._batch_checks import microbatch_rows as microbatch_rows
from jaxstep._src.core._batch_checks import presplit_hint as presplit_hint
from jaxstep._src.core._loss_checks import aux_leaves as aux_leaves
from jaxstep._src.core._loss_checks import axis_hint as axis_hint
from jaxstep._src.core._loss_checks import checks as checks
from jaxstep._src.core._loss_checks import loss_output as loss_output
from jaxstep._src.core._loss_checks import model_state as model_state
from jaxstep._src.core._loss_checks import rng_for as rng_for
from jaxstep._src.core._speech import warn
from jaxstep._src.core._types import PyTree


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


def params(tree: PyTree) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = jax.tree_util.keystr(path)
        not_donated(leaf, f"parameter {name}")
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


def model_state_leaves(tree: PyTree, has_aux: bool) -> None:
    """Checks a model state given to ``step.init`` (arrays only; needs has_aux)."""
    if not has_aux:
        raise TypeError(
            "step.init(..., model_state=...) needs a step built with has_aux=True: loss_fn "
            "returns the new model state as aux['model_state']"
        )
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        not_donated(leaf, f"model_state leaf {jax.tree_util.keystr(path)}")
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            raise TypeError(
                f"model_state leaf {jax.tree_util.keystr(path)} is a {type(leaf).__name__}, "
                "not an array; keep modules and configuration out of the model state"
            )


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


def not_donated(leaf: Any, what: str) -> None:
    """Refuses an array whose buffer was donated to a compiled call and deleted, in
    jaxstep's words (JAX says only "Buffer has been deleted or donated")."""
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
        raise ValueError(
            f"{what} is a deleted array: its buffer was donated to a compiled call (a "
            "training step donates the state it is given) and no longer exists. Pass "
            "arrays you still hold: the parameters a step trained are in the state it "
            "returned (step.host_state(state).params); step.init copies what it takes, "
            "so the params given to it stay usable"
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


def not_variables(params: Any) -> None:
    """Warns when ``params`` is a whole Flax ``variables`` dict: every leaf of it is
    trained, BatchNorm statistics included (and weight decay reaches them)."""
    if not (isinstance(params, Mapping) and "params" in params and len(params) > 1):
        return
    others = sorted(str(k) for k in params if k != "params")
    warn(
        f"params looks like a whole Flax variables dict (collections 'params' and "
        f"{others}): every leaf is trained as a parameter, {others[0]} included, and "
        "weight decay (adamw) reaches it. Pass the collections apart: params, model_state "
        "= jaxstep.flax.linen_split(variables); state = step.init(params, "
        "model_state=model_state)",
    )
