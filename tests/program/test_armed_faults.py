"""A fault that has not fired changes nothing: a step built with faults armed for a
later step trains bit for bit as the same step without faults, under every layout
(the loss fault was applied inside the differentiated loss, which changed the
backward's arithmetic under shard_state="params": 3e-8 off after 4 steps)."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep.testing import Fault


class _CNN(nn.Module):
    """The linen MNIST example's shape, shrunk to 8x8 images."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        x = x.reshape(len(x), -1)
        return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


_MODEL = _CNN()


def _loss(params, batch):
    logits = _MODEL.apply({"params": params}, batch["image"])
    labels = jax.nn.one_hot(batch["label"], 10)
    return optax.softmax_cross_entropy(logits, labels).mean()


def _batches(n):
    rng = np.random.default_rng(0)
    return [
        {
            "image": rng.normal(size=(32, 8, 8, 1)).astype(np.float32),
            "label": rng.integers(0, 10, 32).astype(np.int32),
        }
        for _ in range(n)
    ]


def _final(step, params, batches):
    state = jaxstep.fit(step, step.init(params), batches, prefetch=0)
    return jax.tree.map(np.asarray, step.host_state(state).params)


@pytest.mark.parametrize(
    "backend, layout",
    [("shard_map", None), ("pmap", None), ("shard_map", "optimizer"), ("shard_map", "params")],
)
def test_faults_armed_for_a_later_step_leave_the_training_bit_for_bit(backend, layout):
    devices = jax.devices()
    params = _MODEL.init(jax.random.key(0), _batches(1)[0]["image"][:1])["params"]
    armed = [
        Fault("loss", devices[1].id, step=100),
        Fault("loss", devices[2].id, step=101, value=50.0),  # a spike
        Fault("grad", devices[3].id, step=102, leaf="['Dense_0']['kernel']"),
        Fault("input", devices[4].id, step=103, mode="data"),
    ]
    kw = {"backend": backend, "divergence_every": 2}
    if layout is not None:
        kw.update(shard_state=layout, shard_min_size=0)
    clean = _final(jaxstep.make_train_step(_loss, optax.adam(1e-2), **kw), params, _batches(4))
    faulty = _final(
        jaxstep.make_train_step(_loss, optax.adam(1e-2), faults=armed, **kw), params, _batches(4)
    )
    for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(faulty), strict=True):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("layout", [None, "params"])
def test_a_loss_fault_still_fails_its_device_with_a_non_finite_loss_and_gradient(layout):
    devices = jax.devices()
    params = _MODEL.init(jax.random.key(0), _batches(1)[0]["image"][:1])["params"]
    kw = {} if layout is None else {"shard_state": layout, "shard_min_size": 0}
    step = jaxstep.make_train_step(
        _loss, optax.adam(1e-2), faults=[Fault("loss", devices[5].id, step=1)], **kw
    )
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(params), _batches(3), diagnose=False)
    err = info.value
    assert (err.device_id, err.step) == (devices[5].id, 1)
    assert err.status & jaxstep.Status.LOSS_NONFINITE and err.status & jaxstep.Status.GRAD_NONFINITE
    assert [f.device_id for f in err.failures] == [devices[5].id]  # no healthy device blamed


@pytest.mark.parametrize("layout", [None, "optimizer", "params"])
@pytest.mark.parametrize("kind", ["loss", "input", "grad"])
def test_a_fault_that_fires_under_drop_leaves_its_device_out_at_a_replica_check(kind, layout):
    # under "params" a loss fault's NaN reached the scattered gradients when the step
    # also ran the replica check: the forward's verdict did not see the fault, so the
    # device was not left out and every parameter became NaN
    from tests.models import init_params
    from tests.models import loss_fn
    from tests.models import make_batches

    def run(layout, faults):
        step = jaxstep.make_train_step(
            loss_fn,
            optax.adam(1e-2),
            shard_state=layout,
            shard_min_size=0,
            on_failure="drop",
            divergence_every=1,
            faults=faults,
        )
        history = jaxstep.History()
        state = jaxstep.fit(step, step.init(init_params()), make_batches(3), history=history)
        return history, [np.asarray(x) for x in jax.tree.leaves(step.host_state(state).params)]

    leaf = {"leaf": "['x']"} if kind == "input" else {}
    history, got = run(layout, [Fault(kind, 6, step=1, mode="device", **leaf)])
    assert [bool(s.any()) for s in history.status] == [False, True, False]
    assert history.dropped[1] == (6,)
    _, want = run(None, [Fault(kind, 6, step=1, mode="device", **leaf)])
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
