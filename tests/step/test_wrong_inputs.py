"""Wrong inputs that users make: each is refused before anything runs, with an error
that names the argument, the value and the fix, and the state passed in stays usable
(one more good step from it equals a clean step, bitwise). Both backends."""

import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep.testing import Fault
from tests.models import BATCH
from tests.models import host_params
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches


def _step(backend, optimizer=None, **kw):
    kw.setdefault("divergence_every", None)  # one program: clean steps compare bitwise
    return jaxstep.make_train_step(loss_fn, optimizer or optax.sgd(0.1), backend=backend, **kw)


def _assert_usable(step, state, batch):
    """One good step from ``state`` equals a clean step from its parameters, bitwise."""
    params = host_params(step, state)
    after, out = step(state, batch)
    assert not step.table(out).failed
    clean = _step(step.options.backend, devices=step.devices)
    ref, _ = clean(clean.init(params), batch)
    for a, b in zip(
        jax.tree.leaves(host_params(step, after)),
        jax.tree.leaves(host_params(clean, ref)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ batches


def test_a_batch_whose_dtype_changes_is_refused_naming_the_leaf(backend):
    step = _step(backend)
    batches = make_batches(2)
    state, _ = step(step.init(init_params()), batches[0])
    pixels = dict(batches[1], x=(batches[1]["x"] * 10).astype(np.uint8))
    with pytest.raises(TypeError, match=r"batch leaf \['x'\].*float32.*uint8.*astype"):
        step(state, pixels)
    _assert_usable(step, state, batches[1])


def test_a_target_axis_that_shrinks_to_one_is_refused_as_a_silent_broadcast(backend):
    step = _step(backend)
    batches = make_batches(2)
    state, _ = step(step.init(init_params()), batches[0])
    wide = dict(batches[1], y=np.concatenate([batches[1]["y"]] * 2, axis=1))
    state2 = state
    # (32, 1) -> (32,): one axis fewer is refused
    with pytest.raises(ValueError, match=r"batch leaf \['y'\] had shape \(32, 1\).*\(32,\)"):
        step(state2, dict(batches[1], y=batches[1]["y"][:, 0]))
    _assert_usable(step, state, batches[1])
    other = _step(backend)
    s, _ = other(other.init(init_params()), wide)
    with pytest.raises(ValueError, match=r"axis 1 .* 2 to 1.*broadcast"):
        other(s, batches[1])


def test_a_non_leading_axis_may_change_with_a_warning_once(backend):
    def loss(params, batch):
        return loss_fn(params, batch) + 0.0 * jnp.mean(batch["tokens"])

    step = jaxstep.make_train_step(loss, optax.sgd(0.1), backend=backend, divergence_every=None)
    batches = make_batches(3)
    state = step.init(init_params())
    state, _ = step(state, dict(batches[0], tokens=np.zeros((BATCH, 16), np.int32)))
    with pytest.warns(UserWarning, match=r"\['tokens'\].*\(32, 16\).*\(32, 24\).*recompile"):
        state, _ = step(state, dict(batches[1], tokens=np.zeros((BATCH, 24), np.int32)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per leaf: no second warning
        step(state, dict(batches[2], tokens=np.zeros((BATCH, 8), np.int32)))


def test_a_list_of_examples_is_refused_with_the_stacking_fix(backend):
    step = _step(backend)
    state = step.init(init_params())
    batch = make_batches(1)[0]
    examples = [{k: v[i] for k, v in batch.items()} for i in range(BATCH)]
    with pytest.raises(ValueError, match=r"list of 32 examples.*np\.stack"):
        step(state, examples)
    _assert_usable(step, state, batch)


# ------------------------------------------------------------------ init


@pytest.mark.parametrize("params", [None, {}, {"w": np.zeros(3, np.int32)}])
def test_init_refuses_params_with_nothing_to_train(params):
    step = _step("shard_map")
    with pytest.raises((ValueError, TypeError), match=r"param"):
        step.init(params)


def test_init_refuses_an_integer_as_key():
    step = _step("shard_map")
    with pytest.raises(TypeError, match=r"rng=0 .*jax\.random\.key\(0\)"):
        step.init(init_params(), rng=0)


def test_init_refuses_non_finite_params_naming_the_leaf(backend):
    step = _step(backend)
    params = init_params()
    params["dense2"]["bias"][0] = np.nan
    with pytest.raises(ValueError, match=r"\['dense2'\]\['bias'\].*non-finite.*before any"):
        step.init(params)


# ------------------------------------------------------------------ states


def test_params_passed_as_the_state_say_to_init(backend):
    step = _step(backend)
    with pytest.raises(TypeError, match=r"state.*TrainState.*dict.*step\.init\(params\)"):
        jaxstep.fit(step, init_params(), make_batches(1))


def test_a_donated_state_says_it_was_donated(backend):
    step = _step(backend)
    batches = make_batches(2)
    state = step.init(init_params())
    new = jaxstep.fit(step, state, batches[:1])
    for call in (lambda: jaxstep.fit(step, state, batches[1:]), lambda: step(state, batches[1])):
        with pytest.raises(ValueError, match=r"donated.*state = jaxstep\.fit\("):
            call()
    _assert_usable(step, new, batches[1])


def test_an_optimizer_state_of_another_optimizer_is_refused(backend):
    sgd, adam = _step(backend), _step(backend, optax.adam(1e-3))
    state = sgd.init(init_params())
    with pytest.raises(ValueError, match=r"opt_state.*optimizer"):
        adam(state, make_batches(1)[0])
    _assert_usable(sgd, state, make_batches(1)[0])


def test_an_optimizer_state_of_other_params_is_refused(backend):
    adam = _step(backend, optax.adam(1e-3))
    state = adam.init(init_params())
    other = init_params()
    other["dense1"]["kernel"] = np.zeros((3, 5), np.float32)
    other["dense2"]["kernel"] = np.zeros((5, 1), np.float32)
    mixed = adam.place_state(dataclasses.replace(adam.host_state(state), params=other))
    fresh = _step(backend, optax.adam(1e-3))
    with pytest.raises(ValueError, match=r"opt_state"):
        fresh(mixed, make_batches(1)[0])


@pytest.mark.parametrize("pair", [("shard_map", "pmap"), ("pmap", "shard_map")])
def test_a_state_of_the_other_backend_is_refused_with_the_fix(pair):
    a, b = _step(pair[0]), _step(pair[1])
    state = a.init(init_params())
    with pytest.raises(ValueError, match=r"place_state\(.*host_state\(state\)\)"):
        b(state, make_batches(1)[0])
    _assert_usable(a, state, make_batches(1)[0])


def test_a_state_on_other_devices_is_refused_with_the_fix(backend):
    eight, four = _step(backend), _step(backend, devices=jax.devices()[:4])
    state = eight.init(init_params())
    with pytest.raises(ValueError, match=r"devices.*place_state\("):
        four(state, make_batches(1)[0])
    _assert_usable(eight, state, make_batches(1)[0])


def test_a_string_in_aux_is_refused_naming_its_key(backend):
    def loss(params, batch):
        return loss_fn(params, batch), {"note": "hello", "mean_y": jnp.mean(batch["y"])}

    step = jaxstep.make_train_step(loss, optax.sgd(0.1), backend=backend, has_aux=True)
    state = step.init(init_params())
    with pytest.raises(TypeError, match=r"aux\['note'\] is a str"):
        step(state, make_batches(1)[0])


# ------------------------------------------------------------------ fit's arguments


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_steps": 2.5}, r"num_steps must be an int >= 0 or None, got 2\.5"),
        ({"num_steps": "10"}, r"num_steps must be an int >= 0 or None, got '10'"),
        ({"step_timeout": "10"}, r"step_timeout must be a number of seconds > 0 or None"),
        ({"history": []}, r"history must be a jaxstep\.History or None, got list"),
        ({"recover": True}, r"recover must be a jaxstep\.Recover or None, got True"),
        ({"callbacks": [print]}, r"callbacks\[0\].*on_step_end"),
        ({"checkpoint_every": 0, "checkpoint_dir": "x"}, r"checkpoint_every must be"),
    ],
)
def test_fit_refuses_bad_arguments_before_anything_runs(backend, kwargs, match):
    step = _step(backend)
    state = step.init(init_params())
    with pytest.raises((TypeError, ValueError), match=match):
        jaxstep.fit(step, state, make_batches(1), **kwargs)
    _assert_usable(step, state, make_batches(1)[0])


def test_one_batch_where_an_iterable_is_expected_is_refused(backend):
    step = _step(backend)
    state = step.init(init_params())
    with pytest.raises(TypeError, match=r"batches.*one batch.*\[batch\]"):
        jaxstep.fit(step, state, make_batches(1)[0])
    _assert_usable(step, state, make_batches(1)[0])


def test_an_empty_iterator_warns_that_nothing_was_trained(backend):
    step = _step(backend)
    state = step.init(init_params())
    with pytest.warns(UserWarning, match="no batch"):
        state = jaxstep.fit(step, state, iter([]))
    _assert_usable(step, state, make_batches(1)[0])


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_training(backend, tmp_path):
    step = _step(backend)
    state = step.init(init_params())
    path = tmp_path / "a_file"
    path.write_text("x")
    with pytest.raises(ValueError, match=r"checkpoint_dir .*a_file.* is a file"):
        jaxstep.fit(step, state, make_batches(1), checkpoint_dir=path)
    below = path / "sub"
    with pytest.raises(ValueError, match=r"checkpoint_dir .*cannot be created|is a file"):
        jaxstep.fit(step, state, make_batches(1), checkpoint_dir=below)
    _assert_usable(step, state, make_batches(1)[0])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_checkpoint_dir_that_is_not_writable_is_refused(backend, tmp_path):
    step = _step(backend)
    state = step.init(init_params())
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="not writable"):
            jaxstep.fit(step, state, make_batches(1), checkpoint_dir=tmp_path / "ck")
    finally:
        tmp_path.chmod(0o700)


def test_single_callback_and_single_fault_objects_are_accepted(backend, tmp_path):
    step = _step(backend, faults=Fault("input", device_id=jax.devices()[3].id, step=99))
    state = step.init(init_params())
    writer = jaxstep.JsonlWriter(tmp_path / "run.jsonl")
    state = jaxstep.fit(step, state, make_batches(2), callbacks=writer)
    assert len((tmp_path / "run.jsonl").read_text().splitlines()) >= 2
