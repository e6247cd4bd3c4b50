"""history.goodput(): where a job's time went, from the spans fit writes into the
history's ledger; its steps counted by outcome, its time by bucket, across fit calls,
failures and a killed process's restart (``goodput.jsonl`` beside the checkpoints)."""

import json
import os
import subprocess
import sys
import textwrap
import time

import jax
import optax
import pytest

import jaxstep
from jaxstep.testing import Fault
from tests.loop.test_recover import _spiky_batches
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

BUCKETS = {"startup", "data", "checkpoint", "diagnosis", "recovery", "wasted", "other"}


def _step(backend, **kw):
    kw = {"divergence_every": None, **kw}  # one program to compile a step: the host's test
    return jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend, **kw)


def _adds_up(report):
    assert set(report.badput) == BUCKETS
    assert all(seconds >= 0 for seconds in report.badput.values())
    total = report.productive_s + sum(report.badput.values())
    assert total == pytest.approx(report.wall_s, rel=1e-9)
    assert 0.0 < report.goodput <= 1.0


def test_a_clean_run_is_productive_steps_and_startup_and_matches_the_wall_clock(backend):
    step = _step(backend)
    history = jaxstep.History()
    state = step.init(init_params())
    began = time.perf_counter()
    jaxstep.fit(step, state, make_batches(12), history=history)
    wall = time.perf_counter() - began
    report = history.goodput()
    _adds_up(report)
    assert report.wall_s == pytest.approx(wall, rel=0.02)  # all of fit's time, within 2%
    assert report.steps == {
        "productive": 12,
        "skipped": 0,
        "failed": 0,
        "dropped_chunks": 0,
        "rolled_back": 0,
        "lost": 0,
    }
    assert report.badput["startup"] > report.productive_s / 12  # compiling, before step 0
    assert report.badput["wasted"] == report.badput["diagnosis"] == 0.0
    assert report.badput["recovery"] == report.badput["checkpoint"] == 0.0
    assert history.ledger.calls == [pytest.approx(report.wall_s, rel=1e-9)]
    text = str(report)
    assert text.startswith(f"jaxstep goodput: {100 * report.goodput:.1f}% of ")
    assert "12 steps kept" in text and "startup" in text
    assert json.loads(json.dumps(report.to_dict()))["steps"]["productive"] == 12


def test_a_skipped_step_is_wasted_and_a_dropped_chunk_still_productive(backend):
    dev = jax.devices()[3]
    fault = [Fault("grad", dev.id, step=4)]
    skipping = _step(backend, on_failure="skip", faults=fault)
    history = jaxstep.History()
    jaxstep.fit(skipping, skipping.init(init_params()), make_batches(8), history=history)
    report = history.goodput()
    _adds_up(report)
    assert report.steps["skipped"] == 1 and report.steps["productive"] == 7
    assert report.badput["wasted"] > 0
    assert "(1 skipped)" in str(report)
    dropping = _step(backend, on_failure="drop", faults=fault)
    history = jaxstep.History()
    jaxstep.fit(dropping, dropping.init(init_params()), make_batches(8), history=history)
    report = history.goodput()
    _adds_up(report)
    assert report.steps["productive"] == 8 and report.steps["dropped_chunks"] == 1
    assert report.badput["wasted"] == 0.0
    assert "1 chunks dropped from kept steps" in str(report)


def test_an_exclusion_is_diagnosis_and_recovery_and_its_failed_step_wasted(backend):
    dev = jax.devices()[5]
    step = _step(backend, faults=[Fault("grad", dev.id, step=3, mode="device")])
    history = jaxstep.History()
    seven = jaxstep.fit(
        step, step.init(init_params()), make_batches(8), history=history, recover=jaxstep.Recover()
    )
    assert [r.action for r in history.recoveries] == ["excluded"]
    report = history.goodput()
    _adds_up(report)
    assert report.steps["failed"] == 1  # step 3 on all 8, then again on the 7 left
    assert report.steps["productive"] == int(step.host_state(seven).step)
    assert report.badput["diagnosis"] > 0 and report.badput["recovery"] > 0
    assert report.badput["wasted"] > 0


def test_a_rollback_wastes_the_steps_it_undoes(backend, tmp_path):
    spike = jaxstep.LossSpike(window=8, warmup=3, sigmas=50.0)
    step = _step(backend, loss_spike=spike)
    history = jaxstep.History()
    jaxstep.fit(
        step,
        step.init(init_params()),
        _spiky_batches(10, spike_at=7),
        recover=jaxstep.Recover(rollback_batches=2),
        history=history,
        checkpoint_dir=tmp_path,
        checkpoint_every=4,
    )
    assert history.step == [0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]
    report = history.goodput()
    _adds_up(report)
    # 4, 5, 6 trained, then undone and trained again; 7 spiked; 8 steps kept
    assert report.steps["rolled_back"] == 3 and report.steps["failed"] == 1
    assert report.steps["productive"] == 8
    assert report.badput["checkpoint"] > 0 and report.badput["wasted"] > 0
    assert "3 rolled back" in str(report) and "1 failed" in str(report)


def test_the_history_of_a_failed_fit_reports_the_time_up_to_the_failure(backend):
    dev = jax.devices()[2]
    step = _step(backend, faults=[Fault("loss", dev.id, step=5)])
    history = jaxstep.History()
    with pytest.raises(jaxstep.TrainingWorkerError):
        jaxstep.fit(step, step.init(init_params()), make_batches(8), history=history)
    report = history.goodput()
    _adds_up(report)
    assert report.steps["productive"] == 5 and report.steps["failed"] == 1
    assert len(history.ledger.calls) == 1


CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    import chex
    chex.set_n_cpu_devices(8)
    import optax, jaxstep
    from tests.models import init_params, loss_fn, make_batches

    directory, until, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    class Kill(jaxstep.Callback):
        def on_step_end(self, table):
            if table.step == kill_at:
                time.sleep(0.5)  # the record's thread writes what is queued
                os.kill(os.getpid(), signal.SIGKILL)

    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2))
    history = jaxstep.History()
    batches = lambda start: make_batches(until, seed=0)[start:]
    jaxstep.fit(step, step.init(init_params()), batches, history=history,
                checkpoint_dir=directory, checkpoint_every=10, until_step=until,
                resume=True, callbacks=[Kill()])
    print("GOODPUT", jaxstep.Goodput.to_dict(history.goodput()), flush=True)
    """
)


def test_a_killed_job_and_its_restart_report_one_job_with_the_steps_it_lost(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    args = [sys.executable, "-c", CHILD, str(tmp_path)]
    killed = subprocess.run([*args, "40", "29"], capture_output=True, text=True, env=env)
    assert killed.returncode == -9, killed.stderr[-2000:]
    lines = (tmp_path / "goodput.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["n"] == 29  # the record got every step settled
    done = subprocess.run([*args, "40", "-1"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    (said,) = [line for line in done.stdout.splitlines() if line.startswith("GOODPUT")]
    report = eval(said.split(" ", 1)[1])  # the dict printed
    # steps 0-29 trained, the checkpoint of step 20 the latest: 20-29 lost, trained again
    assert report["steps"]["lost"] == 10
    assert report["steps"]["productive"] == 40
    assert report["badput"]["wasted"] > 0
    total = report["productive_s"] + sum(report["badput"].values())
    assert total == pytest.approx(report["wall_s"], rel=1e-9)
    # both processes' startups: the killed one compiled too
    assert report["badput"]["startup"] > 0
    calls = [json.loads(x) for x in (tmp_path / "goodput.jsonl").read_text().splitlines()]
    # the first run found nothing to resume from; the restart resumed from step 20
    assert [c["resume"] for c in calls if "resume" in c] == [20]


def test_the_writers_the_bar_and_the_plot_show_it(backend, tmp_path):
    import io

    step = _step(backend)
    history = jaxstep.History()
    out = io.StringIO()
    callbacks = [
        jaxstep.JsonlWriter(tmp_path / "run.jsonl"),
        jaxstep.Progress(6, live=True, file=out),
    ]
    jaxstep.fit(
        step, step.init(init_params()), make_batches(6), history=history, callbacks=callbacks
    )
    lines = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    (event,) = [x for x in lines if x.get("event") == "goodput"]
    assert event == {"event": "goodput", **history.goodput().to_dict()}
    assert lines[-1] == event  # the last line: written when the run ended
    # the bar's last line: the last step's, and the run's goodput
    shown = " ".join(out.getvalue().split())  # (the bar wraps where the width ends)
    assert f"goodput {history.goodput().goodput:.0%}" in shown
    figure = jaxstep.plot.goodput(history, tmp_path / "goodput.png")
    legend = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert legend[0] == "productive" and "startup" in legend
    assert (tmp_path / "goodput.png").stat().st_size > 0
    assert f"{100 * history.goodput().goodput:.1f}%" in figure.axes[0].get_title()
