"""Bad input gets a clear error naming the value and the fix, before anything runs,
and the training state stays usable."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstep
from tests.models import host_params
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches


def _step(backend, loss=loss_fn, **kw):
    return jaxstep.make_train_step(loss, optax.sgd(0.1), backend=backend, **kw)


def _still_usable(step, state, batch):
    before = host_params(step, state)
    state, out = step(state, batch)
    assert not step.table(out).failed
    assert jax.tree.leaves(host_params(step, state))[0].shape == jax.tree.leaves(before)[0].shape


def test_batch_not_divisible_names_both_numbers(backend):
    step = _step(backend)
    state = step.init(init_params())
    batch = {k: v[:30] for k, v in make_batches(1)[0].items()}
    with pytest.raises(ValueError, match=r"batch leading axis 30 does not divide by the 8 dev"):
        step(state, batch)
    _still_usable(step, state, make_batches(1)[0])


def test_batch_structure_change_is_rejected(backend):
    step = _step(backend)
    state = step.init(init_params())
    batches = make_batches(2)
    state, _ = step(state, batches[0])
    changed = dict(batches[1], extra=batches[1]["y"])
    with pytest.raises(ValueError, match="batch structure changed"):
        step(state, changed)
    _still_usable(step, state, batches[1])


def test_batch_leaves_must_agree_and_be_arrays(backend):
    step = _step(backend)
    state = step.init(init_params())
    batch = make_batches(1)[0]
    with pytest.raises(ValueError, match="disagree on the leading"):
        step(state, dict(batch, y=batch["y"][:16]))
    with pytest.raises(ValueError, match=r"batch leaf \['pos'\] is a scalar"):
        step(state, dict(batch, pos=np.float32(1.0)))
    with pytest.raises(TypeError, match=r"batch leaf \['pos'\] is a str"):
        step(state, dict(batch, pos="nope"))
    _still_usable(step, state, batch)


def test_loss_that_is_not_a_float_scalar(backend):
    step = _step(backend, loss=lambda p, b: jnp.sum(p["dense1"]["kernel"]) * b["x"])
    state = step.init(init_params())
    with pytest.raises(TypeError, match="must return a float scalar loss, got shape"):
        step(state, make_batches(1)[0])
    _still_usable(_step(backend), _step(backend).init(init_params()), make_batches(1)[0])
    tuple_step = _step(backend, loss=lambda p, b: (loss_fn(p, b), {}))
    with pytest.raises(TypeError, match="has_aux=True"):
        tuple_step(tuple_step.init(init_params()), make_batches(1)[0])


def test_integer_loss_is_rejected(backend):
    step = _step(backend, loss=lambda p, b: jnp.sum(b["x"] > 0))
    with pytest.raises(TypeError, match="dtype int32"):
        step(step.init(init_params()), make_batches(1)[0])


def test_checks_must_be_boolean_scalars(backend):
    def loss(p, b):
        return loss_fn(p, b), {"checks": {"bad": jnp.abs(b["y"]) < 1}}

    step = _step(backend, loss=loss, has_aux=True)
    state = step.init(init_params())
    with pytest.raises(TypeError, match=r"aux\['checks'\]\['bad'\] must be a boolean scalar"):
        step(state, make_batches(1)[0])
    _still_usable(_step(backend), _step(backend).init(init_params()), make_batches(1)[0])


def test_params_with_non_array_leaves(backend):
    step = _step(backend)
    with pytest.raises(TypeError, match=r"parameter \['act'\] is a str"):
        step.init(dict(init_params(), act="relu"))
    with pytest.raises(TypeError, match=r"parameter \['n'\] has dtype int32"):
        step.init(dict(init_params(), n=np.int32(3)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"backend": "pjit"}, "unknown backend 'pjit'; expected 'shard_map' or 'pmap'"),
        ({"on_failure": "ignore"}, "unknown on_failure policy 'ignore'"),
        ({"devices": []}, "devices is empty"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips must be a positive int"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxstep.make_train_step(loss_fn, optax.sgd(0.1), **kwargs)


def test_bad_devices_and_optimizer():
    with pytest.raises(TypeError, match=r"jax\.Device"):
        jaxstep.make_train_step(loss_fn, optax.sgd(0.1), devices=[0, 1])
    with pytest.raises(ValueError, match="twice"):
        d = jax.devices()[0]
        jaxstep.make_train_step(loss_fn, optax.sgd(0.1), devices=[d, d])
    with pytest.raises(TypeError, match=r"optax\.GradientTransformation"):
        jaxstep.make_train_step(loss_fn, "adam")


def test_fit_keeps_state_on_a_bad_batch(backend):
    step = _step(backend)
    batches = make_batches(3)
    batches[2] = {k: v[:12] for k, v in batches[2].items()}
    with pytest.raises(ValueError, match="does not divide") as info:
        jaxstep.fit(step, step.init(init_params()), batches)
    state = info.value.state
    assert int(np.asarray(step.host_state(state).step)) == 2
    _still_usable(step, state, make_batches(1)[0])


def test_state_from_elsewhere_is_rejected(backend):
    step = _step(backend)
    step.init(init_params())
    with pytest.raises(TypeError, match=r"jaxstep\.TrainState"):
        step({"params": init_params()}, make_batches(1)[0])


def test_key_and_loss_signature_must_agree_before_the_step_runs(backend):
    def with_key(params, batch, rng):
        noise = jax.random.normal(rng, batch["x"].shape) * 0.0
        return loss_fn(params, dict(batch, x=batch["x"] + noise))

    batch = make_batches(1)[0]
    step = _step(backend, with_key)
    state = step.init(init_params())
    with pytest.raises(TypeError, match=r"with_key\(params, batch, rng\) takes a key \('rng'\)"):
        step(state, batch)
    with pytest.raises(TypeError, match=r"step.init\(params, rng=jax.random.key\(0\)\)"):
        jaxstep.fit(step, state, [batch])
    _still_usable(step, step.init(init_params(), rng=jax.random.key(0)), batch)

    plain = _step(backend)  # loss_fn(params, batch)
    keyed = plain.init(init_params(), rng=jax.random.key(0))
    with pytest.raises(TypeError, match=r"holds a key .* but loss_fn\(params, batch\) takes none"):
        plain(keyed, batch)
    _still_usable(plain, plain.init(init_params()), batch)

    def optional_key(params, batch, rng=None):  # a default: both ways are fine
        return loss_fn(params, batch)

    either = _step(backend, optional_key)
    _still_usable(either, either.init(init_params()), batch)
    either = _step(backend, optional_key)
    _still_usable(either, either.init(init_params(), rng=jax.random.key(1)), batch)

    def state_by_position(params, batch, model_state):  # model_state goes by keyword
        return loss_fn(params, batch), {"model_state": model_state}

    stateful = _step(backend, state_by_position, has_aux=True)
    ms = {"count": jnp.zeros(())}
    _still_usable(stateful, stateful.init(init_params(), model_state=ms), batch)


def test_model_state_missing_from_a_dict_aux_names_its_keys(backend):
    def forgets(params, batch, *, model_state):
        return loss_fn(params, batch), {"acc": jnp.float32(1.0)}

    step = _step(backend, forgets, has_aux=True)
    state = step.init(init_params(), model_state={"count": jnp.zeros(())})
    with pytest.raises(TypeError, match=r"aux has no 'model_state' key \(keys: \['acc'\]\)"):
        step(state, make_batches(1)[0])


def test_a_state_from_a_differently_built_step_is_rejected(backend):
    plain = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    spiky = jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), backend=backend, loss_spike=jaxstep.LossSpike()
    )
    spiky.init(init_params())
    state = plain.init(init_params())
    with pytest.raises(ValueError, match="this state does not fit this step"):
        spiky(state, make_batches(1)[0])
    other = "pmap" if backend == "shard_map" else "shard_map"
    foreign = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=other)
    foreign.init(init_params())
    with pytest.raises(ValueError, match="this state does not fit this step"):
        foreign(state, make_batches(1)[0])
    jax.tree.map(np.asarray, host_params(plain, state))  # still usable


def test_bad_batches_are_rejected_under_step_timeout_and_when_empty():
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2))
    state = step.init(init_params())
    short = {k: v[:30] for k, v in make_batches(1)[0].items()}
    with pytest.raises(ValueError, match="does not divide by the 8 devices"):
        jaxstep.fit(step, state, [short], step_timeout=30.0)
    empty = {k: v[:0] for k, v in make_batches(1)[0].items()}
    with pytest.raises(ValueError, match="0 examples"):
        step(state, empty)
