"""jaxstep.CluWriter: each step's scalars at its step, the per-device columns, each
recovery and the failure reach a real CLU metric writer (behind CLU's AsyncWriter, as
``create_default_writer`` builds it), everything written by the time fit returns or
raises."""

import logging
import subprocess
import sys
import time
import types

import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep.testing import Fault
from tests.models import init_params
from tests.models import loss_fn
from tests.models import loss_with_checks
from tests.models import make_batches

STEPS = 6
BAD_STEP = 3


def _metric_writers():
    """``clu.metric_writers``, importable without TensorFlow. Its ``__init__`` (clu
    0.0.12) imports the TensorFlow summary writer, which the Flax examples have and
    these tests do not install (TensorFlow alone is larger than everything else here);
    a stand-in for that one module lets the writers that need no TensorFlow
    (``LoggingWriter``, ``AsyncWriter``, ``MultiWriter``, ``create_default_writer``
    without a logdir, ``MetricWriter`` itself) load as they are."""
    try:
        from clu import metric_writers
    except ModuleNotFoundError as err:
        if err.name != "tensorflow":
            raise
        stand_in = types.ModuleType("clu.metric_writers.summary_writer")

        class SummaryWriter:
            def __init__(self, *args, **kwargs):
                raise ModuleNotFoundError("the TensorFlow summary writer needs tensorflow")

        stand_in.SummaryWriter = SummaryWriter
        sys.modules[stand_in.__name__] = stand_in
        from clu import metric_writers
    return metric_writers


metric_writers = _metric_writers()


class Recorder(metric_writers.MetricWriter):
    """A CLU writer that keeps each call, slowly: behind an AsyncWriter, what fit did
    not flush would still be queued when fit returns."""

    def __init__(self):
        self.scalars = []  # (step, {name: value}) per call, in order
        self.texts = []
        self.flushes = 0

    def write_scalars(self, step, scalars):
        time.sleep(0.01)
        self.scalars.append((step, dict(scalars)))

    def write_texts(self, step, texts):
        time.sleep(0.01)
        self.texts.append((step, dict(texts)))

    def flush(self):
        self.flushes += 1

    def write_summaries(self, step, values, metadata=None):
        raise AssertionError("CluWriter writes scalars and texts only")

    write_images = write_videos = write_histograms = write_summaries

    def write_audios(self, step, audios, *, sample_rate):
        raise AssertionError("CluWriter writes scalars and texts only")

    def write_hparams(self, hparams):
        raise AssertionError("CluWriter writes scalars and texts only")

    def close(self):
        raise AssertionError("the writer is the user's: CluWriter never closes it")


def _snapshot(recorder):
    """What the recorder holds now (copied: the writer's thread may still be adding)."""
    return {"scalars": list(recorder.scalars), "texts": list(recorder.texts)}


def _skipping_step(backend, policy="skip"):
    """(the step, the bad device's id): a NaN gradient on devices[4] at step 3."""
    bad = jax.devices()[4].id
    step = jaxstep.make_train_step(
        loss_with_checks,
        optax.adam(1e-2),
        backend=backend,
        has_aux=True,
        on_failure=policy,
        divergence_every=None,  # one program to compile: these tests are about the host
        faults=[Fault("grad", device_id=bad, step=BAD_STEP, leaf="['dense2']['kernel']")],
    )
    return step, bad


@pytest.fixture(scope="module", params=["shard_map", "pmap"])
def skipped(request):
    """Six steps under ``skip``, device 4's step 3 skipped, written through CLU's
    AsyncMultiWriter to the recorder and CLU's LoggingWriter (what
    ``create_default_writer`` builds, with the recorder beside)."""
    step, bad = _skipping_step(request.param)
    recorder = Recorder()
    writer = metric_writers.AsyncMultiWriter([recorder, metric_writers.LoggingWriter()])
    history = jaxstep.History()
    batches = make_batches(STEPS)
    jaxstep.fit(
        step,
        step.init(init_params()),
        batches,
        history=history,
        callbacks=[jaxstep.CluWriter(writer)],
    )
    written = _snapshot(recorder)  # at once: what fit's flush left written
    # the run's goodput, written when it ended (after the last step), apart
    *written["scalars"], written["goodput"] = written["scalars"]
    return {"history": history, "batches": batches, "bad": bad, **written}


def test_each_step_s_scalars_reach_the_writer_at_their_step(skipped):
    history, batches = skipped["history"], skipped["batches"]
    assert [t for t, _ in skipped["scalars"]] == list(range(STEPS))
    for t, scalars in skipped["scalars"]:
        assert scalars["loss"] == pytest.approx(history.loss[t])
        assert scalars["metrics/mean_y"] == pytest.approx(float(np.mean(batches[t]["y"])), 1e-5)
        assert scalars["skipped"] == float(t == BAD_STEP)
        assert scalars["dropped"] == 0.0
        assert scalars["examples_per_sec"] > 0
        assert all(isinstance(v, float) for v in scalars.values())


def test_the_run_s_goodput_reaches_the_writer_when_it_ended(skipped):
    at, scalars = skipped["goodput"]
    report = skipped["history"].goodput()
    assert at == STEPS  # after the last step's
    assert scalars["goodput"] == pytest.approx(report.goodput)
    assert scalars["goodput/steps/productive"] == STEPS - 1  # step 3 skipped
    assert scalars["goodput/steps/skipped"] == 1.0
    assert {f"goodput/badput/{b}" for b in report.badput} <= set(scalars)


def test_the_per_device_columns_name_the_device_that_failed_and_no_other(skipped):
    history, bad = skipped["history"], skipped["bad"]
    for t, scalars in skipped["scalars"]:
        for i, d in enumerate(jax.devices()):
            assert scalars[f"device_{d.id}/loss"] == pytest.approx(history.device_loss[t][i])
            assert scalars[f"device_{d.id}/failed"] == float(t == BAD_STEP and d.id == bad)
            assert scalars[f"device_{d.id}/dropped"] == 0.0
            if not (t == BAD_STEP and d.id == bad):
                assert scalars[f"device_{d.id}/grad_norm"] > 0
    assert np.isnan(skipped["scalars"][BAD_STEP][1][f"device_{bad}/grad_norm"])
    # the check that failed, which a scalar cannot carry, as text on that step alone
    assert skipped["texts"] == [(BAD_STEP, {"devices": f"device {bad}: GRAD_NONFINITE"})]


def test_the_failure_is_written_as_text_naming_the_device_and_logged(backend, caplog):
    """Under ``raise``, the failure reaches an asynchronous writer before fit raises; a
    ``create_default_writer(just_logging=True)`` beside it (the Flax examples' writer
    on processes other than 0) logs the step and the failure."""
    step, bad = _skipping_step(backend, policy="raise")
    recorder = Recorder()
    logged = metric_writers.create_default_writer(just_logging=True, asynchronous=False)
    writer = metric_writers.MultiWriter([metric_writers.AsyncWriter(recorder), logged])
    with caplog.at_level(logging.INFO), pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(
            step,
            step.init(init_params()),
            make_batches(STEPS),
            callbacks=[jaxstep.CluWriter(writer)],
        )
    written = _snapshot(recorder)
    err = info.value
    assert (err.device_id, err.step) == (bad, BAD_STEP)
    assert [t for t, _ in written["scalars"]] == list(range(BAD_STEP + 1))
    assert written["scalars"][BAD_STEP][1][f"device_{bad}/failed"] == 1.0
    assert written["texts"][-1] == (BAD_STEP, {"failure": str(err)})
    assert f"device {bad}" in written["texts"][-1][1]["failure"]
    log = caplog.text
    assert f"[{BAD_STEP}] " in log and f"device_{bad}/failed=1" in log
    assert f"[{BAD_STEP}] Got texts: {{'failure': " in log


def test_a_recovery_is_counted_and_written_as_text_at_its_step(backend):
    dev = jax.devices()[3]
    step = jaxstep.make_train_step(
        loss_fn,
        optax.adam(1e-2),
        backend=backend,
        faults=[Fault("input", dev.id, step=2, mode="transient")],
    )
    recorder = Recorder()
    history = jaxstep.History()
    jaxstep.fit(
        step,
        step.init(init_params()),
        make_batches(4),
        recover=jaxstep.Recover(),
        history=history,
        callbacks=[jaxstep.CluWriter(metric_writers.AsyncWriter(recorder))],
    )
    written = _snapshot(recorder)
    (record,) = history.recoveries
    assert (record.step, record.verdict, record.device_ids) == (2, "transient", (dev.id,))
    recoveries = [(t, s) for t, s in written["scalars"] if "recoveries" in s]
    assert recoveries == [(2, {"recoveries": 1.0})]
    assert (2, {"recovery": str(record)}) in written["texts"]
    assert f"(device {dev.id})" in str(record)
    # step 2 failed on device 3 and ran again: both rows, as in the history
    steps = [t for t, s in written["scalars"] if "loss" in s]
    assert steps == history.step == [0, 1, 2, 2, 3]
    failed = [s[f"device_{dev.id}/failed"] for t, s in written["scalars"] if "loss" in s]
    assert failed == [0.0, 0.0, 1.0, 0.0, 0.0]


def test_a_path_or_another_object_is_refused_naming_what_to_pass():
    with pytest.raises(TypeError) as info:
        jaxstep.CluWriter("runs/a")
    message = str(info.value)
    assert "not a path ('runs/a')" in message
    assert "create_default_writer(logdir)" in message and "TensorBoardWriter(logdir)" in message
    with pytest.raises(TypeError, match=r"a list has no write_scalars, write_texts, flush"):
        jaxstep.CluWriter([])


def test_importing_jaxstep_never_imports_clu():
    code = (
        "import sys, jaxstep; jaxstep.CluWriter; "
        "print(sorted(m for m in sys.modules if m == 'clu' or m.startswith('clu.')))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert run.stdout.strip() == "[]"
