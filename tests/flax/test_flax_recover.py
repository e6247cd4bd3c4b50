"""fit(..., recover=...) on the Flax examples' kind of model: BatchNorm statistics
(local, or across the devices as in examples/imagenet) and Dropout drawing from the
step's key. A bad device is excluded and a bad example quarantined, naming the device
that holds the fault, not the ones a collective in the model infected."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import traverse_util

import jaxstep
import jaxstep.flax
from jaxstep import Status
from jaxstep.testing import Fault

N = 8
PER_DEVICE = 4
BATCH = N * PER_DEVICE


class Net(nn.Module):
    """examples/imagenet's pattern in a few weights: a bias-free layer, BatchNorm
    (``axis_name="batch"``: statistics over the global batch), then Dropout."""

    axis_name: str | None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Dense(8, use_bias=False)(x)
        norm = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)
        x = nn.Dropout(0.2, deterministic=not train)(nn.relu(norm(x)))
        return nn.Dense(4)(x)


def _variables(model: Net) -> dict:
    """Weights drawn with numpy: XLA:CPU takes seconds to compile each initializer."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), np.ones((1, 6), np.float32))
    rng = np.random.default_rng(0)

    def one(path: tuple[str, ...], x: jax.ShapeDtypeStruct) -> np.ndarray:
        if path[-1] == "kernel":
            return (rng.normal(size=x.shape) / np.sqrt(x.shape[0])).astype(x.dtype)
        return (np.ones if path[-1] in ("scale", "var") else np.zeros)(x.shape, x.dtype)

    flat = traverse_util.flatten_dict(shapes)
    return traverse_util.unflatten_dict({p: one(p, x) for p, x in flat.items()})


def _batches(num: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [
        {
            "x": rng.normal(size=(BATCH, 6)).astype(np.float32),
            "y": rng.integers(0, 4, BATCH).astype(np.int32),
        }
        for _ in range(num)
    ]


def _fit(
    backend: str,
    axis_name: str | None,
    faults: list[Fault],
    batches: list,
    loss_spike: jaxstep.LossSpike | None = None,
    rollback_batches: int | None = None,
    **fit_kw,
):
    model = Net(axis_name)

    def loss_fn(params, batch, rng, *, model_state):
        logits, model_state = jaxstep.flax.linen_apply(
            model, params, model_state, batch["x"], rng=rng, train=True
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"model_state": model_state}

    step = jaxstep.make_train_step(
        loss_fn,
        optax.sgd(0.1),
        has_aux=True,
        axis_name="batch",
        backend=backend,
        faults=faults,
        loss_spike=loss_spike,
    )
    params, model_state = jaxstep.flax.linen_split(_variables(model))
    state = step.init(params, model_state=model_state, rng=jax.random.key(1))
    history = jaxstep.History()
    recover = jaxstep.Recover(rollback_batches=rollback_batches)
    state = jaxstep.fit(step, state, batches, history=history, recover=recover, **fit_kw)
    return step, state, history


def _finite(tree) -> bool:
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("axis_name", ["batch", None])
def test_a_bad_device_is_excluded_with_dropout_and_batchnorm(backend, axis_name):
    # Dropout draws from the step's key: the replay that moves the chunks moves their
    # keys too, so the failure staying on device 5 is the device's (it was
    # "inconclusive"). With cross-device BatchNorm the NaN device 5 reads reaches every
    # device's loss through the statistics' collective: only device 5 goes. (An input
    # fault, which runs through the forward pass; a loss fault multiplies what the
    # differentiation returned, so it stays on its device.)
    bad = jax.devices()[5].id
    step, state, history = _fit(
        backend, axis_name, [Fault("input", bad, step=2, mode="device")], _batches(4)
    )
    (record,) = history.recoveries
    assert (record.step, record.verdict, record.action) == (2, "device", "excluded")
    assert record.device_ids == (bad,)
    assert Status.INPUT_NONFINITE in Status(int(history.status[2][5]))
    spread = [int(s) != 0 for s in history.status[2]]
    assert spread == ([True] * N if axis_name else [i == 5 for i in range(N)])
    assert [d.id for d in step.devices] == [d.id for d in jax.devices() if d.id != bad]
    assert history.step[:4] == [0, 1, 2, 2]  # the failed step, then again on 7 devices
    jaxstep.testing.assert_replicas_equal(step, state)
    assert _finite(step.host_state(state).model_state)


def test_a_bad_example_under_cross_device_batchnorm_is_quarantined_and_its_step_skipped(
    backend, tmp_path
):
    # The NaN example on device 3 reaches every device through the BatchNorm
    # statistics: leaving chunk 3 out of the mean cannot save the step. The record
    # names device 3 and says the batch was skipped (it said "left out of the mean").
    dev3 = jax.devices()[3].id
    step, state, history = _fit(
        backend,
        "batch",
        [Fault("input", dev3, step=2, mode="data", example=1)],
        _batches(4),
        checkpoint_dir=tmp_path,
    )
    (record,) = history.recoveries
    assert (record.step, record.verdict, record.action) == (2, "data", "quarantined")
    assert record.device_ids == (dev3,)
    assert record.examples == (3 * PER_DEVICE + 1,)
    assert record.skipped_batches == (2,)
    assert "every device failed" in record.detail and "not trained" in record.detail
    assert history.step == [0, 1, 2, 2, 3]
    assert history.skipped[3] and not history.skipped[4]  # the rerun trained nothing
    assert jaxstep.read_quarantine(tmp_path) == {2: (3 * PER_DEVICE + 1,)}
    assert int(step.host_state(state).step) == 4
    assert _finite(step.host_state(state).model_state)


def test_a_bad_example_under_local_batchnorm_is_quarantined_and_the_rest_trained(backend, tmp_path):
    dev3 = jax.devices()[3].id
    step, state, history = _fit(
        backend,
        None,
        [Fault("input", dev3, step=2, mode="data", example=1)],
        _batches(4),
        checkpoint_dir=tmp_path,
    )
    (record,) = history.recoveries
    assert (record.verdict, record.action, record.device_ids) == ("data", "quarantined", (dev3,))
    assert record.skipped_batches == ()
    assert history.step == [0, 1, 2, 2, 3]
    assert not history.skipped[3] and history.dropped[3] == (dev3,)  # the others trained
    assert _finite(step.host_state(state).model_state)


def test_a_loss_spike_rolls_back_the_batchnorm_statistics_with_the_parameters(backend, tmp_path):
    # A finite loss fault is a spike. Transient: the steps after the rollback come
    # round again, and a fault fires by step number.
    bad = jax.devices()[6].id
    batches = _batches(9)
    spike = jaxstep.LossSpike(window=8, warmup=3, sigmas=6.0)
    step, state, history = _fit(
        backend,
        "batch",
        [Fault("loss", bad, step=6, mode="transient", value=100.0)],
        batches,
        loss_spike=spike,
        checkpoint_dir=tmp_path,
        checkpoint_every=4,
        rollback_batches=1,
    )
    (record,) = history.recoveries
    assert (record.step, record.verdict, record.action) == (6, "spike", "rolled back")
    assert record.device_ids == (bad,) and record.skipped_batches == (6,)
    assert Status(int(history.status[6][6])) == Status.LOSS_SPIKE
    assert history.step == [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7]
    # from the checkpoint of step 4, batches 4, 5, 7, 8: the run without batch 6, the
    # same dropout keys (step numbers) and the statistics restored with the weights
    clean, clean_state, _ = _fit(backend, "batch", [], batches[:6] + batches[7:])
    got, want = step.host_state(state), clean.host_state(clean_state)
    for a, b in [(got.params, want.params), (got.model_state, want.model_state)]:
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)


V = 16  # the vocabulary


class TokenLM(nn.Module):
    """examples/lm1b's pattern in a few weights: a shared embedding, Dropout, logits
    by attending to the embedding."""

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(V, 8)
        x = nn.Dropout(0.1, deterministic=False)(embed(tokens))
        return embed.attend(nn.Dense(8)(x))


def _token_step(backend: str, faults: list[Fault]):
    model = TokenLM()

    def loss_fn(params, batch, rng):
        tokens = batch["tokens"]
        logits = model.apply({"params": params}, tokens, rngs={"dropout": rng})
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
        mask = (tokens > 0).astype(xent.dtype)
        return jaxstep.WeightedLoss(jnp.sum(xent * mask), jnp.sum(mask))

    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend, faults=faults)
    shapes = jax.eval_shape(model.init, jax.random.key(0), np.ones((1, 5), np.int32))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(x.dtype), shapes)["params"]
    return step, step.init(params, rng=jax.random.key(1))


def _tokens(num: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(2)
    return [{"tokens": rng.integers(0, V, (BATCH, 5)).astype(np.int32)} for _ in range(num)]


def test_a_token_past_the_vocabulary_is_quarantined_in_a_token_model(backend, tmp_path):
    # Token ids have no float leaf for an "input" fault: refused at the first batch,
    # saying what to plant instead.
    dev3 = jax.devices()[3].id
    step, state = _token_step(backend, [Fault("input", dev3, step=2)])
    with pytest.raises(ValueError, match=r"has none \(token ids\?\).*Fault\('loss'"):
        step(state, _tokens(1)[0])
    # A real bad record: nn.Embed fills NaN for an id past the vocabulary.
    batches = _tokens(4)
    batches[2]["tokens"][3 * PER_DEVICE + 1, 2] = V + 3
    step, state = _token_step(backend, [])
    history = jaxstep.History()
    jaxstep.fit(
        step, state, batches, history=history, recover=jaxstep.Recover(), checkpoint_dir=tmp_path
    )
    (record,) = history.recoveries
    assert (record.step, record.verdict, record.action) == (2, "data", "quarantined")
    assert record.device_ids == (dev3,) and record.examples == (3 * PER_DEVICE + 1,)
    assert Status(int(history.status[2][3])) & Status.LOSS_NONFINITE
    assert history.dropped[3] == (dev3,) and not history.skipped[3]
    assert jaxstep.read_quarantine(tmp_path) == {2: (3 * PER_DEVICE + 1,)}
