"""jaxstep.flax.shard_rule: flax's partitioning metadata (nn.with_partitioning,
nn.with_logical_partitioning and their rules, nn.scan's stacked axis) as the
``make_train_step(shard_rule=...)`` that shards each leaf along the dimension named for
the data-parallel group; what it refuses, and the message that says so."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxstep
import jaxstep.flax

INIT = nn.initializers.lecun_normal()


def _partitioned(names):
    return nn.with_partitioning(INIT, names)


def _logical(names, rules=None):
    return nn.with_logical_partitioning(INIT, names, rules=rules)


def _names(tree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


class Mlp(nn.Module):
    """Kernels partitioned over "fsdp" on the axis the default rule would not pick
    (it takes the largest that divides), biases unboxed; a logical head."""

    out: int = 32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(64, kernel_init=_partitioned(("fsdp", None)))(x))  # (16, 64)
        x = nn.relu(nn.Dense(16, kernel_init=_partitioned((None, "fsdp")))(x))  # (64, 16)
        return nn.Dense(self.out, kernel_init=_logical(("embed", "vocab")), name="head")(x)


RULES = [("embed", "fsdp"), ("vocab", "tensor")]  # the head's kernel (16, 32) along 0
#: What the rule gives each leaf of Mlp's params, built with RULES.
AXES = {
    "['Dense_0']['bias']": None,
    "['Dense_0']['kernel']": 0,
    "['Dense_1']['bias']": None,
    "['Dense_1']['kernel']": 1,
    "['head']['bias']": None,
    "['head']['kernel']": 0,
}


def _variables(model: nn.Module | None = None, width: int = 16):
    return (model or Mlp()).init(jax.random.key(0), jnp.ones((1, width)))


def _shapes(params) -> dict[str, tuple[int, ...]]:
    return {
        jax.tree_util.keystr(p): tuple(np.shape(x))
        for p, x in jax.tree_util.tree_leaves_with_path(params)
    }


# ----------------------------------------------------------------------- reading
@pytest.mark.parametrize("built_from", ["variables", "params", "eval_shape"])
def test_each_leaf_gets_the_dimension_its_box_names_for_the_axis(built_from):
    variables = _variables()
    source = {
        "variables": variables,
        "params": variables["params"],
        "eval_shape": jax.eval_shape(Mlp().init, jax.random.key(0), jnp.ones((1, 16))),
    }[built_from]
    rule = jaxstep.flax.shard_rule(source, rules=RULES)
    params, _ = jaxstep.flax.linen_split(variables)
    shapes = _shapes(params)
    assert sorted(shapes) == sorted(AXES)
    assert {path: rule(path, shape) for path, shape in shapes.items()} == AXES
    # the paths of a step given the whole variables carry the collection in front
    assert {path: rule("['params']" + path, shape) for path, shape in shapes.items()} == AXES


def test_the_rule_covers_what_linen_split_gives_the_step_and_split_unboxes_every_box():
    variables = _variables()
    assert isinstance(variables["params"]["Dense_0"]["kernel"], nn.Partitioned)
    assert isinstance(variables["params"]["head"]["kernel"], nn.LogicallyPartitioned)
    params, model_state = jaxstep.flax.linen_split(variables)
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
    assert all(isinstance(x, jax.Array) for x in leaves) and len(leaves) == 6
    assert model_state == {}
    rule = jaxstep.flax.shard_rule(variables, rules=RULES)
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        rule(jax.tree_util.keystr(path), x.shape)  # every leaf is known: no error


def test_a_single_name_and_a_tuple_entry_both_mean_the_group():
    variables = _variables()
    rule = jaxstep.flax.shard_rule(variables, axes="fsdp", rules=RULES)
    assert rule("['Dense_1']['kernel']", (64, 16)) == 1

    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16, kernel_init=_partitioned((("data", "fsdp"), "tensor")))(x)

    rule = jaxstep.flax.shard_rule(_variables(Wide(), 8), axes=("fsdp",))
    assert rule("['Dense_0']['kernel']", (8, 16)) == 0


def test_logical_names_are_mapped_as_flax_maps_them_priorities_included():
    names = ("embed", "mlp")
    assert nn.logical_to_mesh_axes(names, [("embed", "fsdp"), ("mlp", "fsdp")]) == P("fsdp", None)
    for rules, axis in [
        ([("embed", "fsdp"), ("mlp", "fsdp")], 0),  # fsdp is taken by the first rule
        ([("mlp", "fsdp"), ("embed", "fsdp")], 1),
        ([("embed", ["data", "fsdp"]), ("mlp", "tensor")], 0),  # MaxText's YAML: lists
        ([("embed", None), ("mlp", "fsdp")], 1),
    ]:

        class Model(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(16, kernel_init=_logical(names))(x)

        rule = jaxstep.flax.shard_rule(_variables(Model(), 8), rules=rules)
        assert rule("['Dense_0']['kernel']", (8, 16)) == axis, rules


def test_a_boxs_own_rules_come_first_then_the_argument_then_flaxs_context():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16, kernel_init=_logical(("a", "b"), rules=(("a", "fsdp"),)))(x)
            return nn.Dense(16, kernel_init=_logical(("a", "b")))(x)

    variables = _variables(Model(), 16)
    rule = jaxstep.flax.shard_rule(variables, rules=[("b", "fsdp")])
    assert rule("['Dense_0']['kernel']", (16, 16)) == 0  # its own
    assert rule("['Dense_1']['kernel']", (16, 16)) == 1  # the argument's
    with nn.logical_axis_rules([("b", "fsdp")]):
        rule = jaxstep.flax.shard_rule(variables)
    assert rule("['Dense_0']['kernel']", (16, 16)) == 0
    assert rule("['Dense_1']['kernel']", (16, 16)) == 1  # the context's
    with nn.logical_axis_rules([("a", "fsdp")]):
        rule = jaxstep.flax.shard_rule(variables, rules=[("b", "fsdp")])
    assert rule("['Dense_1']['kernel']", (16, 16)) == 1  # the argument before the context


class Stacked(nn.Module):
    """nn.scan over 3 layers: flax adds the stacked axis to each box under the name
    given as metadata_params[nn.PARTITION_NAME]."""

    @nn.compact
    def __call__(self, x):
        class Layer(nn.Module):
            @nn.compact
            def __call__(self, x, _):
                return nn.Dense(8, kernel_init=_partitioned((None, "fsdp")))(x), None

        scan = nn.scan(
            Layer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        return scan()(x, None)[0]


def test_scanned_layers_keep_their_axis_behind_the_stacked_one():
    variables = _variables(Stacked(), 8)
    box = variables["params"]["ScanLayer_0"]["Dense_0"]["kernel"]
    assert box.names == ("layers", None, "fsdp") and box.value.shape == (3, 8, 8)
    rule = jaxstep.flax.shard_rule(variables)
    assert rule("['ScanLayer_0']['Dense_0']['kernel']", (3, 8, 8)) == 2
    assert rule("['ScanLayer_0']['Dense_0']['bias']", (3, 8)) is None
    rule = jaxstep.flax.shard_rule(variables, axes="layers")  # shard the stack instead
    assert rule("['ScanLayer_0']['Dense_0']['kernel']", (3, 8, 8)) == 0


def test_optimizer_leaves_take_their_parameters_axis_and_adams_count_stays_whole():
    variables = _variables()
    params, _ = jaxstep.flax.linen_split(variables)
    rule = jaxstep.flax.shard_rule(variables, rules=RULES)
    opt_state = optax.adam(1e-3).init(params)
    asked = {
        "opt_state" + jax.tree_util.keystr(p): rule("opt_state" + jax.tree_util.keystr(p), x.shape)
        for p, x in jax.tree_util.tree_leaves_with_path(opt_state)
    }
    assert asked.pop("opt_state[0].count") is None
    assert len(asked) == 12
    for path, axis in asked.items():
        assert axis == AXES[path[path.index("[", len("opt_state[0]")) :]], path
    # a factored moment (another shape) stays whole
    assert rule("opt_state[0].v_row['Dense_0']['kernel']", (16,)) is None


def test_the_rule_says_what_it_shards_in_its_repr():
    rule = jaxstep.flax.shard_rule(_variables(), rules=RULES)
    assert rule.__name__ == "jaxstep.flax.shard_rule"
    assert repr(rule) == (
        "jaxstep.flax.shard_rule(axes=('fsdp',)): 3 of 6 leaves sharded "
        "(['Dense_0']['kernel']: 0, ['Dense_1']['kernel']: 1, ['head']['kernel']: 0)"
    )


# --------------------------------------------------------------------- refusals
def test_a_path_the_rule_was_not_built_for_is_refused_naming_it_and_the_known_ones():
    rule = jaxstep.flax.shard_rule(_variables(), rules=RULES)
    with pytest.raises(ValueError, match=r"asked about \['Dense_9'\]\['kernel'\]") as info:
        rule("['Dense_9']['kernel']", (16, 64))
    assert "['Dense_0']['bias'], ['Dense_0']['kernel']" in str(info.value)
    assert "model.init" in str(info.value)
    with pytest.raises(ValueError, match=r"\['batch_stats'\]"):
        rule("['batch_stats']['mean']", (16,))


def test_a_shape_other_than_the_variables_is_refused():
    rule = jaxstep.flax.shard_rule(_variables(), rules=RULES)
    with pytest.raises(ValueError, match=r"shape \(32, 64\).*with shape \(16, 64\)"):
        rule("['Dense_0']['kernel']", (32, 64))


def test_unboxed_variables_are_refused_saying_the_boxes_came_off():
    params, _ = jaxstep.flax.linen_split(_variables())
    with pytest.raises(ValueError, match="none of the 6 leaves has a partitioning box") as info:
        jaxstep.flax.shard_rule(params)
    assert "linen_split" in str(info.value)


def test_axes_the_boxes_never_name_are_refused_listing_the_names_they_use():
    with pytest.raises(ValueError, match=r"over \('data',\).*\['fsdp', 'tensor'\]"):
        jaxstep.flax.shard_rule(_variables(), axes="data", rules=RULES)


def test_a_leaf_partitioned_over_the_group_along_two_dimensions_is_refused():
    with pytest.raises(ValueError, match=r"\['head'\]\['kernel'\].*dimensions \[0, 1\]") as info:
        jaxstep.flax.shard_rule(_variables(), axes=("fsdp", "tensor"), rules=RULES)
    assert "narrow axes=" in str(info.value)


def test_logical_names_without_rules_are_refused_naming_the_leaf():
    with pytest.raises(ValueError, match=r"\['head'\]\['kernel'\] has logical names") as info:
        jaxstep.flax.shard_rule(_variables())
    assert "rules=" in str(info.value)


def test_more_names_than_dimensions_is_refused():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, kernel_init=_partitioned((None, "fsdp", None)))(x)

    with pytest.raises(ValueError, match="more names than dimensions"):
        jaxstep.flax.shard_rule(_variables(Model(), 8))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"axes": ()}, "axes must name"),
        ({"axes": ("fsdp", 1)}, "axes must name"),
        ({"rules": [("embed", "fsdp", "x")]}, r"rules must be \(logical_name, mesh_axes\) pairs"),
        ({"rules": ["embed"]}, "rules must be"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jaxstep.flax.shard_rule(_variables(), **kwargs)


def test_an_nnx_model_is_refused_with_what_to_do():
    with pytest.raises(TypeError, match=r"not a Linear.*write") as info:
        jaxstep.flax.shard_rule(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    assert "shard_rule=fn(path, shape)" in str(info.value)


# ------------------------------------------------------------------ with the step
def _has_shard_rule() -> bool:
    return "shard_rule" in inspect.signature(jaxstep.make_train_step).parameters


def _spec(axis: int | None, name: str) -> P:
    return P() if axis is None else P(*([None] * axis), name)


@pytest.mark.skipif(
    not _has_shard_rule(), reason="make_train_step(shard_rule=...) is not in this branch yet"
)
def test_the_rule_shards_what_flax_says():
    model = Mlp()
    variables = _variables(model)
    params, _ = jaxstep.flax.linen_split(variables)

    def loss(params, batch):
        out = model.apply({"params": params}, batch["x"])
        return jnp.mean((out - batch["y"]) ** 2)

    rule = jaxstep.flax.shard_rule(variables, rules=RULES)
    step = jaxstep.make_train_step(
        loss, optax.adam(1e-2), shard_state="params", shard_min_size=0, shard_rule=rule
    )
    state = step.init(params)
    name = step.options.axis_name
    specs = {
        jax.tree_util.keystr(p): x.sharding.spec
        for p, x in jax.tree_util.tree_leaves_with_path(state.params)
    }
    assert specs == {path: _spec(axis, name) for path, axis in AXES.items()}
    # Adam's moments are laid out as their parameters (count: whole)
    adam = state.opt_state[0]
    for moment in (adam.mu, adam.nu):
        assert jax.tree.map(lambda x: x.sharding.spec, moment) == jax.tree.map(
            lambda x: x.sharding.spec, state.params
        )
    assert adam.count.sharding.spec == P()
    # The default rule lays each leaf out otherwise, so the specs above are the rule's.
    default = jaxstep.make_train_step(
        loss, optax.adam(1e-2), shard_state="params", shard_min_size=0
    ).init(params)
    assert all(
        a.sharding.spec != b.sharding.spec
        for a, b in zip(jax.tree.leaves(default.params), jax.tree.leaves(state.params), strict=True)
    )

    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(32, 16)).astype(np.float32),
            "y": rng.normal(size=(32, 32)).astype(np.float32),
        }
        for _ in range(4)
    ]
    replicated = jaxstep.make_train_step(loss, optax.adam(1e-2))
    want = replicated.host_state(jaxstep.fit(replicated, replicated.init(params), batches))
    got = step.host_state(jaxstep.fit(step, state, batches))
    assert int(got.step) == int(want.step) == 4
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), got.params, params)
    assert min(jax.tree.leaves(moved)) > 1e-3  # it trained
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
        got.params,
        want.params,
    )
