"""A restarted job told the run's total (``until_step``) reaches it exactly when the
checkpoint it resumes from was written while rows were carried (a device had left the
run: 28 or 35 rows a step of 32-row batches on 7 devices), and a job restarted once
more trains nothing and says nothing misleading (issue 45, item 1)."""

import chex
import jax
import optax
import pytest

import jaxstep
from jaxstep.testing import Fault
from tests.models import fit_recording
from tests.models import host_params
from tests.models import init_params
from tests.models import loss_fn
from tests.sources import callable_source

UNTIL = 10


def _step(backend, **kw):
    return jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend, **kw)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_resume_from_rows_carried_reaches_until_step_exactly(backend, tmp_path, prefetch):
    """Device 5 fails from step 2 on and is excluded. The first job stops at step 5
    (num_steps): its checkpoint names batch 4 from row 27, 5 rows, fewer than the 7 a
    step needs, which a resume carries on without a step. The restarted job still
    trains steps 5..9 and ends at step 10, where a run that did not stop ends; a job
    restarted once more trains nothing, and no line says the data ended."""
    devices = jax.devices()
    gone = devices[5]
    faults = [Fault("loss", gone.id, step=t, mode="device") for t in range(2, 40)]
    whole_step = _step(backend, faults=faults)
    whole, _, _ = fit_recording(
        whole_step,
        whole_step.init(init_params()),
        callable_source(20),
        until_step=UNTIL,
        recover=jaxstep.Recover(),
    )
    assert int(whole_step.host_state(whole).step) == UNTIL
    first_step = _step(backend, faults=faults)
    command = {
        "checkpoint_dir": tmp_path,
        "checkpoint_every": 2,
        "until_step": UNTIL,
        "prefetch": prefetch,
    }
    first, _, _ = fit_recording(
        first_step,
        first_step.init(init_params()),
        callable_source(20),
        num_steps=5,
        recover=jaxstep.Recover(),
        **command,
    )
    assert int(first_step.host_state(first).step) == 5

    seven = _step(backend, devices=[d for d in devices if d != gone])
    resumed, history, caught = fit_recording(
        seven, seven.init(init_params()), callable_source(20), resume=True, **command
    )
    assert int(seven.host_state(resumed).step) == UNTIL
    assert history.step == list(range(5, UNTIL)), history.step
    assert not [w for w in caught if "data ended" in w], caught
    chex.assert_trees_all_close(
        host_params(seven, resumed), host_params(whole_step, whole), rtol=1e-6, atol=1e-7
    )

    again, history, caught = fit_recording(
        seven, seven.init(init_params()), callable_source(20), resume=True, **command
    )
    assert int(seven.host_state(again).step) == UNTIL
    assert history.step == [] and not caught, caught
