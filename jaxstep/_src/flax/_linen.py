"""linen variables as jaxstep's halves: ``params`` (trained) and ``model_state`` (every
other collection), and ``module.apply`` in training mode inside a ``loss_fn``."""

# Imports are absolute, so ``flax`` below is the real Flax package, not jaxstep.flax.
from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
from flax.core import meta

from jaxstep._src.flax._keys import stream_key


def linen_split(variables: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Splits linen ``variables`` into ``(params, model_state)``.

    Args:
      variables: what ``module.init`` returns: ``{"params": ..., "batch_stats": ...}``.

    Returns:
      ``variables["params"]`` and a dict of every other collection (empty for a
      model without state), unboxed: the boxes of ``nn.with_partitioning`` and
      ``nn.with_logical_partitioning`` (``nn.Partitioned``, the lm1b, wmt and gemma
      examples) are replaced by their arrays, as those examples do before
      training, so that a leaf is named ``['Dense_0']['kernel']``, not
      ``['Dense_0']['kernel'].value``. ``module.apply`` takes the unboxed arrays.
      To shard the state as the boxes say, build :func:`shard_rule` from
      ``variables`` (boxes kept) as well.

    Raises:
      ValueError: there is no ``"params"`` collection.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> from jaxstep.flax import linen_split
      >>> model = nn.Sequential([nn.Dense(4), nn.BatchNorm(use_running_average=False)])
      >>> variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> params, model_state = linen_split(variables)
      >>> sorted(params["layers_0"]), sorted(model_state["batch_stats"]["layers_1"])
      (['bias', 'kernel'], ['mean', 'var'])
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

    Example:
      Inside a ``loss_fn(params, batch, *, model_state)``:

      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> from jaxstep.flax import linen_apply, linen_split
      >>> model = nn.Sequential([nn.Dense(4), nn.BatchNorm(use_running_average=False)])
      >>> params, model_state = linen_split(model.init(jax.random.key(0), jnp.ones((2, 3))))
      >>> y, new_state = linen_apply(model, params, model_state, jnp.ones((2, 3)))
      >>> y.shape, sorted(new_state)
      ((2, 4), ['batch_stats'])
    """
    model_state = dict(model_state or {})
    mutable = list(model_state) if mutable is None else list(mutable)
    rngs = None if rng is None else {s: stream_key(rng, s) for s in rng_streams}
    variables = linen_merge(params, model_state)
    if not mutable:
        return module.apply(variables, *args, rngs=rngs, **kwargs), model_state
    out, updated = module.apply(variables, *args, rngs=rngs, mutable=mutable, **kwargs)
    return out, {**model_state, **updated}
