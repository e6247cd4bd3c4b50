"""What a user sees on a step: a small face, the options in one place, and the
plumbing the other layers use in :mod:`jaxstep.step.driving`."""

import jax.numpy as jnp
import optax

import jaxstep
from jaxstep.step import driving

FACE = [
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
]


def _loss(params, batch):
    return jnp.mean((batch["x"] * params["w"] - batch["y"]) ** 2)


def test_a_step_shows_its_thirteen_members_and_reads_its_options_from_step_options(backend):
    step = jaxstep.make_train_step(_loss, optax.sgd(0.1), backend=backend, has_aux=False)
    assert sorted(name for name in dir(step) if not name.startswith("_")) == FACE
    assert step.options.backend == backend
    assert step.options.loss_fn is _loss
    assert step.options.has_aux is False
    assert driving.stacked(step) is (backend == "pmap")
