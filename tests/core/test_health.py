"""The gradient and input checks name the first non-finite leaf, whether the leaf is
large (its own reduction) or small (one reduction shared with the other small
leaves)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep._src.core.health import SHARED_BELOW
from jaxstep._src.core.health import gradient_health
from tests.models import make_batches
from tests.models import poison_grad
from tests.models import rows_of

# index 0 is an integer leaf (never looked at); 1 and 3 are large, 2 and 4 small
SHAPES = [(3,), (2, SHARED_BELOW // 2 + 1), (8,), (SHARED_BELOW + 1,), (2, 3)]


def _leaves(shapes: list[tuple[int, ...]], bad: dict[int, float]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    leaves = [np.arange(3, dtype=np.int32)]
    leaves += [rng.normal(size=s).astype(np.float32) for s in shapes[1:]]
    for i, value in bad.items():
        leaves[i].reshape(-1)[-1] = value  # the last element: the end of its reduction
    return leaves


def _sum_of_squares(leaves: list[np.ndarray]) -> float:
    return sum(float(np.sum(x.astype(np.float64) ** 2)) for x in leaves[1:])


@pytest.mark.parametrize(
    "bad,first",
    [
        ({}, -1),
        ({1: np.nan}, 1),
        ({2: np.inf}, 2),
        ({3: -np.inf}, 3),
        ({4: np.nan}, 4),
        ({2: np.nan, 3: np.nan}, 2),
        ({3: np.inf, 4: np.nan}, 3),
        ({1: np.inf, 4: np.inf}, 1),
        ({2: np.nan, 4: np.inf}, 2),
        ({4: 1e20}, 4),  # a square that overflows float32
        ({3: 1e20}, 3),
    ],
)
def test_first_nonfinite_gradient_leaf_across_large_and_small_leaves(bad, first):
    leaves = _leaves(SHAPES, bad)
    total, leaf, input_leaf = jax.jit(gradient_health)(leaves)
    assert int(leaf) == first
    assert int(input_leaf) == -1
    if first < 0:
        assert float(total) == pytest.approx(_sum_of_squares(leaves), rel=1e-5)
    else:
        assert not np.isfinite(float(total))


# the inputs of a step: integer labels, a large and two small float leaves
INPUTS = [(3,), (SHARED_BELOW + 1,), (4, 3), (5,)]


@pytest.mark.parametrize(
    "bad,first",
    [({}, -1), ({1: np.nan}, 1), ({2: np.inf}, 2), ({3: np.nan}, 3), ({1: np.nan, 3: np.inf}, 1)],
)
@pytest.mark.parametrize("grad_bad", [{}, {2: np.nan}])
def test_inputs_are_checked_in_the_same_reduction_apart_from_the_gradients(bad, first, grad_bad):
    grads, inputs = _leaves(SHAPES, grad_bad), _leaves(INPUTS, bad)
    total, leaf, input_leaf = jax.jit(gradient_health)(grads, inputs)
    assert int(input_leaf) == first
    assert int(leaf) == (2 if grad_bad else -1)
    if not grad_bad:  # a bad input alone leaves the gradients' norm alone
        assert float(total) == pytest.approx(_sum_of_squares(grads), rel=1e-5)


def _wide(leaves: list[np.ndarray]) -> list[np.ndarray]:
    return [x.astype(np.float64) if x.dtype == np.float32 else x for x in leaves]


def test_float64_leaves_under_x64_are_checked_in_float32():
    with jax.enable_x64(True):
        grads, inputs = _wide(_leaves(SHAPES, {4: np.nan})), _wide(_leaves(INPUTS, {3: np.inf}))
        total, leaf, input_leaf = jax.jit(gradient_health)(grads, inputs)
        assert total.dtype == np.float32
    assert (int(leaf), int(input_leaf)) == (4, 3)


def test_no_float_leaves_is_a_finite_zero():
    total, leaf, input_leaf = gradient_health([np.arange(3, dtype=np.int32)])
    assert float(total) == 0.0 and int(leaf) == -1 and int(input_leaf) == -1


def _loss(params, batch):
    big = poison_grad(params["big"], jnp.any(batch["poison"] > 0))
    h = jnp.tanh(batch["x"] @ big).mean(-1, keepdims=True)
    return jnp.mean((h + params["small"] - batch["y"]) ** 2)


def test_infinite_gradient_in_a_large_leaf_is_named(backend):
    params = {
        "big": np.random.default_rng(0).normal(0, 0.1, (3, SHARED_BELOW)).astype(np.float32),
        "small": np.zeros(1, np.float32),
    }
    batches = make_batches(4)
    batches[2]["poison"][rows_of(5)] = 1.0
    step = jaxstep.make_train_step(_loss, optax.sgd(0.1), backend=backend)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(params), batches)
    err = info.value
    assert err.device_id == jax.devices()[5].id
    assert err.step == 2
    assert err.status == Status.GRAD_NONFINITE
    assert err.leaf == "['big']"
    assert [f.device_id for f in err.failures] == [jax.devices()[5].id]
