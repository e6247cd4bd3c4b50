"""jaxstep.flax.model_rule: flax's logical partitioning metadata, mapped by MaxText's
rules (``("mlp", "tensor")``, ``("heads", "tensor")``), as the
``make_train_step(model_rule=...)`` that splits each leaf over a model group; a
Flax MLP trained on it, its fault named by group; what it refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import jaxstep
import jaxstep.flax
from jaxstep import Status
from jaxstep.testing import Fault
from jaxstep.testing import assert_fails

INIT = nn.initializers.lecun_normal()
#: MaxText's logical_axis_rules, the part a two-layer MLP names
RULES = [("embed", None), ("mlp", "tensor"), ("vocab", "tensor"), ("batch", "data")]


class Mlp(nn.Module):
    """The two-layer Megatron MLP: the first kernel split along its columns, the
    second along its rows; with ``split``, a constraint on the hidden activation
    (it names the model axis: only inside a step with one, not for ``model.init``)."""

    split: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.relu(
            nn.Dense(32, kernel_init=nn.with_logical_partitioning(INIT, ("embed", "mlp")))(x)
        )
        if self.split:
            h = jax.lax.with_sharding_constraint(h, P(None, jaxstep.MODEL_AXIS))
        return nn.Dense(4, kernel_init=nn.with_logical_partitioning(INIT, ("mlp", "embed")))(h)


def _setup(split: bool = False):
    variables = jax.eval_shape(Mlp().init, jax.random.key(0), jnp.ones((1, 16)))
    rule = jaxstep.flax.model_rule(variables, rules=RULES)
    params = nn.unbox(Mlp().init(jax.random.key(0), jnp.ones((1, 16))))["params"]
    model = Mlp(split=split)  # the same parameters; the constraint inside a step only

    def loss_fn(params, batch):
        out = model.apply({"params": params}, batch["x"])
        return jnp.mean((out - batch["y"]) ** 2)

    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(32, 16)).astype(np.float32),
            "y": rng.normal(size=(32, 4)).astype(np.float32),
        }
        for _ in range(4)
    ]
    return rule, params, loss_fn, batches


def test_the_logical_names_mapped_to_tensor_are_the_dimensions_split():
    rule, *_ = _setup()
    assert rule("['Dense_0']['kernel']", (16, 32)) == 1
    assert rule("['Dense_1']['kernel']", (32, 4)) == 0
    assert rule("['Dense_0']['bias']", (32,)) is None  # no box: whole
    assert rule("opt_state[0].mu['Dense_0']['kernel']", (16, 32)) == 1  # Adam's mirror
    assert "jaxstep.flax.model_rule" in repr(rule) and "2 of 4 leaves split" in repr(rule)


def test_a_flax_mlp_trains_split_over_model_groups_and_a_fault_names_its_group():
    rule, params, loss_fn, batches = _setup()
    plain = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), divergence_every=None)
    want = jaxstep.fit(plain, plain.init(params), batches)
    rule, params, loss_fn, batches = _setup(split=True)
    step = jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), model_parallel=2, model_rule=rule, divergence_every=None
    )
    state = jaxstep.fit(step, step.init(params), batches)
    assert state.params["Dense_0"]["kernel"].sharding.spec == P(None, jaxstep.MODEL_AXIS)
    got = step.host_state(state).params
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    faulty = jaxstep.make_train_step(
        loss_fn,
        optax.adam(1e-2),
        model_parallel=2,
        model_rule=rule,
        faults=[Fault("grad", device_id=7, step=1)],
    )
    err = assert_fails(
        lambda: jaxstep.fit(faulty, faulty.init(params), batches, diagnose=False),
        device_id=6,
        step=1,
        status=Status.GRAD_NONFINITE,
    )
    assert err.group == (6, 7)


def test_boxes_that_name_no_model_axis_are_refused_naming_the_axes_they_name():
    model = Mlp()
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 16)))
    with pytest.raises(ValueError, match="pass axes= the one\\(s\\) of the model group"):
        jaxstep.flax.model_rule(variables, rules=[("embed", None), ("mlp", "fsdp")])


# ----------------------------------------------------------- an lm1b-style transformer
V, SEQ = 32, 8  # vocabulary, tokens a row
#: MaxText's logical_axis_rules, the names an lm1b block uses
LM_RULES = [
    ("batch", "data"),
    ("vocab", "tensor"),
    ("embed", None),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
]


def _logical(names):
    return nn.with_logical_partitioning(INIT, names)


class LmBlock(nn.Module):
    """examples/lm1b's decoder in one block: embedding (vocab split), causal attention
    (heads split), MLP (mlp split), logits by attending to the embedding."""

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(V, 16, embedding_init=_logical(("vocab", "embed")))
        x = embed(tokens)
        attention = nn.MultiHeadDotProductAttention(
            num_heads=4,
            kernel_init=_logical(("embed", "heads", "kv")),
            out_kernel_init=_logical(("heads", "kv", "embed")),
        )
        x = x + attention(nn.LayerNorm()(x), mask=nn.make_causal_mask(tokens))
        h = nn.relu(nn.Dense(32, kernel_init=_logical(("embed", "mlp")))(nn.LayerNorm()(x)))
        x = x + nn.Dense(16, kernel_init=_logical(("mlp", "embed")))(h)
        return embed.attend(nn.LayerNorm()(x))


def test_an_lm1b_block_splits_heads_mlp_and_vocab_and_trains_as_the_replicated_step():
    model = LmBlock()
    tokens = jnp.ones((1, SEQ), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    rule = jaxstep.flax.model_rule(variables, rules=LM_RULES)
    params = nn.unbox(model.init(jax.random.key(0), tokens))["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"][:, :-1])
        targets = batch["tokens"][:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    # SGD: under Adam the key bias (whose gradient is 0 up to rounding: softmax ignores
    # a constant) moves by the learning rate either way, whoever sums
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (16, SEQ + 1)).astype(np.int32)} for _ in range(3)]
    plain = jaxstep.make_train_step(loss_fn, optax.sgd(0.1), divergence_every=None)
    want = plain.host_state(jaxstep.fit(plain, plain.init(params), batches)).params
    step = jaxstep.make_train_step(
        loss_fn, optax.sgd(0.1), model_parallel=2, model_rule=rule, divergence_every=None
    )
    state = jaxstep.fit(step, step.init(params), batches)
    split = P(None, jaxstep.MODEL_AXIS)
    assert state.params["MultiHeadDotProductAttention_0"]["query"]["kernel"].sharding.spec == split
    assert state.params["Dense_0"]["kernel"].sharding.spec == split
    assert state.params["Embed_0"]["embedding"].sharding.spec == P(jaxstep.MODEL_AXIS)
    got = step.host_state(state).params
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
