"""A stalled device is named as HUNG before XLA aborts the stuck collective (~40 s on
CPU). Runs in a subprocess: the stuck process is thrown away afterwards."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _child(script: str, *args: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """Runs ``script`` in a fresh Python; its JSON lines, in order."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=str(ROOT),
        env={k: v for k, v in os.environ.items() if k != "JAXSTEP_RESTART"},  # no launcher
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert results, f"no result; rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc, results


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

    proc, results = _child(SCRIPT, backend, "5", "3")
    result = results[-1]
    assert result["raised"]
    device = jax.devices()[5].id
    assert result["device_id"] == device
    assert result["ids"] == [device]  # the healthy devices reached the collective
    assert result["step"] == 3
    assert result["status"] == int(jaxstep.Status.HUNG)
    assert result["message"].startswith(f"training worker on device {device} failed:")
    assert result["state"]  # no state can be read from a hung device
    assert "Python stacks" in proc.stderr  # the stacks went to the log first
    # no hint to resume from error.state, which is None: restart, resume the checkpoint
    assert "fit(step, error.state" not in result["message"]
    assert "this process cannot train again: restart it" in result["message"]
    assert "resume=True" in result["message"]


# A quarantine's rerun stalls: device 3's chunk holds a NaN example at step 1 (a
# "data" verdict), and device 5 stalls only once the quarantine is recorded, so only in
# the rerun (a Fault fires in a step's first run: tests.models.HostFault waits to be armed).
# No launcher started it ($JAXSTEP_RESTART unset, as in a notebook): fit raises the hang.
RERUN = r"""
import json, logging, os, sys
import jaxstep
jaxstep.testing.set_cpu_devices(8)
import jax, optax
from tests.models import HostFault, init_params, make_batches
from jaxstep.testing import Fault

logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
backend, bad, stalls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
stall = HostFault(stalls, stall=60.0)

class Watch:
    def on_recovery(self, record):
        stall.arm()
        print(json.dumps({"record": [record.step, record.verdict, record.action,
                                     list(record.device_ids)]}), flush=True)
    def on_failure(self, err):
        print(json.dumps({
            "device_id": err.device_id, "step": err.step, "status": int(err.status),
            "ids": [f.device_id for f in err.failures], "message": str(err),
            "state": err.state is None,
        }), flush=True)

fault = Fault("input", jax.devices()[bad].id, step=1, mode="data", example=1)
step = jaxstep.make_train_step(
    stall.loss, optax.adam(1e-2), backend=backend, faults=[fault], divergence_every=None
)
try:
    jaxstep.fit(step, step.init(init_params()), make_batches(3), step_timeout=3.0,
                recover=jaxstep.Recover(), callbacks=[Watch()])
    print(json.dumps({"finished": True}), flush=True)
except jaxstep.TrainingWorkerError as err:
    print(json.dumps({"raised": str(err)}), flush=True)
os._exit(0)  # the stalled collective never returns; leave before XLA aborts it
"""


@pytest.mark.timeout(120)
def test_a_device_that_stalls_in_a_quarantines_rerun_is_named_hung(backend):
    import jax

    import jaxstep

    proc, results = _child(RERUN, backend, "3", "5")
    bad, stalled = jax.devices()[3].id, jax.devices()[5].id
    record, failure, raised = results
    assert record == {"record": [1, "data", "quarantined", [bad]]}
    assert "finished" not in failure, "fit went on past the stall: the rerun was not watched"
    assert failure["device_id"] == stalled
    assert failure["ids"] == [stalled]  # the healthy devices (and the dropped one) beat
    assert failure["step"] == 1
    assert failure["status"] == int(jaxstep.Status.HUNG)
    assert failure["message"].startswith(f"training worker on device {stalled} failed:")
    assert failure["state"]
    # under recover a hang is not recovered in the process; with no launcher to restart
    # it (a notebook), the error is raised after the emergency save, not an exit
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exiting with code" not in proc.stderr
    assert raised["raised"] == failure["message"]
    assert "not exited for a restart" in raised["raised"]
    assert "restart it (in a notebook, restart the kernel)" in raised["raised"]


# A diagnosis replay stalls: device 3's chunk holds a NaN example at step 1, and device 5
# stalls only once that failure is read (armed from on_step_end, which runs before the
# failure is diagnosed), so only in the replay that diagnoses it.
REPLAY = r"""
import json, logging, os, sys
import jaxstep
jaxstep.testing.set_cpu_devices(8)
import jax, optax
from tests.models import HostFault, init_params, make_batches
from jaxstep.testing import Fault

logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
backend, bad, stalls, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
stall = HostFault(stalls, stall=60.0)

class Watch:
    def on_step_end(self, table):
        if table.failed:
            stall.arm()
    def on_failure(self, err):  # before the error leaves fit
        print(json.dumps({
            "device_id": err.device_id, "step": err.step, "status": int(err.status),
            "ids": [f.device_id for f in err.failures], "message": str(err),
            "state": err.state is None, "batches": len(err.batches), "fired": stall.fired,
        }), flush=True)

fault = Fault("input", jax.devices()[bad].id, step=1, mode="data", example=1)
step = jaxstep.make_train_step(
    stall.loss, optax.adam(1e-2), backend=backend, faults=[fault], divergence_every=None
)
how = {"diagnose": {"diagnose": True}, "recover": {"recover": jaxstep.Recover()}}[how]
try:
    jaxstep.fit(step, step.init(init_params()), make_batches(3), step_timeout=3.0,
                callbacks=[Watch()], **how)
    print(json.dumps({"finished": True}), flush=True)
except jaxstep.TrainingWorkerError:
    pass
os._exit(0)  # the stalled replay never returns; leave before XLA aborts it
"""


@pytest.mark.timeout(120)
def test_a_device_that_stalls_in_a_diagnosis_replay_is_named_hung(backend):
    _assert_named_in_replay(backend, "diagnose")


@pytest.mark.timeout(120)
def test_a_device_that_stalls_in_a_recoverys_replay_is_named_hung():
    _assert_named_in_replay("shard_map", "recover")


def _assert_named_in_replay(backend: str, how: str) -> None:
    import jax

    import jaxstep

    _, results = _child(REPLAY, backend, "3", "5", how)
    stalled = jax.devices()[5].id
    failure = results[0]
    assert "finished" not in failure, "fit went on past the stall: the replay was not watched"
    assert failure["fired"] == 1  # it stalled in the replay, not in a step
    assert failure["device_id"] == stalled
    assert failure["ids"] == [stalled]  # the other devices beat in the replay
    assert failure["step"] == 1
    assert failure["status"] == int(jaxstep.Status.HUNG)
    message = failure["message"]
    assert message.startswith(f"training worker on device {stalled} failed:")
    assert "in the replay that diagnoses step 1" in message
    # what was being diagnosed: device 3's bad input
    assert f"while diagnosing: training worker on device {jax.devices()[3].id} failed" in message
    assert failure["state"]
    # the failing batch, untrained (the watchdog settles each step before the next
    # pull), and those the prefetch pulled after it
    assert 1 <= failure["batches"] <= 3
