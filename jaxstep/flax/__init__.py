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

Sharded state laid out as the model's ``nn.with_partitioning`` boxes say::

    variables = module.init(key, x)  # boxes kept
    step = jaxstep.make_train_step(
        loss_fn, tx, shard_state="params", shard_rule=jaxstep.flax.shard_rule(variables)
    )

The same boxes as a model axis (tensor parallelism; MaxText's logical rules)::

    step = jaxstep.make_train_step(
        loss_fn, tx, model_parallel=2,
        model_rule=jaxstep.flax.model_rule(variables, rules=[("mlp", "tensor"), ...]),
    )
"""

from jaxstep._src.flax import NNXGraph as NNXGraph
from jaxstep._src.flax import linen_apply as linen_apply
from jaxstep._src.flax import linen_merge as linen_merge
from jaxstep._src.flax import linen_split as linen_split
from jaxstep._src.flax import model_rule as model_rule
from jaxstep._src.flax import nnx_loss_fn as nnx_loss_fn
from jaxstep._src.flax import nnx_merge as nnx_merge
from jaxstep._src.flax import nnx_split as nnx_split
from jaxstep._src.flax import shard_rule as shard_rule

__all__ = [
    "NNXGraph",
    "linen_apply",
    "linen_merge",
    "linen_split",
    "model_rule",
    "nnx_loss_fn",
    "nnx_merge",
    "nnx_split",
    "shard_rule",
]
