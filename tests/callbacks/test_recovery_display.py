"""Each recovery of ``fit(..., recover=...)`` (a ``jaxstep.Recovery`` in
``History.recoveries``, then ``on_recovery``) is shown by every display: the progress
line, the JSONL and TensorBoard writers, the overview picture, and the summary at the
end. Driven here by hand, in fit's order, on tables built on the host: no step runs."""

import io
import json

import matplotlib
import numpy as np
import pytest

import jaxstep
from tests.tensorboard_events import read_events

matplotlib.use("Agg")

IDS = [10, 11, 12, 13]
STEPS = 6
QUARANTINED = jaxstep.Recovery(
    step=2, verdict="data", action="quarantined", device_ids=(12,), examples=(40, 41), batch=2
)
EXCLUDED = jaxstep.Recovery(
    step=4,
    verdict="device",
    action="excluded",
    device_ids=(13,),
    batch=4,
    detail="fails again on replay",
)
RECOVERIES = {2: QUARANTINED, 4: EXCLUDED}
QUARANTINED_TEXT = "step 2: data -> quarantined (device 12); examples [40, 41] of batch 2"
EXCLUDED_TEXT = "step 4: device -> excluded (device 13) of batch 4; fails again on replay"


def _table(step: int) -> jaxstep.HealthTable:
    """A healthy step's table on the four devices."""
    n = len(IDS)
    none = np.full(n, -1, np.int32)
    zeros = np.zeros(n, np.int32)
    return jaxstep.HealthTable(
        status=zeros,
        input_leaf=none,
        grad_leaf=none,
        param_leaf=none,
        check=none,
        diverged_leaf=none,
        model_state_leaf=none,
        microbatch=none,
        loss=np.full(n, 1.0 / (step + 1), np.float32),
        grad_norm=np.ones(n, np.float32),
        step=step,
        halted=False,
        skipped=False,
        consecutive_skips=0,
        failed=False,
        dropped=zeros,
        repaired=zeros,
        consecutive_drops=zeros,
    )


def _fit(*callbacks) -> jaxstep.History:
    """What fit does with callbacks, in its order: each recovery goes into the history,
    then to ``on_recovery``, before the step it recovered is recorded."""
    history = jaxstep.History(device_ids=IDS)
    for callback in callbacks:  # each a jaxstep.Callback: every hook can be called
        callback.on_fit_start(None, history)
    for t in range(STEPS):
        if t in RECOVERIES:
            history.recoveries.append(RECOVERIES[t])
            for callback in callbacks:
                callback.on_recovery(RECOVERIES[t])
        table = _table(t)
        history.append(table, {"accuracy": 0.5}, examples_per_sec=100.0)
        for callback in callbacks:
            callback.on_step_end(table)
    for callback in callbacks:
        callback.on_fit_end(history)
    return history


def test_the_records_read_as_the_line_each_display_shows():
    assert str(QUARANTINED) == QUARANTINED_TEXT
    assert str(EXCLUDED) == EXCLUDED_TEXT


def test_recovery_summary_counts_each_action_then_lists_the_records():
    history = _fit()
    assert history.recovery_summary().splitlines() == [
        "jaxstep: 2 recovery actions: 1 quarantined, 1 excluded (device 13)",
        f"  {QUARANTINED_TEXT}",
        f"  {EXCLUDED_TEXT}",
    ]


def test_recovery_summary_is_empty_without_recoveries():
    assert jaxstep.History(device_ids=IDS).recovery_summary() == ""


def test_progress_prints_each_recovery_when_taken_and_the_summary_at_the_end():
    out = io.StringIO()
    _fit(jaxstep.Progress(STEPS, every=1, live=False, file=out))
    lines = out.getvalue().splitlines()
    step_lines = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == [str(t) for t in range(STEPS)]
    # Each recovery among the step lines, before the step it recovered.
    assert lines.index(f"recovered at {QUARANTINED_TEXT}") == lines.index(step_lines[2]) - 1
    assert lines.index(f"recovered at {EXCLUDED_TEXT}") == lines.index(step_lines[4]) - 1
    # The count on each step's line, as the bar's other counts.
    assert "recovered" not in step_lines[1]
    assert "  recovered 1" in step_lines[3] and step_lines[3].endswith("recovered 1")
    assert step_lines[-1].endswith("recovered 2")
    assert lines[-3:] == [
        "jaxstep: 2 recovery actions: 1 quarantined, 1 excluded (device 13)",
        f"  {QUARANTINED_TEXT}",
        f"  {EXCLUDED_TEXT}",
    ]


def test_progress_says_nothing_of_recoveries_when_there_were_none():
    out = io.StringIO()
    progress = jaxstep.Progress(STEPS, live=False, file=out)
    history = jaxstep.History(device_ids=IDS)
    progress.on_fit_start(None, history)
    for t in range(STEPS):
        history.append(_table(t), examples_per_sec=100.0)
        progress.on_step_end(_table(t))
    progress.on_fit_end(history)
    assert "recover" not in out.getvalue()


def test_progress_counts_steps_not_tries_when_a_failed_step_runs_again_or_rolls_back():
    """Under recover a failed step's row (its state unchanged) is followed by the step
    again, and a rollback trains steps again: the count follows the step number."""
    out = io.StringIO()
    progress = jaxstep.Progress(4, every=1, live=False, file=out)
    history = jaxstep.History(device_ids=IDS)
    progress.on_fit_start(None, history)
    failed = _table(1)._replace(failed=True, halted=True)
    for table in [_table(0), failed, _table(1), _table(2), _table(1), _table(2), _table(3)]:
        history.append(table, examples_per_sec=100.0)
        progress.on_step_end(table)
    progress.on_fit_end(history)
    counts = [line.split()[2] for line in out.getvalue().splitlines()]
    assert counts == ["(1/4)", "(1/4)", "(2/4)", "(3/4)", "(2/4)", "(3/4)", "(4/4)"]


def test_progress_prints_recoveries_above_a_live_bar_and_counts_them_on_it():
    pytest.importorskip("rich")
    out = io.StringIO()
    _fit(jaxstep.Progress(STEPS, live=True, file=out))
    text = " ".join(out.getvalue().split())  # rich wraps at the console's width
    assert f"recovered at {QUARANTINED_TEXT}" in text
    assert f"recovered at {EXCLUDED_TEXT}" in text
    assert "recovered 2" in text and f"{STEPS}/{STEPS}" in text
    assert "jaxstep: 2 recovery actions: 1 quarantined, 1 excluded (device 13)" in text


def test_jsonl_has_a_recovery_line_before_the_step_it_recovered(tmp_path):
    path = tmp_path / "run.jsonl"
    _fit(jaxstep.JsonlWriter(path))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.get("event", "step") for r in lines] == [
        "step",
        "step",
        "recovery",
        "step",
        "step",
        "recovery",
        "step",
        "step",
        "goodput",  # when the run ended
    ]
    steps = [r for r in lines if "event" not in r]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert all("verdict" not in r for r in steps)  # step lines as they were
    assert lines[2] == {
        "event": "recovery",
        "step": 2,
        "verdict": "data",
        "action": "quarantined",
        "device_ids": [12],
        "examples": [40, 41],
        "skipped_batches": [],
        "batch": 2,
        "detail": "",
        "example_ids": [],
        "message": QUARANTINED_TEXT,
    }
    assert lines[5]["action"] == "excluded" and lines[5]["device_ids"] == [13]
    assert lines[5]["message"] == EXCLUDED_TEXT


def test_tensorboard_counts_recoveries_at_their_steps_and_writes_each_as_text(tmp_path):
    pytest.importorskip("tensorboardX")
    writer = jaxstep.TensorBoardWriter(tmp_path)
    _fit(writer)
    writer.close()
    scalars, texts = read_events(tmp_path)
    assert scalars["recoveries"] == {2: 1.0, 4: 2.0}
    assert sorted(scalars["loss"]) == list(range(STEPS))  # the steps as before
    (tag,) = [tag for tag in texts if tag.startswith("recovery")]
    assert texts[tag] == {2: QUARANTINED_TEXT, 4: EXCLUDED_TEXT}


def test_overview_marks_each_recovery_on_the_loss_panel_with_its_action():
    import matplotlib.pyplot as plt

    history = _fit()
    assert jaxstep.plot.marks(history)["recoveries"].tolist() == [2, 4]
    fig = jaxstep.plot.overview(history)
    heatmap, losses = fig.axes[0], fig.axes[1]
    lines = [line for line in losses.lines if line.get_gid() == "recoveries"]
    assert [line.get_xdata()[0] for line in lines] == [2, 4]
    assert all(line.get_linestyle() == "--" for line in lines)
    assert all(line.get_color() == jaxstep.plot.RECOVERY_COLOR for line in lines)
    labels = [text for text in losses.texts if text.get_gid() == "recovery-labels"]
    assert [text.get_text().strip() for text in labels] == ["quarantined", "excluded"]
    legend = [text.get_text() for text in losses.get_legend().get_texts()]
    assert legend.count("recovery") == 1
    assert not [line for line in heatmap.lines if line.get_gid() == "recoveries"]
    plt.close(fig)


def test_overview_has_no_recovery_marks_without_recoveries():
    import matplotlib.pyplot as plt

    history = jaxstep.History(device_ids=IDS)
    for t in range(STEPS):
        history.append(_table(t))
    assert jaxstep.plot.marks(history)["recoveries"].shape == (0,)
    fig = jaxstep.plot.overview(history)
    losses = fig.axes[1]
    assert not [line for line in losses.lines if line.get_gid() == "recoveries"]
    assert "recovery" not in [text.get_text() for text in losses.get_legend().get_texts()]
    plt.close(fig)


def test_overview_draws_a_step_run_again_as_a_column_per_try_labelled_with_its_step():
    """Under recover a failed step's row is followed by the step again: each row is a
    column in the order run, the failure and the recovery at the failed try."""
    import matplotlib.pyplot as plt

    history = jaxstep.History(device_ids=IDS)
    status = np.zeros(len(IDS), np.int32)
    status[2] = int(jaxstep.Status.GRAD_NONFINITE)
    failed = _table(2)._replace(status=status, failed=True, halted=True)
    for t, table in enumerate([_table(0), _table(1), failed, _table(2), _table(3)]):
        history.append(table, examples_per_sec=100.0)
        if t == 2:
            history.recoveries.append(jaxstep.Recovery(2, "transient", "retried", (IDS[2],)))
    assert jaxstep.plot.marks(history)["failures"].tolist() == [[2, IDS[2]]]
    fig = jaxstep.plot.overview(history)
    heatmap, losses = fig.axes[0], fig.axes[1]
    assert heatmap.images[0].get_array().shape == (len(IDS), 5)
    assert list(heatmap.images[0].get_extent()[:2]) == [-0.5, 4.5]  # a cell per column
    (cross,) = [c for c in heatmap.collections if c.get_gid() == "failures"]
    assert cross.get_offsets().tolist() == [[2.0, 2.0]]  # the failed try, device 12's row
    (line,) = [line for line in losses.lines if line.get_gid() == "recoveries"]
    assert line.get_xdata()[0] == 2
    fig.canvas.draw()
    labels = zip(losses.get_xticks(), losses.get_xticklabels(), strict=True)
    ticks = {round(x): text.get_text() for x, text in labels}
    assert ticks[3] == "2" and ticks[4] == "3"  # the retry is labelled with its step
    plt.close(fig)
