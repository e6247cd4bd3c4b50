"""TrainingWorkerError: message, fields, pickling."""

import pickle

import chex
import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Failure
from jaxstep import Status
from jaxstep import TrainingWorkerError
from jaxstep.testing import corrupt_replica
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches
from tests.models import rows_of


def test_message_and_fields():
    failures = [
        Failure(
            3,
            0,
            812,
            Status.GRAD_NONFINITE,
            "non-finite gradient in ['dense2']['kernel']",
            "['dense2']['kernel']",
            (12, 16),
        ),
        Failure(5, 0, 812, Status.LOSS_NONFINITE, "non-finite loss", None, (20, 24)),
    ]
    err = TrainingWorkerError(failures)
    assert str(err).startswith(
        "training worker on device 3 failed: non-finite gradient in ['dense2']['kernel'] "
        "at step 812"
    )
    assert "also failed at this step: device 5" in str(err)
    assert "what to try:" in str(err)
    assert isinstance(err, RuntimeError)
    assert (err.device_id, err.step, err.status, err.leaf) == (
        3,
        812,
        Status.GRAD_NONFINITE,
        "['dense2']['kernel']",
    )
    with pytest.raises(ValueError):
        TrainingWorkerError([])
    # error.batches: the failing batch alone, or with the ones pulled after it
    alone = str(TrainingWorkerError(failures, state="s", batches=["failing"]))
    assert "error.batches holds the failing batch, untrained: fit(" in alone
    two = str(TrainingWorkerError(failures, state="s", batches=["failing", "next"]))
    assert "error.batches holds the failing batch and the 1 pulled after it, untrained" in two
    # no state (a hang): nothing to pass to fit(step, error.state, ...)
    stateless = str(TrainingWorkerError(failures, batches=["failing"]))
    assert "error.state" in stateless and "fit(step, error.state" not in stateless


def _alike(status, reason, n=4, **kw):
    failures = [Failure(i, 0, 7, status, reason, None, (4 * i, 4 * i + 4)) for i in range(n)]
    return TrainingWorkerError(failures, alike=jaxstep._src.core.failed_alike(failures, 4), **kw)


def test_every_device_failing_alike_says_the_device_named_is_only_the_first():
    err = _alike(Status.LOSS_NONFINITE, "non-finite loss", state="s")
    headline = str(err).splitlines()[0]
    assert err.alike and err.device_id == 0
    assert headline.startswith("training worker on device 0 failed: non-finite loss at step 7")
    assert "all 4 devices of the step failed alike: device 0 is only the first" in headline
    assert "jaxstep.diagnose(step, error, batch)" in headline
    assert "rows 0..15 of the global batch" in str(err)  # every device's, not device 0's
    hung = str(_alike(Status.HUNG, "did not finish its part of the step")).splitlines()[0]
    assert "only the first in device order" in hung and "Python stacks" in hung
    # some devices only: each failed on its own rows, the first is a cause
    assert not _alike(Status.LOSS_NONFINITE, "non-finite loss", n=3).alike
    # a root cause found earlier in the chain: not alike
    failures = [
        Failure(2, 0, 7, Status.INPUT_NONFINITE, "non-finite input", "['x']", (8, 12)),
        *(Failure(i, 0, 7, Status.LOSS_NONFINITE, "non-finite loss", None) for i in (0, 1, 3)),
    ]
    assert not jaxstep._src.core.failed_alike(failures, 4)
    plain = _alike(Status.LOSS_NONFINITE, "non-finite loss")
    back = pickle.loads(pickle.dumps(plain))
    assert back.alike and str(back) == str(plain)


def test_with_note_adds_a_line_under_the_first_and_keeps_every_other_field():
    failure = Failure(3, 0, 7, Status.LOSS_NONFINITE, "non-finite loss", None, (12, 16))
    err = TrainingWorkerError([failure], state="s", batches=["b"], checkpoint="/c")
    once = err.with_note("first line")
    twice = once.with_note("second line")
    assert (err.note, once.note, twice.note) == (None, "first line", "first line\nsecond line")
    assert str(twice).splitlines()[1:3] == ["first line", "second line"]
    assert (twice.failures, twice.state, twice.batches, twice.checkpoint) == (
        (failure,),
        "s",
        ["b"],
        "/c",
    )


def test_error_from_a_run_pickles_with_its_fields(backend):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    batches = make_batches(3)
    batches[1]["x"][rows_of(2)] = np.nan
    with pytest.raises(TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), batches)
    err = info.value
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err)
    for field in ("device_id", "process_index", "step", "status", "reason", "leaf", "failures"):
        assert getattr(back, field) == getattr(err, field)
    assert back.device_id == jax.devices()[2].id
    chex.assert_trees_all_equal(back.state.params, jax.device_get(err.state.params))
    assert "rows 8..11 of the global batch" in str(err)


def test_errors_with_typed_keys_pickle_and_divergence_recovers(backend):
    def loss(params, batch, rng):
        return loss_fn(params, batch) + 0.0 * jax.random.normal(rng, ())

    step = jaxstep.make_train_step(loss, optax.adam(1e-2), backend=backend, divergence_every=1)
    batches = make_batches(4)
    state = jaxstep.fit(step, step.init(init_params(), rng=jax.random.key(0)), batches[:1])
    state = corrupt_replica(step, state, jax.devices()[2].id, "params['dense1']['bias']")
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, batches[1:], diagnose=True)
    err = info.value
    assert err.status == Status.DIVERGED and err.device_id == jax.devices()[2].id
    # no replay (it would start from a good copy), and no verdict on the chip: the
    # message says to go on on every device, and to leave it out only if it diverges again
    assert err.diagnosis.verdict == "diverged" and not err.diagnosis.devices
    hint = next(line for line in str(err).splitlines() if line.startswith("what to try"))
    assert "do not leave the device out yet" in hint and "diverges again" in hint
    back = pickle.loads(pickle.dumps(err))
    assert back.device_id == err.device_id
    key = step.host_state(back.state).rng if backend == "pmap" else back.state.rng
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
