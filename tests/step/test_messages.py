"""What a new user met first: batch errors that name the leaf and the fix, before
anything runs (and the state stays usable)."""

import numpy as np
import optax
import pytest

import jaxstep
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches


@pytest.fixture(scope="module")
def step():
    return jaxstep.make_train_step(loss_fn, optax.sgd(0.1), divergence_every=None)


@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda b: {k: v[:4] for k, v in b.items()}, ValueError,
         "batch leading axis 4 does not divide by the 8 devices; each device needs at least "
         "one example: use 8 or another multiple of 8"),
        (lambda b: {k: v[:12] for k, v in b.items()}, ValueError,
         "use a multiple of 8 (e.g. 8 or 16) or drop the last partial batch"),
        (lambda b: dict(b, name=np.array(["a"] * 32)), TypeError,
         "batch leaf ['name'] has dtype <U1, which devices cannot hold; encode strings"),
        (lambda b: dict(b, name=np.array([b"a"] * 32)), TypeError,
         "batch leaf ['name'] has dtype |S1"),
        (lambda b: dict(b, name=np.array([object()] * 32)), TypeError,
         "batch leaf ['name'] has dtype object"),
        (lambda b: dict(b, name="cat"), TypeError,
         "batch leaf ['name'] is a str ('cat'); devices take numbers"),
        (lambda b: dict(b, name=b"cat"), TypeError, "batch leaf ['name'] is a bytes"),
        (lambda b: dict(b, pos=0.5), ValueError,
         "batch leaf ['pos'] is a scalar (a Python float); every batch leaf needs a leading "
         "example axis that is split across the devices: give one value per example "
         "(e.g. np.full(batch_size, 0.5))"),
    ],
)  # fmt: skip
def test_bad_batch_names_the_leaf_and_the_fix(step, change, error, words):
    state = step.init(init_params())
    batch = make_batches(1)[0]
    with pytest.raises(error) as info:
        step(state, change(batch))
    assert words in str(info.value)
    assert "np.asarray" not in str(info.value)  # which led to the scalar-leaf error
    state, out = step(state, batch)  # nothing was lost
    assert np.isfinite(float(np.asarray(out.metrics["loss"]).reshape(-1)[0]))
