"""Metric writers and the progress callback: one record per finished step, with every
device's fields and the aux scalars, written to JSONL and TensorBoard in one line."""

import io
import json
import math

import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep.testing import Fault
from tests.models import init_params
from tests.models import loss_with_checks
from tests.models import make_batches
from tests.tensorboard_events import read_events

STEPS = 6
BAD_STEP = 3


def _step(backend, policy="skip"):
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


def _run(backend, callbacks, *, policy="skip"):
    """Six steps; a NaN gradient on devices[4] at step 3 (skipped under ``skip``)."""
    step, bad = _step(backend, policy)
    batches = make_batches(STEPS)
    history = jaxstep.History()
    error = None
    try:
        jaxstep.fit(step, step.init(init_params()), batches, history=history, callbacks=callbacks)
    except jaxstep.TrainingWorkerError as err:
        error = err
    return history, batches, bad, error


@pytest.fixture(scope="module", params=["shard_map", "pmap"])
def run(request, tmp_path_factory):
    """One skip-policy run per backend, with every writer attached (compiling is what
    costs, so the tests below share it)."""
    tmp = tmp_path_factory.mktemp(request.param)
    plain, live = io.StringIO(), io.StringIO()
    tensorboard = jaxstep.TensorBoardWriter(tmp / "tb")
    callbacks = [
        jaxstep.JsonlWriter(tmp / "run.jsonl"),
        tensorboard,
        jaxstep.Progress(STEPS, every=2, file=plain),
        jaxstep.Progress(STEPS, live=True, file=live),
    ]
    history, batches, bad, error = _run(request.param, callbacks)
    tensorboard.close()
    assert error is None
    return {
        "history": history,
        "batches": batches,
        "bad": bad,
        "jsonl": tmp / "run.jsonl",
        "tb": tmp / "tb",
        "plain": plain.getvalue(),
        "live": live.getvalue(),
    }


def test_history_gets_the_aux_scalars_and_examples_per_second(run):
    history, batches = run["history"], run["batches"]
    assert [list(m) for m in history.metrics] == [["mean_y"]] * STEPS
    for metrics, batch in zip(history.metrics, batches, strict=True):
        # The mean over devices of each device's mean is the global mean (equal chunks).
        assert metrics["mean_y"] == pytest.approx(float(np.mean(batch["y"])), rel=1e-5)
    rates = np.asarray(history.examples_per_sec)
    assert rates.shape == (STEPS,) and np.all(np.isfinite(rates)) and np.all(rates > 0)


class _Tables:
    """Keeps every step's table (a callback that does not read the history)."""

    def __init__(self):
        self.tables = []

    def on_step_end(self, table):
        self.tables.append(table)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_history_decoded_when_read_matches_every_table_in_order(backend):
    """The history keeps tables and decodes them when read: read between two fits
    and after, it holds each step's fields in order, as the tables say."""
    step, bad = _step(backend)
    history, seen = jaxstep.History(), _Tables()
    batches = make_batches(STEPS)
    state = jaxstep.fit(
        step, step.init(init_params()), batches[:2], history=history, callbacks=[seen]
    )
    assert history.step == [0, 1]  # read: the first two decoded
    jaxstep.fit(step, state, batches[2:], history=history, callbacks=[seen])
    assert len(history) == STEPS and len(seen.tables) == STEPS
    assert history.step == list(range(STEPS))
    assert history.skipped == [i == BAD_STEP for i in range(STEPS)]
    for i, table in enumerate(seen.tables):
        assert history.loss[i] == float(np.mean(table.loss))
        np.testing.assert_array_equal(history.device_loss[i], table.loss)
        np.testing.assert_array_equal(history.device_grad_norm[i], table.grad_norm)
        np.testing.assert_array_equal(history.status[i], table.status)
    position = [d.id for d in jax.devices()].index(bad)
    assert history.status[BAD_STEP][position] == jaxstep.Status.GRAD_NONFINITE
    assert np.count_nonzero(history.status[BAD_STEP]) == 1  # no healthy device blamed
    arrays = history.as_arrays()
    assert arrays["device_loss"].shape == (STEPS, len(jax.devices()))


def test_jsonl_has_one_line_per_step_with_every_device_and_the_aux_metrics(run):
    path, history, batches, bad = run["jsonl"], run["history"], run["batches"], run["bad"]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines, ended = lines[:-1], lines[-1]  # the run's goodput, when it ended
    assert ended == {"event": "goodput", **history.goodput().to_dict()}
    assert [r["step"] for r in lines] == list(range(STEPS))
    ids = [d.id for d in jax.devices()]
    for record, batch in zip(lines, batches, strict=True):
        assert [d["id"] for d in record["devices"]] == ids
        assert record["metrics"]["mean_y"] == pytest.approx(float(np.mean(batch["y"])), rel=1e-5)
        assert record["examples_per_sec"] > 0
        assert record["skipped"] == (record["step"] == BAD_STEP)
    for record in lines:
        for d, loss, norm in zip(
            record["devices"],
            history.device_loss[record["step"]],
            history.device_grad_norm[record["step"]],
            strict=True,
        ):
            failed = record["step"] == BAD_STEP and d["id"] == bad
            assert d["status"] == ("GRAD_NONFINITE" if failed else "OK")
            assert d["failed"] == failed
            assert d["loss"] == pytest.approx(float(loss))
            # A non-finite gradient norm is written as null (strict JSON), never as NaN.
            assert d["grad_norm"] is None if failed else d["grad_norm"] == pytest.approx(norm)


def test_jsonl_ends_with_the_failure_under_raise(tmp_path):
    path = tmp_path / "run.jsonl"
    _, _, bad, error = _run("shard_map", [jaxstep.JsonlWriter(path)], policy="raise")
    assert error is not None
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.get("step") for r in lines[:-1]] == list(range(BAD_STEP + 1))
    last = lines[-1]
    assert last["event"] == "failure"
    assert (last["device_id"], last["step"], last["status"]) == (bad, BAD_STEP, "GRAD_NONFINITE")
    assert last["leaf"] == "['dense2']['kernel']"
    assert [f["device_id"] for f in last["failures"]] == [bad]


def test_tensorboard_event_file_holds_the_scalars(run):
    history, batches, bad = run["history"], run["batches"], run["bad"]
    scalars, _ = read_events(run["tb"])
    assert sorted(scalars["loss"]) == list(range(STEPS))
    for t in range(STEPS):
        assert scalars["loss"][t] == pytest.approx(history.loss[t])
        assert scalars["metrics/mean_y"][t] == pytest.approx(float(np.mean(batches[t]["y"])), 1e-5)
        assert scalars["skipped"][t] == float(t == BAD_STEP)
        for i, d in enumerate(jax.devices()):
            assert scalars[f"device_{d.id}/loss"][t] == pytest.approx(history.device_loss[t][i])
            assert scalars[f"device_{d.id}/failed"][t] == float(t == BAD_STEP and d.id == bad)
    assert math.isnan(scalars[f"device_{bad}/grad_norm"][BAD_STEP])
    assert scalars[f"device_{bad}/grad_norm"][BAD_STEP + 1] > 0


def test_progress_prints_plain_lines_off_a_terminal(run):
    history = run["history"]
    lines = run["plain"].splitlines()
    # Under skip nothing is raised: the progress says who failed.
    skipped = f"step {BAD_STEP} skipped: device {run['bad']}: non-finite gradient in "
    assert [line for line in lines if "skipped:" in line] == [skipped + "['dense2']['kernel']"]
    lines = [line for line in lines if "skipped:" not in line]
    assert len(lines) == STEPS // 2
    assert lines[-1].startswith(f"step     {STEPS - 1} ({STEPS}/{STEPS})")
    assert f"loss {history.loss[-1]:.4f}" in lines[-1]
    assert "mean_y" in lines[-1] and "ex/s" in lines[-1] and "skipped 1" in lines[-1]


def test_progress_draws_a_live_bar_when_asked(run):
    text = run["live"]
    assert f"{STEPS}/{STEPS}" in text and "skipped 1" in text
    assert f"step {BAD_STEP} skipped: device {run['bad']}" in text
