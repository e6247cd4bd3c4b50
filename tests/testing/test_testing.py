"""The testing kit: faults on leaves that do not exist are refused before anything
runs; the assertions pass on what they promise and fail, naming device, step and
leaf, on everything else; the pytest plugin sets devices before conftest.py runs."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep._src.core import Failure
from jaxstep.testing import Fault
from jaxstep.testing import assert_fails
from jaxstep.testing import assert_matches_reference
from jaxstep.testing import assert_replicas_equal
from jaxstep.testing import corrupt_replica
from jaxstep.testing import set_cpu_devices
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

PARAM_LEAVES = "[\"['dense1']['bias']\", \"['dense1']['kernel']\", \"['dense2']['bias']\""


@pytest.mark.parametrize("kind", ["grad", "param"])
def test_a_fault_on_a_missing_parameter_leaf_fails_at_init_listing_the_leaves(backend, kind):
    fault = Fault(kind, device_id=jax.devices()[2].id, step=1, leaf="['dense9']['kernel']")
    step = jaxstep.make_train_step(
        loss_fn, optax.sgd(0.1), backend=backend, faults=[fault], verify_update=kind == "param"
    )
    with pytest.raises(ValueError) as info:
        step.init(init_params())
    message = str(info.value)
    assert f"Fault(kind='{kind}'" in message
    assert "names leaf \"['dense9']['kernel']\", which does not exist" in message
    assert f"the parameter leaves are {PARAM_LEAVES}" in message
    # the right name passes the same check
    good = Fault(kind, device_id=jax.devices()[2].id, step=1, leaf="['dense2']['kernel']")
    step = jaxstep.make_train_step(
        loss_fn, optax.sgd(0.1), backend=backend, faults=[good], verify_update=kind == "param"
    )
    assert int(np.asarray(step.host_state(step.init(init_params())).step)) == 0


def test_a_fault_on_a_missing_input_leaf_fails_at_the_first_batch_before_it_runs(backend):
    fault = Fault("input", device_id=jax.devices()[4].id, step=0, leaf="['X']")
    step = jaxstep.make_train_step(loss_fn, optax.sgd(0.1), backend=backend, faults=[fault])
    state = step.init(init_params())
    with pytest.raises(ValueError) as info:
        step(state, make_batches(1)[0])
    message = str(info.value)
    assert "names leaf \"['X']\", which does not exist" in message
    assert "the batch's float leaves are [\"['poison']\", \"['pos']\", \"['x']\", \"['y']\"]" in (
        message
    )
    # nothing ran: the state was neither donated nor advanced
    assert int(np.asarray(step.host_state(state).step)) == 0


def _error(*device_ids, step=4, status=Status.GRAD_NONFINITE, leaf="['w']"):
    failures = [
        Failure(device_id=d, process_index=0, step=step, status=status, reason="r", leaf=leaf)
        for d in device_ids
    ]
    return jaxstep.TrainingWorkerError(failures)


def test_assert_fails_accepts_the_exact_failure_in_every_form():
    err = _error(5)
    kw = {"device_id": 5, "step": 4, "status": Status.GRAD_NONFINITE, "leaf": "['w']"}
    assert assert_fails(err, **kw) is err
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        raise err
    assert assert_fails(info, **kw) is err

    def run():
        raise err

    assert assert_fails(run, **kw) is err
    assert assert_fails(_error(2, 5), device_id=[2, 5], step=4) is not None


@pytest.mark.parametrize(
    "err,expect",
    [
        (_error(5, 6), "failing devices are [5, 6]; blamed, but should be healthy: 6"),
        (_error(3), "failing devices are 3; blamed, but should be healthy: 3; not blamed: 5"),
        (_error(5, step=3), "failed at step 3, not 4"),
        (
            _error(5, status=Status.LOSS_NONFINITE | Status.GRAD_NONFINITE),
            "status is Status.LOSS_NONFINITE | Status.GRAD_NONFINITE, not Status.GRAD_NONFINITE",
        ),
        (_error(5, leaf="['b']"), "leaf is \"['b']\", not \"['w']\""),
    ],
    ids=["a-healthy-device-blamed", "another-device", "another-step", "more-flags", "leaf"],
)
def test_assert_fails_reports_what_differs(err, expect):
    with pytest.raises(AssertionError) as info:
        assert_fails(err, device_id=5, step=4, status=Status.GRAD_NONFINITE, leaf="['w']")
    message = str(info.value)
    assert message.startswith(
        "expected a failure on device 5 at step 4 with status Status.GRAD_NONFINITE in leaf "
        "\"['w']\", but: "
    )
    assert expect in message
    assert "the error was:\ntraining worker on device" in message


def test_assert_fails_reports_a_run_that_did_not_fail():
    with pytest.raises(AssertionError, match="finished without a TrainingWorkerError"):
        assert_fails(lambda: None, device_id=1, step=0)
    with pytest.raises(TypeError, match="a function that raises one, got int"):
        assert_fails(3, device_id=1, step=0)


def test_assert_replicas_equal_names_the_corrupted_device_and_leaf(backend):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    state = step.init(init_params(), rng=jax.random.key(0))  # a typed key compares too
    assert_replicas_equal(step, state)
    bad = jax.devices()[6].id
    state = corrupt_replica(step, state, bad, "params['dense1']['bias']")
    assert_replicas_equal(step, state.opt_state)  # only params were touched
    with pytest.raises(AssertionError) as info:
        assert_replicas_equal(step, state.params)
    message = str(info.value)
    healthy = [d.id for d in jax.devices() if d.id != bad]
    assert message.startswith(f"the replicas differ: devices {healthy} agree, and\n")
    assert f"devices {bad} hold another copy:" in message
    assert "dense1/bias" in message  # chex's name of the leaf


def _centered_loss(params, batch):
    """A loss that uses the device axis: inputs centred on the global batch mean."""
    x = batch["x"] - jax.lax.pmean(jnp.mean(batch["x"], axis=0), "devices")
    h = jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    pred = h @ params["dense2"]["kernel"] + params["dense2"]["bias"]
    return jnp.mean((pred - batch["y"]) ** 2)


class _Perturbed:
    """A step whose parameters drift from what it trained: what the reference catches."""

    def __init__(self, step):
        self._step = step

    def __getattr__(self, name):
        return getattr(self._step, name)

    def __call__(self, state, batch):
        return self._step(state, batch)

    def host_state(self, state):
        host = self._step.host_state(state)
        params = jax.tree.map(lambda x: x, host.params)
        params["dense2"]["bias"] = params["dense2"]["bias"] + 1e-3
        return host.replace(params=params)


def test_assert_matches_reference_follows_a_loss_with_collectives_and_catches_drift():
    step = jaxstep.make_train_step(_centered_loss, optax.adam(1e-2))
    batches = make_batches(2)
    state = assert_matches_reference(step, init_params(), batches)
    assert int(np.asarray(step.host_state(state).step)) == 2
    drift = jaxstep.make_train_step(_centered_loss, optax.adam(1e-2))
    with pytest.raises(AssertionError) as info:
        assert_matches_reference(_Perturbed(drift), init_params(), batches[:1])
    message = str(info.value)
    assert message.startswith("after step 0 the parameters differ from the single-device")
    assert "dense2/bias" in message


def _running_mean_loss(traced):
    """A loss with a model state (a running mean of the inputs, as BatchNorm keeps),
    taken by keyword only as linen's adapters do; it notes each time it is traced."""

    def loss(params, batch, *, model_state):
        traced.append(1)
        mean = 0.9 * model_state["mean"] + 0.1 * jnp.mean(batch["x"], axis=0)
        h = jnp.tanh((batch["x"] - mean) @ params["dense1"]["kernel"])
        pred = h @ params["dense2"]["kernel"] + params["dense2"]["bias"]
        return jnp.mean((pred - batch["y"]) ** 2), {"model_state": {"mean": mean}}

    return loss


def test_assert_matches_reference_refuses_a_missing_model_state_before_anything_runs(backend):
    traced = []
    step = jaxstep.make_train_step(
        _running_mean_loss(traced), optax.adam(1e-2), backend=backend, has_aux=True
    )
    batches = make_batches(2)
    with pytest.raises(TypeError) as info:
        assert_matches_reference(step, init_params(), batches)
    message = str(info.value)
    assert message.startswith("loss(params, batch, *, model_state) takes model_state but ")
    assert "assert_matches_reference(step, params, batches, model_state=...)" in message
    assert traced == []  # refused before the step (or the reference) traced the loss
    # given, the same step matches the reference
    state = assert_matches_reference(
        step, init_params(), batches, model_state={"mean": np.zeros(3, np.float32)}
    )
    assert int(np.asarray(step.host_state(state).step)) == 2


def test_assert_matches_reference_refuses_a_model_state_the_loss_does_not_take():
    step = jaxstep.make_train_step(
        lambda params, batch: (loss_fn(params, batch), {}), optax.adam(1e-2), has_aux=True
    )
    with pytest.raises(TypeError, match=r"got model_state=, but <lambda>\(params, batch\) "):
        assert_matches_reference(
            step, init_params(), make_batches(1), model_state={"mean": np.zeros(3, np.float32)}
        )


def test_set_cpu_devices_after_the_backend_started():
    set_cpu_devices(len(jax.devices()))  # what runs already: fine
    with pytest.raises(RuntimeError, match=r"JAX runs with 8 CPU devices, wanted 4: .*"):
        set_cpu_devices(4)
    with pytest.raises(ValueError, match="must be an int >= 1, got 0"):
        set_cpu_devices(0)


CONFTEST = """
import jax
DEVICES_AT_IMPORT = len(jax.devices())  # starts JAX while conftest.py is imported
"""

TEST = """
import jax
import conftest

def test_devices(jaxstep_backend, jaxstep_devices):
    assert conftest.DEVICES_AT_IMPORT == len(jax.devices()) == len(jaxstep_devices) == 4
    assert jax.devices()[0].platform == "cpu"
    print("backend", jaxstep_backend)
"""


DEVICES_4 = ["--jaxstep-devices", "4"]


@pytest.mark.timeout(120)
def test_the_plugin_sets_devices_before_conftest_starts_jax(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_it.py").write_text(textwrap.dedent(TEST))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-s", *DEVICES_4],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log
    assert "test_it.py::test_devices[shard_map] backend shard_map\nPASSED" in log
    assert "test_it.py::test_devices[pmap] backend pmap\nPASSED" in log
    assert ": 4 fake CPU devices (--jaxstep-devices); compile cache " in log


@pytest.mark.parametrize("kind", ["grad", "param"])
def test_a_fault_names_its_leaf_as_step_names_writes_it_too(backend, kind):
    # "params['dense2']['kernel']" (step.names["state"], corrupt_replica) and
    # "['dense2']['kernel']" (err.leaf) name the same leaf
    bad = jax.devices()[6].id
    fault = Fault(kind, device_id=bad, step=2, leaf="params['dense2']['kernel']")
    assert fault.leaf == "['dense2']['kernel']"
    step = jaxstep.make_train_step(
        loss_fn, optax.sgd(0.1), backend=backend, faults=[fault], verify_update=kind == "param"
    )
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), make_batches(4))
    assert_fails(
        info.value,
        device_id=bad,
        step=2,
        status=Status.GRAD_NONFINITE if kind == "grad" else Status.PARAM_NONFINITE,
        leaf="params['dense2']['kernel']",
    )
