"""The models of the official Flax examples (mnist, imagenet, the NNX mnist tutorial),
shrunk, trained a few steps with jaxstep on 8 fake devices: model state, collectives
inside the model, RNNs, fp16 loss scaling, micro-batches and pre-split batches.

Models are tiny (8x8 images, a few channels) so that each test compiles in seconds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax import traverse_util

import jaxstep
import jaxstep.flax
from jaxstep import Status
from jaxstep._src.step import runtime_of
from tests.models import init_params as mlp_params
from tests.models import loss_fn as mlp_loss

N = 8  # devices
PER_DEVICE = 4
BATCH = N * PER_DEVICE


def _rows(position: int, per_device: int = PER_DEVICE) -> slice:
    return slice(position * per_device, (position + 1) * per_device)


def _images(num: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.normal(size=(BATCH, 8, 8, 1)).astype(np.float32),
            "label": rng.integers(0, 10, BATCH).astype(np.int32),
        }
        for _ in range(num)
    ]


def _repeat(batch: dict[str, np.ndarray], num: int) -> list[dict[str, np.ndarray]]:
    return [{k: v.copy() for k, v in batch.items()} for _ in range(num)]


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _replicas(step, tree) -> list:
    """Each device's own copy of ``tree`` (numpy), in the step's device order."""
    return [runtime_of(step).read_at(tree, i) for i in range(len(step.devices))]


def _assert_tree_close(a, b, **kw) -> None:
    jax.tree.map(functools.partial(np.testing.assert_allclose, **kw), a, b)


# --------------------------------------------------------------------------- models
class MnistCNN(nn.Module):
    """examples/mnist's linen CNN: conv-relu-pool twice, then two dense layers."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.avg_pool(nn.relu(nn.Conv(4, (3, 3))(x)), (2, 2), strides=(2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(8, (3, 3))(x)), (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(10)(nn.relu(nn.Dense(16)(x)))


class ImagenetCNN(nn.Module):
    """The stem of examples/imagenet's ResNet: bias-free convs, BatchNorm with
    ``axis_name`` (cross-device statistics), then Dropout before the head."""

    axis_name: str | None = "batch"

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            axis_name=self.axis_name,
        )
        x = nn.Conv(4, (3, 3), use_bias=False, name="conv_init")(x)
        x = nn.max_pool(nn.relu(norm(name="bn_init")(x)), (2, 2), strides=(2, 2))
        x = nn.relu(norm(name="bn1")(nn.Conv(8, (3, 3), use_bias=False, name="conv1")(x)))
        x = nn.Dropout(0.2, deterministic=not train)(jnp.mean(x, axis=(1, 2)))
        return nn.Dense(10, name="head")(x)


def _fill(shapes, seed: int = 0):
    """Values for a tree of shapes keyed by module path, drawn with numpy: XLA:CPU
    takes seconds to compile each random initializer, and nothing tested here depends
    on how the weights were drawn."""
    rng = np.random.default_rng(seed)

    def one(path, x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key(seed)
        if path[-1] == "kernel":
            return (rng.normal(size=x.shape) / np.sqrt(np.prod(x.shape[:-1]))).astype(x.dtype)
        return (np.ones if path[-1] in ("scale", "var") else np.zeros)(x.shape, x.dtype)

    flat = traverse_util.flatten_dict(shapes)
    return traverse_util.unflatten_dict({p: jnp.asarray(one(p, x)) for p, x in flat.items()})


def _linen_variables(model: nn.Module, x: jax.Array) -> dict:
    return _fill(jax.eval_shape(model.init, jax.random.key(0), x))


def _linen_init(model: nn.Module):
    return jaxstep.flax.linen_split(_linen_variables(model, jnp.ones((1, 8, 8, 1))))


def _imagenet_loss(model: ImagenetCNN):
    def loss_fn(params, batch, rng, *, model_state):
        logits, model_state = jaxstep.flax.linen_apply(
            model, params, model_state, batch["image"], rng=rng, train=True
        )
        return _xent(logits, batch["label"]), {"model_state": model_state}

    return loss_fn


class Energy(nnx.Variable):
    """A statistic the model keeps about its input: state, not a parameter."""


class InputMonitor(nnx.Module):
    """Records the largest energy of a raw input, then clips the input (a common
    guard): an outlier that stays finite overflows the statistic, not the loss."""

    def __init__(self) -> None:
        self.energy = Energy(jnp.zeros((), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        energy = jnp.max(jnp.sum(jnp.square(jax.lax.stop_gradient(x)), axis=(1, 2, 3)))
        self.energy[...] = jnp.maximum(self.energy[...], energy)
        return jnp.clip(x, -5.0, 5.0)


class NNXCNN(nnx.Module):
    """The NNX mnist tutorial's CNN (conv, BatchNorm, Dropout, two linear layers),
    shrunk to one conv block: compile time is what these tests pay for."""

    def __init__(self, *, rngs: nnx.Rngs, axis_name: str | None = "batch") -> None:
        self.monitor = InputMonitor()
        self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(4, axis_name=axis_name, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.1, rngs=rngs)
        self.linear1 = nnx.Linear(4 * 4 * 4, 16, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.1, rngs=rngs)
        self.linear2 = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        x = self.monitor(x)
        x = pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
        x = nnx.relu(self.dropout2(self.linear1(x.reshape(x.shape[0], -1))))
        return self.linear2(x)


def _nnx_model(axis_name: str | None = "batch") -> NNXCNN:
    """``NNXCNN(rngs=nnx.Rngs(0), axis_name=...)``, its weights drawn by :func:`_fill`."""
    graphdef, state = nnx.split(
        nnx.eval_shape(lambda: NNXCNN(rngs=nnx.Rngs(0), axis_name=axis_name))
    )
    nnx.replace_by_pure_dict(state, _fill(nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


def _nnx_loss(model: nnx.Module, batch):
    logits = model(batch["image"])
    return _xent(logits, batch["label"]), {
        "accuracy": jnp.mean(logits.argmax(-1) == batch["label"])
    }


# ------------------------------------------------------- jaxstep.flax on its own
def _names(tree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def test_nnx_split_names_leaves_by_module_path():
    graph, params, model_state = jaxstep.flax.nnx_split(_nnx_model(axis_name=None))
    assert "['linear2']['kernel']" in _names(params)
    assert "['batch_norm1']['scale']" in _names(params)
    assert _names(model_state) == [
        "['batch_norm1']['mean']",
        "['batch_norm1']['var']",
        "['monitor']['energy']",
    ]
    assert graph.streams == ["['dropout1']['rngs']", "['dropout2']['rngs']"]


def test_nnx_loss_fn_runs_the_module_and_returns_its_new_state():
    model = _nnx_model(axis_name=None)
    graph, params, model_state = jaxstep.flax.nnx_split(model)
    batch = _images(1)[0]
    loss_fn = jax.jit(jaxstep.flax.nnx_loss_fn(graph, _nnx_loss, has_aux=True))
    loss, aux = loss_fn(params, batch, jax.random.key(1), model_state=model_state)
    again, _ = loss_fn(params, batch, jax.random.key(1), model_state=model_state)
    other, _ = loss_fn(params, batch, jax.random.key(2), model_state=model_state)
    assert float(loss) == float(again) != float(other)  # dropout follows the key
    assert set(aux) == {"accuracy", "model_state"}
    assert jax.tree.structure(aux["model_state"]) == jax.tree.structure(model_state)
    np.testing.assert_allclose(  # the monitor saw the batch's largest energy
        aux["model_state"]["monitor"]["energy"],
        np.max(np.sum(batch["image"] ** 2, axis=(1, 2, 3))),
        rtol=1e-6,
    )
    # the trained halves rebuild the module (eval mode: running statistics)
    trained = jaxstep.flax.nnx_merge(graph, params, aux["model_state"])
    np.testing.assert_array_equal(
        trained.batch_norm1.mean[...], aux["model_state"]["batch_norm1"]["mean"]
    )
    trained.eval()  # shapes only: an eager forward pass compiles op by op
    assert nnx.eval_shape(lambda m, x: m(x), trained, batch["image"]).shape == (BATCH, 10)


def test_nnx_loss_fn_without_a_key_rejects_a_module_that_draws():
    model = _nnx_model(axis_name=None)
    graph, params, model_state = jaxstep.flax.nnx_split(model)
    batch = _images(1)[0]
    loss_fn = jaxstep.flax.nnx_loss_fn(graph, _nnx_loss, has_aux=True)
    with pytest.raises(ValueError, match=r"\['dropout1'\]\['rngs'\].*rng=jax.random.key"):
        jax.jit(loss_fn)(params, batch, model_state=model_state)
    with pytest.raises(ValueError, match="model_state=model_state"):
        jax.jit(loss_fn)(params, batch, jax.random.key(0))
    model.eval()  # deterministic: no key needed
    graph, params, model_state = jaxstep.flax.nnx_split(model)
    loss_fn = jaxstep.flax.nnx_loss_fn(graph, _nnx_loss, has_aux=True)
    loss, _ = jax.eval_shape(functools.partial(loss_fn, model_state=model_state), params, batch)
    assert loss.shape == ()


def test_nnx_loss_fn_passes_rngs_to_a_module_that_takes_them_at_call_time():
    class Tutorial(nnx.Module):  # the tutorial's style: model(x, rngs)
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(4, 2, rngs=rngs)
            self.dropout = nnx.Dropout(0.5)

        def __call__(self, x: jax.Array, rngs: nnx.Rngs) -> jax.Array:
            return self.dropout(self.linear(x), rngs=rngs)

    graph, params, model_state = jaxstep.flax.nnx_split(Tutorial(nnx.Rngs(0)))
    assert model_state == {}
    loss_fn = jaxstep.flax.nnx_loss_fn(
        graph, lambda m, b, rngs: jnp.sum(m(b, rngs) ** 2), pass_rngs=True
    )
    x = jnp.ones((16, 4))
    draws = {float(loss_fn(params, x, jax.random.key(k))[0]) for k in range(3)}
    assert len(draws) == 3
    with pytest.raises(ValueError, match="pass_rngs=True"):
        loss_fn(params, x)


def test_nnx_loss_fn_carries_only_the_state_the_module_had_at_split():
    class Sows(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(3, 2, rngs=rngs)
            self.bn = nnx.BatchNorm(2, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            h = self.linear(x)
            self.sow(nnx.Intermediate, "h", h)  # created while running: not state
            return self.bn(h)

    graph, params, model_state = jaxstep.flax.nnx_split(Sows(nnx.Rngs(0)))
    loss_fn = jaxstep.flax.nnx_loss_fn(graph, lambda m, x: jnp.sum(m(x)))
    _, aux = jax.eval_shape(  # shapes only: nothing to compile
        functools.partial(loss_fn, model_state=model_state), params, jnp.ones((4, 3))
    )
    assert _names(aux["model_state"]) == _names(model_state) == ["['bn']['mean']", "['bn']['var']"]


def test_linen_helpers_split_apply_and_merge():
    model = ImagenetCNN(axis_name=None)
    params, model_state = _linen_init(model)
    assert set(model_state) == {"batch_stats"}
    assert "['bn1']['mean']" in _names(model_state["batch_stats"])
    x = _images(1)[0]["image"]
    logits, new_state = jaxstep.flax.linen_apply(
        model, params, model_state, x, rng=jax.random.key(0), train=True
    )
    assert logits.shape == (BATCH, 10)
    assert jax.tree.structure(new_state) == jax.tree.structure(model_state)
    mean = np.asarray(new_state["batch_stats"]["bn_init"]["mean"])
    assert not np.array_equal(mean, model_state["batch_stats"]["bn_init"]["mean"])
    eval_logits = model.apply(jaxstep.flax.linen_merge(params, new_state), x, train=False)
    assert np.all(np.isfinite(eval_logits))


def test_logically_partitioned_params_are_unboxed_and_faults_named_without_value(backend):
    """lm1b/wmt/gemma declare their weights with nn.with_logical_partitioning: the
    boxes come off in linen_split, so leaves are named as in a plain model."""
    boxed = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.relu(nn.Dense(8, kernel_init=boxed, name="mlp")(x.reshape(len(x), -1)))
            return nn.Dense(10, name="head")(x)

    model = Mlp()
    variables = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8, 8, 1)))
    assert "['params']['mlp']['kernel'].value" in _names(variables)  # boxed
    params, model_state = jaxstep.flax.linen_split(variables)
    assert _names(params) == [
        "['head']['bias']",
        "['head']['kernel']",
        "['mlp']['bias']",
        "['mlp']['kernel']",
    ]
    assert model_state == {}
    dev2 = jax.devices()[2].id

    def loss_fn(params, batch):
        return _xent(model.apply({"params": params}, batch["image"]), batch["label"])

    step = jaxstep.make_train_step(
        loss_fn,
        optax.adam(1e-2),
        backend=backend,
        faults=[jaxstep.testing.Fault("grad", dev2, step=1, leaf="['mlp']['kernel']")],
    )
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(params), _images(3))
    jaxstep.testing.assert_fails(
        info, device_id=dev2, step=1, status=Status.GRAD_NONFINITE, leaf="['mlp']['kernel']"
    )


# ------------------------------------------------------------------ linen models
@functools.cache
def _mnist_step(backend):
    """The mnist example's model, loss and step; shared by the tests that use it (each
    starts from its own ``step.init``), so it compiles once per backend."""
    model = MnistCNN()
    params = _linen_variables(model, jnp.ones((1, 8, 8, 1)))["params"]

    def loss_fn(params, batch):
        return _xent(model.apply({"params": params}, batch["image"]), batch["label"])

    step = jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), backend=backend, divergence_every=None
    )
    return step, params


def test_linen_mnist_cnn_trains(backend):
    step, params = _mnist_step(backend)
    history = jaxstep.History()
    jaxstep.fit(step, step.init(params), _repeat(_images(1)[0], 4), history=history)
    assert len(history) == 4
    assert history.loss[-1] < history.loss[0]


@functools.cache
def _imagenet_step(backend, axis_name):
    """The imagenet-style model, its variables and its step, shared by the tests that
    use them (each starts from its own ``step.init``): one compile per kind."""
    model = ImagenetCNN(axis_name=axis_name)
    params, model_state = _linen_init(model)
    step = jaxstep.make_train_step(
        _imagenet_loss(model),
        optax.sgd(0.1),
        has_aux=True,
        axis_name="batch",
        backend=backend,
        divergence_every=None,
    )
    return step, params, model_state


@jax.jit
def _batch_stats_by_hand(variables, images):
    """New BatchNorm statistics of the imagenet-style model run on ``images`` alone, on
    one device (dropout comes after every BatchNorm, so its key does not matter)."""
    _, new = ImagenetCNN(axis_name=None).apply(
        variables, images, train=True, mutable=["batch_stats"], rngs={"dropout": jax.random.key(0)}
    )
    return new


def test_cross_device_batchnorm_keeps_the_global_batch_statistics_on_every_replica(backend):
    step, params, model_state = _imagenet_step(backend, "batch")
    state = step.init(params, model_state=model_state, rng=jax.random.key(1))
    batch = _images(1)[0]
    state, out = step(state, batch)
    assert not np.any(step.table(out).status)
    # By hand: the same network on the whole global batch on one device.
    want = _batch_stats_by_hand({"params": params, **model_state}, batch["image"])
    copies = _replicas(step, state.model_state)
    for copy in copies:
        _assert_tree_close(copy, want, rtol=1e-5, atol=1e-6)
    for copy in copies[1:]:
        jax.tree.map(np.testing.assert_array_equal, copy, copies[0])


def test_local_batchnorm_statistics_are_averaged_across_devices(backend):
    # each device normalises with its own rows
    step, params, model_state = _imagenet_step(backend, None)
    state = step.init(params, model_state=model_state, rng=jax.random.key(1))
    batch = _images(1)[0]
    state, out = step(state, batch)
    assert not np.any(step.table(out).status)
    # By hand: each device's statistics from its own chunk, then their mean.
    variables = {"params": params, **model_state}
    per_device = [_batch_stats_by_hand(variables, batch["image"][_rows(i)]) for i in range(N)]
    want = jax.tree.map(lambda *xs: np.mean(np.stack(xs), axis=0), *per_device)
    for copy in _replicas(step, state.model_state):
        _assert_tree_close(copy, want, rtol=1e-5, atol=1e-6)
    # and they differ from device to device, so the average is not trivial
    assert not np.allclose(
        per_device[0]["batch_stats"]["bn1"]["var"], per_device[1]["batch_stats"]["bn1"]["var"]
    )


def test_nan_in_one_devices_rows_is_blamed_on_that_device_though_batchnorm_spreads_it(backend):
    step, params, model_state = _imagenet_step(backend, "batch")
    state = step.init(params, model_state=model_state, rng=jax.random.key(1))
    batches = _images(3)
    bad_row = _rows(3).start + 1
    batches[2]["image"][bad_row, 4, 4, 0] = np.nan
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, batches, diagnose=True)
    err = info.value
    dev3 = jax.devices()[3]
    # The cross-device statistics carry the NaN into every device's loss ...
    assert {f.device_id for f in err.failures} == {d.id for d in jax.devices()}
    assert all(Status.LOSS_NONFINITE in f.status for f in err.failures)
    # ... but the error leads with the root cause: device 3's input.
    assert err.device_id == dev3.id
    assert err.step == 2
    assert Status.INPUT_NONFINITE in err.status
    assert err.leaf == "['image']"
    assert [f.device_id for f in err.failures if Status.INPUT_NONFINITE in f.status] == [dev3.id]
    assert str(err).startswith(f"training worker on device {dev3.id} failed: non-finite input")
    assert err.diagnosis.verdict == "data"
    assert err.diagnosis.examples == (bad_row,)
    # the last good state holds finite statistics
    for leaf in jax.tree.leaves(step.host_state(err.state).model_state):
        assert np.all(np.isfinite(np.asarray(leaf)))


# ------------------------------------------------------------------------- NNX
def test_nnx_cnn_trains_and_faults_are_named_by_module_path(backend):
    devices = jax.devices()
    graph, params, model_state = jaxstep.flax.nnx_split(_nnx_model())
    step = jaxstep.make_train_step(
        jaxstep.flax.nnx_loss_fn(graph, _nnx_loss, has_aux=True),
        optax.adam(1e-2),
        has_aux=True,
        axis_name="batch",
        backend=backend,
        divergence_every=None,
        faults=[jaxstep.testing.Fault("grad", devices[2].id, step=4, leaf="['linear2']['kernel']")],
    )
    state = step.init(params, model_state=model_state, rng=jax.random.key(0))
    batches = _repeat(_images(1)[0], 5)
    # step 4: a finite outlier on device 5 overflows the monitor's statistic only
    batches[4]["image"][_rows(5).start + 2, 0, 0, 0] = 1e20
    history = jaxstep.History()
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, batches, history=history)
    err = info.value
    assert history.loss[3] < history.loss[0]  # it trained for four steps
    assert err.step == 4
    assert {f.device_id: f.leaf for f in err.failures} == {
        devices[2].id: "['linear2']['kernel']",
        devices[5].id: "model_state['monitor']['energy']",
    }
    # the trained halves rebuild the module
    host = step.host_state(err.state)
    model = jaxstep.flax.nnx_merge(graph, host.params, host.model_state)
    np.testing.assert_array_equal(
        model.batch_norm1.var[...], host.model_state["batch_norm1"]["var"]
    )


# ------------------------------------------------------------ RNNs and scans
class LSTMRegressor(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(1)(nn.RNN(nn.LSTMCell(8))(x)[:, -1])


def _sequences(num: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    out = []
    for _ in range(num):
        x = rng.normal(size=(BATCH, 5, 3)).astype(np.float32)
        out.append({"x": x, "y": np.tanh(x.sum(axis=(1, 2)))[:, None].astype(np.float32)})
    return out


def _train_on_both_backends(loss_fn, params, batches):
    result = {}
    for backend in ("shard_map", "pmap"):
        step = jaxstep.make_train_step(
            loss_fn, optax.adam(1e-2), backend=backend, divergence_every=None
        )
        history = jaxstep.History()
        state = jaxstep.fit(step, step.init(params), batches, history=history)
        result[backend] = (jax.tree.map(np.asarray, step.host_state(state).params), history)
    return result


def test_stock_lstm_trains_on_shard_map_as_on_one_device():
    model = LSTMRegressor()
    params = _linen_variables(model, jnp.ones((1, 5, 3)))["params"]
    opt = optax.adam(1e-2)

    def loss_fn(params, batch):
        return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    batches = _repeat(_sequences(1)[0], 3)
    step = jaxstep.make_train_step(loss_fn, opt, divergence_every=None)  # shard_map
    history = jaxstep.History()
    state = jaxstep.fit(step, step.init(params), batches, history=history)

    @jax.jit
    def by_hand(params, opt_state, batch):  # the whole global batch on one device
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    want, opt_state, losses = params, opt.init(params), []
    for batch in batches:
        want, opt_state, loss = by_hand(want, opt_state, batch)
        losses.append(float(loss))
    assert history.loss[-1] < history.loss[0]
    np.testing.assert_allclose(history.loss, losses, rtol=1e-5)
    _assert_tree_close(step.host_state(state).params, want, rtol=1e-5, atol=1e-6)


def test_scan_from_a_constant_carry_in_loss_fn_trains_as_under_pmap():
    def loss_fn(params, batch):
        def body(total, xy):
            x, y = xy
            return total + jnp.sum((x @ params["w"] - y) ** 2), None

        xs = (jnp.swapaxes(batch["x"], 0, 1), jnp.swapaxes(batch["y"], 0, 1))
        total, _ = jax.lax.scan(body, jnp.zeros(()), xs)  # the carry starts as a constant
        return total / batch["x"].size

    rng = np.random.default_rng(4)
    x = rng.normal(size=(BATCH, 5, 3)).astype(np.float32)
    batch = {"x": x, "y": x @ np.array([[1.0], [-2.0], [0.5]], np.float32)}
    result = _train_on_both_backends(
        loss_fn, {"w": np.zeros((3, 1), np.float32)}, _repeat(batch, 3)
    )
    params_sm, history_sm = result["shard_map"]
    params_pm, _ = result["pmap"]
    assert history_sm.loss[-1] < history_sm.loss[0]
    _assert_tree_close(params_sm, params_pm, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------- fp16 loss scaling
def _fp16_loss(params, batch):
    # fp16 compute, float32 loss: the backward pass overflows fp16 first.
    pred = batch["x"].astype(jnp.float16) @ params["w"].astype(jnp.float16)
    return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)


def _fp16_batches(num: int, overflow: dict[int, list[int]]) -> list[dict[str, np.ndarray]]:
    """Well-scaled batches; at step s, the devices in ``overflow[s]`` get rows whose
    scaled gradient is far beyond fp16's 65504 (the rows themselves are finite)."""
    rng = np.random.default_rng(5)
    out = []
    for s in range(num):
        x = rng.normal(size=(BATCH, 3)).astype(np.float32)
        for position in overflow.get(s, []):
            x[_rows(position)] = 100.0
        out.append({"x": x, "y": x.sum(axis=1, keepdims=True)})
    return out


@functools.cache
def _fp16_step(backend):
    """One step per backend for the fp16 tests (each starts from its own init)."""
    scale = jaxstep.DynamicLossScale(
        scale=1024.0, growth_interval=3, growth_factor=2.0, backoff_factor=0.5, minimum_scale=512.0
    )
    return jaxstep.make_train_step(
        _fp16_loss, optax.sgd(0.1), backend=backend, loss_scale=scale, divergence_every=None
    )


def _fp16_init(step):
    return step.init({"w": np.full((3, 1), 0.5, np.float32)})


def test_fp16_overflow_on_one_device_skips_the_step_everywhere_and_rescales(backend):
    step = _fp16_step(backend)
    state = _fp16_init(step)
    batches = _fp16_batches(6, overflow={1: [4]})
    scales, statuses, before, after = [], [], None, None
    for s, batch in enumerate(batches):
        if s == 1:
            before = _replicas(step, state.params)
        state, out = step(state, batch)
        statuses.append([Status(int(x)) for x in step.table(out).status])
        scales.append(float(np.asarray(step.host_state(state).loss_scale.scale)))
        if s == 1:
            after = _replicas(step, state.params)
    # the overflow is recorded for device 4 alone, and is no failure
    assert statuses[1] == [Status.OVERFLOW if i == 4 else Status(0) for i in range(N)]
    assert all(not any(row) for s, row in enumerate(statuses) if s != 1)
    # the step was skipped on every device
    for b, a in zip(before, after, strict=True):
        jax.tree.map(np.testing.assert_array_equal, b, a)
    # backed off, then grown again after growth_interval + 1 good steps (as flax's
    # DynamicScale: the step that grows it still trains at the old scale)
    assert scales == [1024.0, 512.0, 512.0, 512.0, 512.0, 1024.0]
    # fit goes on through it, and the history shows it
    history = jaxstep.History()
    state = jaxstep.fit(step, _fp16_init(step), batches, history=history)
    status = np.asarray(history.status)
    assert status[1, 4] == Status.OVERFLOW
    assert np.count_nonzero(status) == 1
    assert history.loss[-1] < history.loss[0]


def test_fp16_overflow_at_the_minimum_scale_raises_naming_the_devices(backend):
    step = _fp16_step(backend)
    # step 1 backs off to the minimum (512); at step 2 devices 2 and 6 overflow there
    batches = _fp16_batches(4, overflow={1: [4], 2: [2, 6]})
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, _fp16_init(step), batches)
    err = info.value
    devices = jax.devices()
    assert err.step == 2
    assert [f.device_id for f in err.failures] == [devices[2].id, devices[6].id]
    assert all(Status.OVERFLOW in f.status for f in err.failures)


# ------------------------------------------------------------------ micro-batches
MB_PER_DEVICE = 8  # rows per device; with 4 micro-batches, 2 rows each


def _mlp_batches(num: int, seed: int = 6) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        x = rng.normal(size=(N * MB_PER_DEVICE, 3)).astype(np.float32)
        out.append(
            {
                "x": x,
                "y": np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32),
                "pos": np.ones((len(x), 1), np.float32),
                "poison": np.zeros((len(x),), np.float32),
            }
        )
    return out


_full_grad = jax.jit(jax.grad(mlp_loss))  # the whole global batch on one device


@functools.cache
def _micro_step(backend):
    """4 micro-batches of 2 rows on each device; shared (each test starts from its init)."""
    return jaxstep.make_train_step(
        mlp_loss, optax.sgd(1.0), microbatches=4, backend=backend, divergence_every=None
    )


def test_microbatch_gradient_equals_the_full_batch_gradient(backend):
    batch = _mlp_batches(1)[0]
    step = _micro_step(backend)
    state, out = step(step.init(mlp_params()), batch)
    assert not np.any(step.table(out).status)
    # sgd(1.0): the update is minus the gradient of the whole global batch
    grads = _full_grad(mlp_params(), batch)
    want = jax.tree.map(lambda p, g: p - g, mlp_params(), grads)
    got = jax.tree.map(np.asarray, step.host_state(state).params)
    _assert_tree_close(got, want, rtol=1e-5, atol=1e-6)


def test_nan_in_microbatch_2_is_named_with_its_rows(backend):
    step = _micro_step(backend)
    batches = _mlp_batches(2)
    row = 3 * MB_PER_DEVICE + 5  # device 3, chunk row 5: micro-batch 2 holds rows 4 and 5
    batches[1]["x"][row, 0] = np.nan
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(mlp_params()), batches)
    err = info.value
    assert err.device_id == jax.devices()[3].id
    assert err.step == 1
    assert err.microbatch == 2
    assert Status.INPUT_NONFINITE in err.status
    assert err.leaf == "['x']"
    assert len(err.failures) == 1
    assert err.failures[0].rows == (row - 1, row + 1)
    assert f"rows {row - 1}..{row}" in str(err)


_multi_steps = optax.MultiSteps(
    optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1)), every_k_schedule=2
)


@jax.jit
def _multi_steps_by_hand(params, opt_state, batch):
    updates, opt_state = _multi_steps.update(_full_grad(params, batch), opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def test_multisteps_and_clipping_work_with_microbatches(backend):
    batches = _mlp_batches(4)
    step = jaxstep.make_train_step(
        mlp_loss, _multi_steps, microbatches=2, backend=backend, divergence_every=None
    )
    state = jaxstep.fit(step, step.init(mlp_params()), batches)
    host = step.host_state(state)
    # By hand, on one device: the full-batch gradient of every batch through the same chain.
    params = mlp_params()
    opt_state = _multi_steps.init(params)
    for batch in batches:
        params, opt_state = _multi_steps_by_hand(params, opt_state, batch)
    _assert_tree_close(jax.tree.map(np.asarray, host.params), params, rtol=1e-5, atol=1e-6)
    assert int(np.asarray(host.step)) == 4  # batches consumed
    assert int(np.asarray(host.opt_state.gradient_step)) == 2  # updates applied


# ---------------------------------------------------------- pre-split batches
def _presplit(batch):
    return jax.tree.map(lambda x: x.reshape(N, -1, *x.shape[1:]), batch)


def test_presplit_batches_train_like_flat_ones(backend):
    step, params = _mnist_step(backend)
    batch = _images(1)[0]
    flat, _ = step(step.init(params), batch)
    split, out = step(step.init(params), _presplit(batch), presplit=True)
    assert not np.any(step.table(out).status)
    _assert_tree_close(
        step.host_state(split).params, step.host_state(flat).params, rtol=1e-6, atol=1e-7
    )


def test_presplit_batch_passed_flat_gets_a_hint_even_after_flat_steps(backend):
    step, params = _mnist_step(backend)
    batch = _images(1)[0]
    state, _ = step(step.init(params), batch)  # the step has run before
    with pytest.raises(ValueError, match=r"presplit=True") as info:
        step(state, _presplit(batch))
    assert "(8, 4, 8, 8, 1)" in str(info.value)  # the shape it was given
    state, out = step(state, batch)  # nothing was lost: the state still trains
    assert not np.any(step.table(out).status)
