"""A run killed with SIGKILL, or hung, resumes from its verified checkpoints with
nothing lost. The run to kill runs in a child process; the resume runs here."""

import functools
import json
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep.testing import replicas
from tests.models import init_params
from tests.models import loss_fn
from tests.sources import callable_source
from tests.sources import grain_loader

NUM = 10
EVERY = 2
ROOT = Path(__file__).parents[2]

PRELUDE = r"""
import json, os, signal, sys
import jaxstep
jaxstep.testing.set_cpu_devices(8)
import jax, optax
from tests.models import init_params, loss_fn, make_batches
from tests.sources import callable_source, grain_loader
"""

KILL = (
    PRELUDE
    + r"""
backend, kind, where, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend, divergence_every=2)
source = callable_source(10) if kind == "callable" else grain_loader(10)


class Kill:
    def on_step_end(self, table):
        if table.step == kill_at:  # a checkpoint write may be under way: so be it
            os.kill(os.getpid(), signal.SIGKILL)


jaxstep.fit(step, step.init(init_params()), source, checkpoint_dir=where, checkpoint_every=2,
            callbacks=[Kill()])
print("not killed", flush=True)
"""
)

HANG = (
    PRELUDE
    + r"""
from jaxstep.testing import Fault
import numpy as np
backend, where, reference = sys.argv[1], sys.argv[2], sys.argv[3]
fault = Fault("stall", device_id=jax.devices()[5].id, step=5, seconds=300)
step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend, divergence_every=2,
                               faults=[fault])
# The reference: the same programs, run clean to step 4 (the fault fires at step 5).
clean = jaxstep.fit(step, step.init(init_params()), make_batches(4), step_timeout=4.0)
np.savez(reference, *jax.tree.leaves(step.host_state(clean).params))
try:
    jaxstep.fit(step, step.init(init_params()), make_batches(8), step_timeout=4.0,
                checkpoint_dir=where, checkpoint_every=2)
except jaxstep.TrainingWorkerError as err:
    print(json.dumps({"step": err.step, "status": int(err.status), "message": str(err),
                      "checkpoint": err.checkpoint, "batches": len(err.batches)}), flush=True)
os._exit(0)  # the stalled collective never returns; leave before XLA aborts it
"""
)


def _child(script, *args, timeout=240):
    return subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(ROOT),
    )


@functools.cache
def _step(backend):
    return jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), backend=backend, divergence_every=EVERY
    )


def _params(step, state):
    return [np.asarray(x) for x in jax.tree.leaves(step.host_state(state).params)]


@pytest.mark.timeout(300)
# Each child costs seconds of JAX start-up on a 2-core box: both backends and both data
# sources are covered, not every pair (the in-process resume tests cover every pair).
@pytest.mark.parametrize(
    ("backend", "kind", "kill_at"), [("shard_map", "callable", 7), ("pmap", "grain", 4)]
)
def test_a_run_killed_with_sigkill_resumes_bitwise_equal(backend, kind, kill_at, tmp_path):
    proc = _child(KILL, backend, kind, tmp_path, kill_at)
    assert proc.returncode == -signal.SIGKILL, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    source = callable_source(NUM) if kind == "callable" else grain_loader(NUM)
    step = _step(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a write cut short by the kill is passed over
        resumed = jaxstep.fit(
            step,
            step.init(init_params()),
            source,
            checkpoint_dir=tmp_path,
            checkpoint_every=EVERY,
            resume=True,
        )
    again = callable_source(NUM) if kind == "callable" else grain_loader(NUM)
    clean = jaxstep.fit(step, step.init(init_params()), again)
    assert int(np.asarray(step.host_state(resumed).step)) == NUM
    for a, b in zip(_params(step, resumed), _params(step, clean), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.timeout(300)
def test_hung_names_the_verified_checkpoint_and_it_equals_a_clean_run(backend, tmp_path):
    reference = tmp_path.parent / f"{tmp_path.name}-clean.npz"
    proc = _child(HANG, backend, tmp_path, reference)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result; rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert (result["step"], result["status"]) == (5, int(jaxstep.Status.HUNG))
    assert f"the latest verified checkpoint is step 4 ({tmp_path / '4'})" in result["message"]
    assert result["checkpoint"] == str(tmp_path / "emergency" / "step_5")
    assert 1 <= result["batches"] <= 3  # the hung step's batch, and those prefetched
    step = _step(backend)
    restored = jaxstep.restore(step, tmp_path)
    copies = replicas(step, (restored.params, restored.opt_state))
    for copy in copies[1:]:
        jax.tree.map(np.testing.assert_array_equal, copy, copies[0])
    with np.load(reference) as clean:
        want = [clean[f"arr_{i}"] for i in range(len(clean.files))]
    for a, b in zip(_params(step, restored), want, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="holds no state"):
        jaxstep.restore(step, result["checkpoint"])  # the hung state could not be read
