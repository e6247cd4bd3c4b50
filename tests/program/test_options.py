"""A step's options live in one frozen, checked object, and its face holds what users
call."""

import dataclasses

import jax
import optax
import pytest

import jaxstep
from jaxstep._src.program import Options
from tests.models import loss_fn

FACE = {
    "check_state",
    "clear_halt",
    "compile",
    "devices",
    "exclude_devices",
    "failures",
    "host_state",
    "init",
    "lower",
    "names",
    "options",
    "place_state",
    "table",
    "without_devices",
}


def test_make_train_step_gathers_every_option_into_one_frozen_object():
    spike = jaxstep.LossSpike(window=4, warmup=2)
    step = jaxstep.make_train_step(
        loss_fn, optax.sgd(0.1), on_failure="skip", microbatches=2, loss_spike=spike
    )
    o = step.options
    assert isinstance(o, Options)
    assert (o.on_failure, o.microbatches, o.loss_spike, o.loss_fn) == ("skip", 2, spike, loss_fn)
    assert o.devices == tuple(jax.devices()) and list(o.devices) == step.devices
    assert o.device_ids == tuple(d.id for d in jax.devices())
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.on_failure = "raise"


def test_options_built_directly_check_their_arguments_like_make_train_step():
    with pytest.raises(ValueError, match="unknown on_failure policy 'dorp'"):
        Options(loss_fn, optax.sgd(0.1), on_failure="dorp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_dropped"):
        Options(loss_fn, optax.sgd(0.1), on_failure="drop", max_dropped=-1)
    with pytest.raises(ValueError, match="devices is empty"):
        Options(loss_fn, optax.sgd(0.1), devices=[])


def test_train_steps_face_is_what_users_call():
    step = jaxstep.make_train_step(loss_fn, optax.sgd(0.1))
    assert {n for n in dir(step) if not n.startswith("_")} == FACE
