"""Stopping a run loses nothing: whatever ends a ``fit`` early (Ctrl-C, a callback's
exception, the data source's, SystemExit, SIGINT to the process) reaches the caller
with its own type, carrying ``.state`` (the last good state, usable) and ``.batches``
(pulled and not trained, in order); with ``checkpoint_dir`` the state is saved and
``resume=True`` goes on from it. Each ends bitwise equal to an uninterrupted run."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import optax
import pytest

import jaxstep
from tests.models import RaiseAt
from tests.models import assert_params_equal
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

NUM = 8
ROOT = Path(__file__).parents[2]


def _step(backend, **kw):
    return jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend, **kw)


@pytest.mark.parametrize(
    "exc", [KeyboardInterrupt(), ValueError("a callback's bug"), SystemExit(3)], ids=type
)
def test_an_exception_from_a_callback_carries_the_state_and_untrained_batches(backend, exc):
    step = _step(backend, divergence_every=2)
    batches = make_batches(NUM)
    clean = jaxstep.fit(step, step.init(init_params()), batches)
    with pytest.raises(type(exc)) as info:
        jaxstep.fit(step, step.init(init_params()), iter(batches), callbacks=[RaiseAt(3, exc)])
    err = info.value
    assert any("error.state" in note for note in err.__notes__)
    trained = int(np.asarray(step.host_state(err.state).step))
    assert trained + len(err.batches) <= NUM
    for got, want in zip(err.batches, batches[trained:], strict=False):
        np.testing.assert_array_equal(got["x"], want["x"])
    rest = list(err.batches) + batches[trained + len(err.batches) :]
    resumed = jaxstep.fit(step, err.state, rest)  # the state is usable: nothing donated
    assert_params_equal(step, resumed, clean)


def test_an_exception_from_the_data_source_carries_the_state(backend):
    step = _step(backend)
    batches = make_batches(NUM)

    def source():
        yield from batches[:5]
        raise OSError("the data server went away")

    clean = jaxstep.fit(step, step.init(init_params()), batches)
    with pytest.raises(OSError, match="went away") as info:
        jaxstep.fit(step, step.init(init_params()), source())
    err = info.value
    assert int(np.asarray(step.host_state(err.state).step)) == 5
    assert err.batches == []
    assert_params_equal(step, jaxstep.fit(step, err.state, batches[5:]), clean)


def test_an_interrupt_with_a_checkpoint_dir_saves_and_resume_goes_on(backend, tmp_path):
    step = _step(backend, divergence_every=100)
    batches = make_batches(NUM)
    clean = jaxstep.fit(step, step.init(init_params()), batches)
    with pytest.raises(KeyboardInterrupt) as info:
        jaxstep.fit(
            step,
            step.init(init_params()),
            batches,
            checkpoint_dir=tmp_path,
            checkpoint_every=2,  # not a multiple of divergence_every: still verified
            keep=2,
            callbacks=[RaiseAt(4, KeyboardInterrupt())],
        )
    assert any(str(tmp_path) in note for note in info.value.__notes__)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in names if "tmp" in n], names  # no half-written checkpoint
    assert len([n for n in names if n.isdigit()]) <= 2  # keep respected
    resumed = jaxstep.fit(
        step,
        step.init(init_params()),
        batches,
        checkpoint_dir=tmp_path,
        checkpoint_every=2,
        keep=2,
        resume=True,
    )
    assert_params_equal(step, resumed, clean)


def test_checkpoints_every_few_steps_are_verified_whatever_divergence_every(backend, tmp_path):
    step = _step(backend, divergence_every=None)
    batches = make_batches(7)
    jaxstep.fit(
        step, step.init(init_params()), batches, checkpoint_dir=tmp_path, checkpoint_every=3
    )
    # every 3 steps and the run's end (keep=3: the oldest, 0, went)
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [3, 6, 7]
    restored = jaxstep.restore(step, tmp_path, at=6)
    assert int(np.asarray(step.host_state(restored).step)) == 6
    partial = jaxstep.fit(step, step.init(init_params()), batches[:6])
    assert_params_equal(step, restored, partial)
    end = jaxstep.restore(step, tmp_path)  # the latest verified one: the end
    assert int(np.asarray(step.host_state(end).step)) == 7
    assert_params_equal(step, end, jaxstep.fit(step, step.init(init_params()), batches))


CHILD = r"""
import sys, time
import jaxstep
jaxstep.testing.set_cpu_devices(8)
import optax
from tests.models import init_params, loss_fn, make_batches

backend, where = sys.argv[1], sys.argv[2]
step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)


class Slow:
    def on_step_end(self, table):
        print("step", table.step, flush=True)
        time.sleep(0.5)


try:
    jaxstep.fit(step, step.init(init_params()), make_batches(40), checkpoint_dir=where,
                callbacks=[Slow()])
except KeyboardInterrupt as err:
    print("interrupted", int(err.state.step if err.state.step.ndim == 0 else err.state.step[0]),
          len(err.batches), flush=True)
    sys.exit(130)
print("not interrupted", flush=True)
"""


@pytest.mark.timeout(300)
def test_sigint_to_a_training_process_saves_and_resume_is_bitwise_equal(tmp_path):
    backend = "shard_map"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, backend, str(tmp_path)],
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 3"):
            break
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, errors = proc.communicate(timeout=120)
    assert proc.returncode == 130, f"{out}\n{errors[-3000:]}"
    stopped = [line for line in out.splitlines() if line.startswith("interrupted")]
    assert stopped, out
    step = _step(backend)
    batches = make_batches(40)
    resumed = jaxstep.fit(
        step, step.init(init_params()), batches, checkpoint_dir=tmp_path, resume=True
    )
    clean = jaxstep.fit(step, step.init(init_params()), batches)
    assert_params_equal(step, resumed, clean)


def test_an_interrupt_of_a_grain_loader_resumes_at_the_first_untrained_batch(tmp_path):
    from tests.sources import grain_loader

    step = _step("shard_map", divergence_every=100)
    clean = jaxstep.fit(step, step.init(init_params()), grain_loader(NUM))
    with pytest.raises(KeyboardInterrupt):
        jaxstep.fit(
            step,
            step.init(init_params()),
            grain_loader(NUM),
            checkpoint_dir=tmp_path,
            callbacks=[RaiseAt(4, KeyboardInterrupt())],
        )
    resumed = jaxstep.fit(
        step, step.init(init_params()), grain_loader(NUM), checkpoint_dir=tmp_path, resume=True
    )
    assert_params_equal(step, resumed, clean)
