"""NNX modules as jaxstep's halves: :func:`nnx_split` takes a module apart into
``params``, ``model_state`` and what rebuilds it; :func:`nnx_loss_fn` rebuilds it on
every step (its RNG streams reseeded from the step's key) and returns its new state."""

# Imports are absolute, so ``flax`` below is the real Flax package, not jaxstep.flax.
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax import traverse_util

from jaxstep._src.flax._keys import stream_key


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

    Example:
      >>> from flax import nnx
      >>> from jaxstep.flax import nnx_split
      >>> graph, params, model_state = nnx_split(nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
      >>> graph.params["kernel"].shape, model_state  # shapes: the arrays are in params
      ((3, 1), {})
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

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxstep.flax import nnx_merge, nnx_split
      >>> graph, params, model_state = nnx_split(nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
      >>> model = nnx_merge(graph, params, model_state)  # trained: step.host_state(state)'s
      >>> type(model).__name__, model(jnp.ones((2, 3))).shape
      ('Linear', (2, 1))
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
        key = stream_key(rng, _path_str(path[:-1]))
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

    Example:
      >>> import jax.numpy as jnp, optax, jaxstep
      >>> from flax import nnx
      >>> from jaxstep.flax import nnx_loss_fn, nnx_split
      >>> graph, params, model_state = nnx_split(nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
      >>> loss_fn = nnx_loss_fn(graph, lambda model, b: jnp.mean((model(b["x"]) - b["y"]) ** 2))
      >>> step = jaxstep.make_train_step(loss_fn, optax.sgd(0.1), has_aux=True)
      >>> state = step.init(params, model_state=model_state)
      >>> state, out = step(state, {"x": jnp.ones((16, 3)), "y": jnp.ones((16, 1))})
      >>> int(state.step), step.table(out).failed
      (1, False)
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
            out = loss(model, batch, nnx.Rngs(stream_key(rng, "call")))
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
