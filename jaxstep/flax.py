"""Flax models in a few lines: linen variables and NNX modules as jaxstep's
``params`` (trained) plus ``model_state`` (updated as the model runs: BatchNorm
statistics, counters).

Both halves are plain nested dicts keyed by module path, so a failing leaf is named
``['conv1']['kernel']`` or ``model_state['bn1']['mean']``. Random numbers come from
the step's key (``step.init(..., rng=key)``), folded with the step and the device,
so every device draws its own and a replay draws the same ones again.

NNX::

    graph, params, model_state = jaxstep.flax.nnx_split(model)
    step = jaxstep.make_train_step(
        jaxstep.flax.nnx_loss_fn(graph, loss), optax.adam(1e-3), has_aux=True
    )
    state = step.init(params, model_state=model_state, rng=jax.random.key(0))

linen::

    params, model_state = jaxstep.flax.linen_split(module.init(key, x))

    def loss_fn(params, batch, rng, *, model_state):
        logits, model_state = jaxstep.flax.linen_apply(
            module, params, model_state, batch["image"], rng=rng, train=True
        )
        return xent(logits, batch["label"]), {"model_state": model_state}
"""

# This module is ``jaxstep.flax``; imports are absolute, so ``flax`` below is the
# real Flax package, not this file.
from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax import traverse_util
from flax.core import meta

__all__ = [
    "NNXGraph",
    "linen_apply",
    "linen_merge",
    "linen_split",
    "nnx_loss_fn",
    "nnx_merge",
    "nnx_split",
]


def _stream_key(rng: jax.Array, name: str) -> jax.Array:
    """A key of its own for the stream ``name``, stable however the model grows."""
    if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng)  # a raw jax.random.PRNGKey
    return jax.random.fold_in(rng, zlib.crc32(name.encode()) & 0x7FFFFFFF)


# ----------------------------------------------------------------------- linen
def linen_split(variables: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Splits linen ``variables`` into ``(params, model_state)``.

    Args:
      variables: what ``module.init`` returns: ``{"params": ..., "batch_stats": ...}``.

    Returns:
      ``variables["params"]`` and a dict of every other collection (empty for a
      model without state), unboxed: the ``nn.Partitioned`` boxes of
      ``nn.with_logical_partitioning`` (the lm1b, wmt and gemma examples) are
      replaced by their arrays, as those examples do before training, so that a
      leaf is named ``['Dense_0']['kernel']``, not ``['Dense_0']['kernel'].value``
      (jaxstep keeps a whole copy of the state on every device: no sharding to
      annotate). ``module.apply`` takes the unboxed arrays.

    Raises:
      ValueError: there is no ``"params"`` collection.
    """
    if "params" not in variables:
        raise ValueError(
            f"linen variables without a 'params' collection (found {sorted(variables)}); "
            "pass what module.init(key, x) returns"
        )
    variables = meta.unbox(variables)
    model_state = {k: v for k, v in variables.items() if k != "params"}
    return variables["params"], model_state


def linen_merge(params: Any, model_state: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The inverse of :func:`linen_split`: ``variables`` for ``module.apply``.

    Args:
      params: the parameters (``step.host_state(state).params``).
      model_state: the other collections (``.model_state``), or None.

    Returns:
      ``{"params": params, **model_state}``.

    Example:
      >>> from jaxstep.flax import linen_merge
      >>> sorted(linen_merge({"w": 1.0}, {"batch_stats": {"mean": 0.0}}))
      ['batch_stats', 'params']
    """
    return {"params": params, **(model_state or {})}


def linen_apply(
    module: Any,
    params: Any,
    model_state: Mapping[str, Any] | None,
    *args: Any,
    rng: jax.Array | None = None,
    rng_streams: Sequence[str] = ("dropout",),
    mutable: Sequence[str] | None = None,
    **kwargs: Any,
) -> tuple[Any, dict[str, Any]]:
    """``module.apply`` in training mode, for use inside a jaxstep ``loss_fn``.

    Args:
      module: a ``flax.linen.Module``.
      params: the ``params`` collection (the step's parameters).
      model_state: the other collections (``model_state`` given to ``loss_fn``).
      *args: positional inputs of the module.
      rng: the key ``loss_fn`` received (per step and device), or None.
      rng_streams: the linen RNG streams fed from ``rng``, each with a key of its own.
      mutable: the collections the module may update; default every collection of
        ``model_state`` (``["batch_stats"]`` for a BatchNorm model).
      **kwargs: keyword inputs of the module (``train=True``, ...).

    Returns:
      ``(outputs, new_model_state)``; collections the module did not update are
      passed through, so with the default ``mutable`` the structure never changes
      (a collection added through ``mutable``, e.g. ``"intermediates"``, is in
      ``new_model_state`` too: take it out before returning the state to jaxstep).
    """
    model_state = dict(model_state or {})
    mutable = list(model_state) if mutable is None else list(mutable)
    rngs = None if rng is None else {s: _stream_key(rng, s) for s in rng_streams}
    variables = linen_merge(params, model_state)
    if not mutable:
        return module.apply(variables, *args, rngs=rngs, **kwargs), model_state
    out, updated = module.apply(variables, *args, rngs=rngs, mutable=mutable, **kwargs)
    return out, {**model_state, **updated}


# ------------------------------------------------------------------------- NNX
@dataclasses.dataclass(frozen=True, eq=False)
class NNXGraph:
    """What :func:`nnx_split` keeps of a module besides its arrays: the graph
    definition, the shapes of its parameters and state, and its RNG streams.

    Attributes:
      graphdef: ``nnx.graphdef`` of the module (its structure and static fields,
        e.g. whether it is in train or eval mode).
      params: the ``nnx.Param`` half, as an ``nnx.State`` of shapes (a template).
      model_state: every other variable except RNG state (``nnx.BatchStat``, ...),
        as shapes.
      rngs: the module's RNG streams (``nnx.RngState``): constant under jaxstep,
        which reseeds them from the step's key on every step and device.
    """

    graphdef: Any
    params: nnx.State
    model_state: nnx.State
    rngs: nnx.State

    @property
    def streams(self) -> list[str]:
        """Paths of the module's RNG stream keys, e.g. ``"['dropout1']['rngs']"``."""
        return [_path_str(p[:-1]) for p in _flat(self.rngs) if p[-1] == "key"]


def _path_str(path: Sequence[Any]) -> str:
    return "".join(f"[{p!r}]" for p in path)


def _flat(state: nnx.State) -> dict[tuple[Any, ...], Any]:
    return traverse_util.flatten_dict(nnx.to_pure_dict(state))


def _shapes(state: nnx.State) -> nnx.State:
    """The same variables holding ``jax.ShapeDtypeStruct`` s: a template that pins no memory."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def _require_state(graph: NNXGraph, model_state: Any) -> None:
    if model_state is None and _flat(graph.model_state):
        raise ValueError(
            f"the module has state besides its parameters "
            f"({[_path_str(p) for p in _flat(graph.model_state)]}); pass the model_state "
            "from jaxstep.flax.nnx_split: step.init(params, model_state=model_state, ...)"
        )


def _fresh(template: nnx.State, values: Mapping[str, Any] | None = None) -> nnx.State:
    """New ``Variable`` objects (owned by the current trace) holding ``values``."""
    state = jax.tree.map(lambda x: x, template)
    if values:
        # jax arrays, never numpy: a module updates its variables in place, which
        # would write into the caller's numpy arrays.
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, dict(values)))
    return state


def nnx_split(module: nnx.Module) -> tuple[NNXGraph, dict[str, Any], dict[str, Any]]:
    """Splits an NNX module into jaxstep's halves.

    Call ``module.train()`` (or ``.eval()``) first: the mode is part of the graph.

    Args:
      module: an ``nnx.Module``.

    Returns:
      ``(graph, params, model_state)``: ``params`` holds every ``nnx.Param`` and
      ``model_state`` every other variable except RNG state, both as nested dicts
      keyed by module path (``{"conv1": {"kernel": ...}}``); ``graph`` rebuilds the
      module (:func:`nnx_loss_fn`, :func:`nnx_merge`).

    Example:
      >>> from flax import nnx
      >>> model = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
      >>> graph, params, model_state = nnx_split(model)
      >>> sorted(params), sorted(model_state)
      (['bias', 'scale'], ['mean', 'var'])
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"expected an nnx.Module, got {type(module).__name__}; for a linen module "
            "use jaxstep.flax.linen_split(module.init(key, x))"
        )
    split = nnx.split(module, nnx.Param, nnx.RngState, ...)
    graphdef, params, rngs, rest = split  # type: ignore[misc]
    rngs = jax.tree.map(jnp.asarray, rngs)  # see _fresh
    graph = NNXGraph(graphdef, _shapes(params), _shapes(rest), rngs)
    return graph, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def nnx_merge(
    graph: NNXGraph, params: Mapping[str, Any], model_state: Mapping[str, Any] | None = None
) -> nnx.Module:
    """Rebuilds the module from trained halves, for evaluation or saving. Its RNG
    streams are the ones it had at :func:`nnx_split`.

    Args:
      graph: from :func:`nnx_split`.
      params: the trained parameters (``step.host_state(state).params``).
      model_state: the trained model state (``.model_state``); None only for a module
        without one.

    Returns:
      A new ``nnx.Module``.

    Raises:
      ValueError: ``model_state`` is missing for a module that has one.
    """
    _require_state(graph, model_state)
    return nnx.merge(
        graph.graphdef,
        _fresh(graph.params, params),
        _fresh(graph.rngs),
        _fresh(graph.model_state, model_state),
    )


def _reseeded(rngs: nnx.State, rng: jax.Array) -> dict[str, Any]:
    """The module's RNG state with every stream keyed from ``rng`` and counts at 0."""

    def one(path: tuple[Any, ...], x: jax.Array) -> jax.Array:
        if path[-1] == "count":
            return jnp.zeros_like(x)
        key = _stream_key(rng, _path_str(path[:-1]))
        return key if x.shape == () else jax.random.split(key, x.shape)

    return traverse_util.unflatten_dict({p: one(p, x) for p, x in _flat(rngs).items()})


def nnx_loss_fn(
    graph: NNXGraph,
    loss: Callable[..., Any],
    *,
    has_aux: bool = False,
    pass_rngs: bool = False,
) -> Callable[..., tuple[jax.Array, dict[str, Any]]]:
    """A jaxstep ``loss_fn`` that runs ``loss`` on the rebuilt module.

    Build the step with ``has_aux=True`` and the state with
    ``step.init(params, model_state=model_state, rng=key)`` (the key is needed as
    soon as the module draws random numbers, e.g. in ``nnx.Dropout``).

    Args:
      graph: from :func:`nnx_split`.
      loss: ``loss(model, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``, aux
        a dict; ``aux["checks"]`` works as for any jaxstep loss). With
        ``pass_rngs=True`` it is called as ``loss(model, batch, rngs)`` with an
        ``nnx.Rngs`` seeded from the step's key, for modules that take their RNGs at
        call time (``model(x, rngs)``).
      has_aux: whether ``loss`` returns ``(loss, aux)``.
      pass_rngs: see ``loss``.

    Returns:
      ``loss_fn(params, batch[, rng], *, model_state) -> (loss, aux)`` with the
      module's new state in ``aux["model_state"]``. Every RNG stream of the module
      is reseeded from ``rng`` (folded with the stream's path), so each device and
      step draws its own numbers.
    """

    def loss_fn(
        params: Any, batch: Any, rng: jax.Array | None = None, *, model_state: Any = None
    ) -> tuple[jax.Array, dict[str, Any]]:
        if rng is None and pass_rngs:
            raise ValueError(
                "nnx_loss_fn(..., pass_rngs=True) needs the step's key: build the state "
                "with step.init(params, model_state=..., rng=jax.random.key(0))"
            )
        _require_state(graph, model_state)
        rngs = _fresh(graph.rngs, None if rng is None else _reseeded(graph.rngs, rng))
        before = _flat(rngs)
        model = nnx.merge(
            graph.graphdef,
            _fresh(graph.params, params),
            rngs,
            _fresh(graph.model_state, model_state),
        )
        if pass_rngs and rng is not None:
            out = loss(model, batch, nnx.Rngs(_stream_key(rng, "call")))
        else:
            out = loss(model, batch)
        value, aux = out if has_aux else (out, {})
        if not isinstance(aux, dict):
            raise TypeError(
                f"with has_aux=True the loss must return (loss, dict), got aux of type "
                f"{type(aux).__name__}; put it in a dict, e.g. {{'logits': logits}}"
            )
        if "model_state" in aux:
            raise ValueError(
                "aux['model_state'] is filled by jaxstep.flax.nnx_loss_fn; rename yours"
            )
        _, new_rngs, new_state = nnx.state(model, nnx.Param, nnx.RngState, ...)
        if rng is None:
            # A stream that was drawn from holds a new count; an untouched one the
            # very array it was given.
            drawn = [_path_str(p[:-1]) for p, x in _flat(new_rngs).items() if x is not before[p]]
            if drawn:
                raise ValueError(
                    f"the model drew random numbers from its nnx RNG stream(s) {drawn}, but "
                    "the step has no key, so every step and device would draw the same "
                    "ones: build the state with step.init(params, model_state=..., "
                    "rng=jax.random.key(0)), or call model.eval() before nnx_split"
                )
        if model_state is None:
            return value, aux
        # Only the variables the module had at split time: sown intermediates go.
        keep, new = _flat(graph.model_state), _flat(new_state)
        kept = traverse_util.unflatten_dict({p: new[p] for p in keep})
        return value, {**aux, "model_state": kept}

    return loss_fn
