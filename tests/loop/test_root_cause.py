"""The root cause inside a model that communicates: a finite outlier in one device's
rows overflows before a cross-device BatchNorm, whose statistics carry the NaN to every
device. The replay diagnosis tries each example alone and names the device and the
example; the error leads with that device. fit replays such a failure (every device
alike) without being asked; with diagnose=False the first line names no device as the
cause. Both backends."""

import jax
import pytest

import jaxstep
from jaxstep import Status
from tests.flax.test_flax_models import _imagenet_step
from tests.flax.test_flax_models import _images
from tests.flax.test_flax_models import _rows


def test_an_overflow_before_a_cross_device_batchnorm_is_traced_to_its_device(backend):
    step, params, model_state = _imagenet_step(backend, "batch")
    state = step.init(params, model_state=model_state, rng=jax.random.key(1))
    batches = _images(3)
    bad_row = _rows(3).start + 1
    batches[2]["image"][bad_row] = 3e38  # finite, but the first conv overflows
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, batches, diagnose=True)
    err = info.value
    dev3 = jax.devices()[3]
    assert not any(Status.INPUT_NONFINITE in f.status for f in err.failures)
    assert {f.device_id for f in err.failures} == {d.id for d in jax.devices()}
    assert err.diagnosis.verdict == "data"
    assert err.diagnosis.examples == (bad_row,)
    assert err.diagnosis.root_devices == (dev3.id,)
    assert err.device_id == dev3.id and err.step == 2
    assert str(err).startswith(f"training worker on device {dev3.id} failed")
    assert f"follows from device {dev3.id}'s rows" in str(err)


def test_a_failure_every_device_had_alike_never_blames_a_healthy_device(backend):
    step, params, model_state = _imagenet_step(backend, "batch")
    batches = _images(3)
    bad_row = _rows(3).start + 1
    batches[2]["image"][bad_row] = 3e38  # finite, but the first conv overflows
    dev3, ids = jax.devices()[3], [d.id for d in jax.devices()]
    for diagnose in (False, None):  # None: fit's default
        state = step.init(params, model_state=model_state, rng=jax.random.key(1))
        with pytest.raises(jaxstep.TrainingWorkerError) as info:
            jaxstep.fit(step, state, batches, diagnose=diagnose)
        err = info.value
        headline, *rest = str(err).splitlines()
        hint = next(line for line in rest if line.startswith("what to try"))
        assert err.alike and {f.device_id for f in err.failures} == set(ids)
        if diagnose is None:  # replayed: device 3 and its row, as with diagnose=True
            assert (err.diagnosis.verdict, err.diagnosis.examples) == ("data", (bad_row,))
            assert err.device_id == dev3.id and "rows 12..15 of the global batch" in hint
            assert headline.startswith(f"training worker on device {dev3.id} failed: ")
            assert "alike" not in headline
        else:  # no replay: the device named is only the first, and the hint no device's
            assert err.diagnosis is None and err.device_id == ids[0]
            assert f"all 8 devices of the step failed alike: device {ids[0]} is only the " in (
                headline
            )
            assert "not a cause found" in headline and "jaxstep.diagnose(" in headline
            assert "rows 0..31 of the global batch" in hint


def test_outliers_in_every_devices_rows_name_every_device(backend):
    step, params, model_state = _imagenet_step(backend, "batch")
    state = step.init(params, model_state=model_state, rng=jax.random.key(1))
    batches = _images(2)
    rows = [_rows(p).start for p in range(len(jax.devices()))]
    batches[1]["image"][rows] = 3e38
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, state, batches, diagnose=True)
    err = info.value
    assert err.diagnosis.verdict == "data"
    assert err.diagnosis.examples == tuple(rows)
    assert err.diagnosis.root_devices == tuple(d.id for d in jax.devices())
    assert err.device_id == jax.devices()[0].id
