"""A stalled device is named as HUNG before XLA aborts the stuck collective (~40 s on
CPU). Runs in a subprocess: the stuck process is thrown away afterwards."""

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, logging, os, sys
import jaxstep
jaxstep.testing.set_cpu_devices(8)
import jax, optax
from tests.models import init_params, loss_fn, make_batches
from jaxstep.testing import Fault

logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
backend, device, at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fault = Fault("stall", device_id=jax.devices()[device].id, step=at, seconds=300)
step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend, faults=[fault])
try:
    jaxstep.fit(step, step.init(init_params()), make_batches(8), step_timeout=4.0)
    print(json.dumps({"raised": False}), flush=True)
except jaxstep.TrainingWorkerError as err:
    print(json.dumps({
        "raised": True, "device_id": err.device_id, "step": err.step,
        "status": int(err.status), "ids": [f.device_id for f in err.failures],
        "message": str(err), "state": err.state is None,
    }), flush=True)
os._exit(0)  # the stalled collective never returns; leave before XLA aborts it
"""


@pytest.mark.timeout(120)
def test_stalled_device_is_named_hung(backend):
    import jax

    import jaxstep

    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, backend, "5", "3"],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=str(__import__("pathlib").Path(__file__).parents[2]),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result; rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert result["raised"]
    device = jax.devices()[5].id
    assert result["device_id"] == device
    assert result["ids"] == [device]  # the healthy devices reached the collective
    assert result["step"] == 3
    assert result["status"] == int(jaxstep.Status.HUNG)
    assert result["message"].startswith(f"training worker on device {device} failed:")
    assert result["state"]  # no state can be read from a hung device
    assert "Python stacks" in proc.stderr  # the stacks went to the log first
