"""``fit(..., recover=jaxstep.Recover())`` on two processes x four fake CPU devices: every
process takes the same action at the same step and ends with the same parameters.

One ``python -m jaxstep.launch`` job (``tests/recover_child.py``) runs a clean fit,
three recovered ones, each with a fault on process 1's second device at step 2, and
three that go back: a loss spike in that device's chunk rolled back to a checkpoint,
its replica corrupted then repaired from the majority, and its replica moved inside a
fit call, rolled back to a checkpoint. Then the bad example again, with pre-split
batches that carry each example's id; after the device's exclusion, a bad example in
rows re-split across processes, a stop, and a resume inside a batch; last, the keys
left in the coordination service's store. The tests read what each process printed.
Device ids are read, never assumed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.models import PER_DEVICE
from tests.models import make_batches

ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / "tests" / "recover_child.py"
JOB_TIMEOUT = 300  # seconds, start-up and compiles included (~60 s here)
AT = 2  # the failing step
STEPS = 6  # the batches of a run

pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 60)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """``{(run, process): RESULT}`` of the job, and the folder its checkpoints went to."""
    base = tmp_path_factory.mktemp("recover")
    cmd = [sys.executable, "-m", "jaxstep.launch", "-n", "2", "--devices-per-process", "4"]
    cmd += ["--error-dir", str(base / "errors"), str(CHILD), str(base)]
    try:
        done = subprocess.run(
            cmd,
            cwd=str(ROOT),
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT,
            env={**os.environ, "CHILD_LOST_TIMEOUT": "6"},
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"job ran past {JOB_TIMEOUT} s:\n{str(err.stdout)[-4000:]}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    results = {}
    for line in output.splitlines():
        head, _, rest = line.partition("] ")
        if rest.startswith("RESULT "):
            got = json.loads(rest[len("RESULT ") :])
            results[got["run"], int(head[2:])] = got
    assert len(results) == 34, output[-6000:]
    return results, base


def _both(results, run):
    return results[run, 0], results[run, 1]


def _assert_close(a, b):
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-6, atol=1e-7, err_msg=key)


def test_a_transient_fault_on_process_1_is_retried_on_both_processes(job):
    results, _ = job
    clean, _ = _both(results, "clean")
    p0, p1 = _both(results, "transient")
    target = p1["target"]
    assert target == clean["devices"][5] >= 2048  # process 1's second device, by its id
    for seen in (p0, p1):
        (record,) = seen["recoveries"]
        assert (record["step"], record["verdict"], record["action"]) == (AT, "transient", "retried")
        assert (record["device_ids"], record["batch"]) == ([target], AT)
        assert seen["history_step"] == [0, 1, 2, 2, 3, 4, 5]  # step 2 failed, then ran again
        assert seen["step"] == 6 and seen["left_over"] == []
    assert p0["recoveries"] == p1["recoveries"]
    # the same parameters on both processes, bit for bit those of the clean run
    assert p0["params"] == p1["params"] == clean["params"]


def test_a_data_fault_on_process_1_is_quarantined_on_both_processes(job):
    results, _ = job
    p0, p1 = _both(results, "data")
    target = results["transient", 1]["target"]
    example = 5 * PER_DEVICE + 1  # example 1 of chunk 5 (the target's), found by process 1
    for seen in (p0, p1):
        (record,) = seen["recoveries"]
        assert (record["step"], record["verdict"], record["action"]) == (AT, "data", "quarantined")
        assert record["device_ids"] == [target] and record["examples"] == [example]
        assert record["batch"] == AT
        assert seen["dropped"] == [[], [], [], [target], [], [], []]  # the step run again
        assert seen["quarantine"] == {str(AT): [example]}  # written once, by process 0
    assert p0["recoveries"] == p1["recoveries"]
    assert p0["params"] == p1["params"]
    # the update of a step that leaves the failing chunk out of its mean
    _assert_close(p0["params"], p0["reference"])


def test_a_device_of_process_1_that_keeps_failing_is_excluded_and_every_row_trained(job):
    results, base = job
    clean, _ = _both(results, "clean")
    p0, p1 = _both(results, "device")
    target = p1["target"]
    rest = [d for d in clean["devices"] if d != target]
    for seen in (p0, p1):
        (record,) = seen["recoveries"]
        assert (record["step"], record["verdict"], record["action"]) == (AT, "device", "excluded")
        assert record["device_ids"] == [target] and record["batch"] == AT
        assert "every process's, are re-split over them" in record["detail"]
        assert seen["devices"] == rest  # 7 devices, the same on both processes
        assert seen["history_step"] == [0, 1, 2, 2, 3, 4, 5]
        assert seen["step"] == 6
        # Every row of batches 2..5 (128) trained but 2: the steps took 28, 35, 28 and
        # 35 rows of every process's rows together; the last 2 rows of batch 5 (rows
        # process 1 passed) are fewer than the 7 a step needs
        assert seen["left_over"] == [[5, 30, 32]]
        (warning,) = seen["warnings"]
        assert "2 row(s) carried after a device left the run were not trained" in warning
    assert p0["recoveries"] == p1["recoveries"]
    assert p0["params"] == p1["params"]
    # two steps on 8 devices, then the 7 others on every row, re-split (1e-6: the same
    # steps on the same rows as a fit on 7 devices given those batches)
    _assert_close(p0["params"], p0["reference"])
    # the checkpoint of step 4: 7 devices, the same data position on every process, the
    # first row not trained (batch 3's last, carried into step 4)
    meta = json.loads((base / "device" / "4" / "meta" / "metadata").read_text())
    assert meta["device_ids"] == rest
    positions = {p: (d["index"], d["rows"]) for p, d in meta["data_by_process"].items()}
    assert positions == {"0": (3, 31), "1": (3, 31)}


def test_global_batches_train_the_same_steps_after_the_exclusion_with_no_row_gathered(job):
    """``fit(global_batches=True)``: every process reads each batch whole; after the
    exclusion each takes the rows it trains from its own copy: the device run's steps,
    records and checkpoints, bit for bit."""
    results, base = job
    device, _ = _both(results, "device")
    p0, p1 = _both(results, "global")
    for seen in (p0, p1):
        for key in ("params", "devices", "history_step", "recoveries", "left_over", "step"):
            assert seen[key] == device[key], key
        (warning,) = seen["warnings"]
        assert "2 row(s) carried after a device left the run were not trained" in warning
    meta = json.loads((base / "global" / "4" / "meta" / "metadata").read_text())
    positions = {p: (d["index"], d["rows"]) for p, d in meta["data_by_process"].items()}
    assert positions == {"0": (3, 31), "1": (3, 31)}


def test_a_bad_example_after_the_exclusion_is_named_by_its_row_on_both_processes(job):
    results, _ = job
    p0, p1 = _both(results, "resplit")
    bad = p1["bad"]  # process 1's first device: at step 4 it holds batch 4's rows 15..18
    for seen in (p0, p1):
        excluded, quarantined = seen["recoveries"]
        assert excluded["action"] == "excluded" and excluded["device_ids"] == [p1["target"]]
        assert (quarantined["step"], quarantined["verdict"]) == (4, "data")
        assert quarantined["action"] == "quarantined" and quarantined["device_ids"] == [bad]
        # its example 0 (the step's example 16, as 7 x 4 rows): after batch 3's last
        # row carried, row 15 of batch 4, a row process 0 passed
        assert quarantined["batch"] == 4 and quarantined["examples"] == [16]
        assert "(in the data: batch 4 rows [15])" in quarantined["detail"]
        assert seen["quarantine"] == {"4": [15]}
        assert seen["history_step"] == [0, 1, 2, 2, 3, 4, 4, 5]
        assert seen["step"] == 6 and seen["left_over"] == [[5, 30, 32]]
    assert p0["recoveries"] == p1["recoveries"]
    assert p0["params"] == p1["params"]


def test_bucketed_rows_after_the_exclusion_wait_for_a_batch_of_their_shape(job):
    """Widths 16 and 24 alternate, 32 rows a batch: on the 7 devices left each width's
    rows wait for its next batch, every process's together: 28, 28, 35, 35, ... rows,
    6 of each width left at the end (the one-process run's figures)."""
    results, _ = job
    p0, p1 = _both(results, "buckets")
    assert p0["sizes"] == [28, 28, 35, 35, 28, 28, 35, 35, 28, 28]
    for seen in (p0, p1):
        assert [r["action"] for r in seen["recoveries"]] == ["excluded"]
        assert seen["left_over"] == [[10, 26, 32], [11, 26, 32]]
        assert seen["history_step"][3:] == list(range(2, 12))
    assert p0["params"] == p1["params"]
    _assert_close(p0["params"], p0["reference"])


def test_a_stop_after_the_exclusion_hands_each_process_its_own_rows_not_trained(job):
    results, _ = job
    p0, p1 = _both(results, "stop")
    assert p0["trained"] == p1["trained"] >= 4  # stopped at the end of step 3 or later
    later = make_batches(STEPS)[AT:]
    # the steps after the exclusion took 28, 35, 28, ... rows of every process's rows,
    # in the data's order: the rows after them were not trained
    sizes = [28, 35, 28, 35][: p0["trained"] - AT]
    rows = np.concatenate([b["x"][:, 0] for b in later])
    untrained = rows[sum(sizes) :]
    handed = p0["handed"] + p1["handed"]
    assert sorted(handed) == sorted(untrained[: len(handed)].tolist()) and handed
    # each process holds the rows it passed (of each global batch, process p's rows are
    # p * 16 .. p * 16 + 15), none of the other's
    for p, seen in enumerate((p0, p1)):
        own = {float(x) for b in later for x in b["x"][16 * p : 16 * (p + 1), 0]}
        assert set(seen["handed"]) <= own


def test_a_stop_on_global_batches_hands_every_process_every_row_not_trained(job):
    results, _ = job
    p0, p1 = _both(results, "global stop")
    assert p0["trained"] == p1["trained"] >= 4
    later = make_batches(STEPS)[AT:]
    sizes = [28, 35, 28, 35][: p0["trained"] - AT]
    untrained = np.concatenate([b["x"][:, 0] for b in later])[sum(sizes) :]
    # as given: the whole batches' rows, the same on both processes, in the data's order
    assert p0["handed"] == p1["handed"] == untrained.tolist()


def test_a_position_inside_a_batch_resumes_on_every_device_with_the_rows_re_split(job):
    results, _ = job
    p0, p1 = _both(results, "resume")
    for seen in (p0, p1):
        assert seen["devices"] == results["clean", 0]["devices"]  # all 8 again
        assert seen["history_step"] == [4, 5]  # batch 3's last row + batch 4; the rest
        assert seen["step"] == 6 and seen["left_over"] == [[5, 31, 32]]
    assert p0["params"] == p1["params"]
    _assert_close(p0["params"], p0["reference"])


def test_a_restart_told_until_step_reaches_it_exactly_from_rows_carried(job):
    """Issue 45, item 1, on two processes: the checkpoint was written while rows were
    carried (a device of process 1 had left); the restarted job reaches step 10."""
    results, _ = job
    p0, p1 = _both(results, "until")
    for seen in (p0, p1):
        assert seen["step"] == 10 and seen["history_step"] == list(range(5, 10))
        assert not [w for w in seen["warnings"] if "data ended" in w], seen["warnings"]
    assert p0["params"] == p1["params"]
    for seen in _both(results, "until again"):
        assert seen["step"] == 10 and seen["history_step"] == []


def test_a_loss_spike_on_process_1_rolls_both_processes_back_to_the_same_checkpoint(job):
    results, _ = job
    p0, p1 = _both(results, "spike")
    target = p1["target"]
    for seen in (p0, p1):
        (record,) = seen["recoveries"]
        assert (record["step"], record["verdict"], record["action"]) == (6, "spike", "rolled back")
        assert record["device_ids"] == [target]  # only its chunk spiked; process 0 knows it too
        assert (record["skipped_batches"], record["batch"], record["examples"]) == ([5, 6], 6, [])
        assert record["detail"] == (
            "restored the checkpoint of step 4; 1 batch(es) since it trained again"
        )
        # steps 0..6 ran, the spike at 6 sent both back to 4: batch 4 again, then 7
        assert seen["history_step"] == [0, 1, 2, 3, 4, 5, 6, 4, 5]
        assert seen["loss"][7] == seen["loss"][4]  # the same batch from the restored state
        assert seen["step"] == 6 and seen["left_over"] == [] and seen["warnings"] == []
    assert p0["recoveries"] == p1["recoveries"]
    # Bit for bit a run without batches 5 and 6: the checkpoint holds the state exactly
    # (float32 as written), and the same program trains the same batches in order.
    assert p0["params"] == p1["params"] == p0["reference"] == p1["reference"]


def test_a_corrupted_replica_on_process_1_is_repaired_the_same_way_on_both_processes(job):
    results, _ = job
    clean, _ = _both(results, "clean")
    p0, p1 = _both(results, "diverged")
    target = p1["target"]
    for seen in (p0, p1):
        (record,) = seen["recoveries"]
        assert (record["step"], record["verdict"], record["action"]) == (3, "diverged", "repaired")
        assert record["device_ids"] == [target]  # the healthy seven are not blamed
        assert (record["skipped_batches"], record["examples"]) == ([], [])
        assert record["batch"] == 0  # counted from the first batch this fit was given
        assert seen["history_step"] == [3, 3, 4, 5]  # step 3 failed, then ran again
        assert seen["step"] == 6 and seen["left_over"] == []
        assert seen["replicas_agree"]  # on process 1 the target's copy too
    assert p0["recoveries"] == p1["recoveries"]
    # every replica again equal, bit for bit those of the clean run (a one-ulp corruption
    # caught before it trained, and the divergence check does not touch the update)
    assert p0["params"] == p1["params"] == clean["params"]


def test_a_replica_moved_inside_a_fit_call_rolls_both_processes_back_to_the_same_checkpoint(job):
    results, _ = job
    p0, p1 = _both(results, "rollback")
    target = p1["target"]
    assert p1["moved"] and not p0["moved"]  # only process 1 holds the target's replica
    for seen in (p0, p1):
        (record,) = seen["recoveries"]
        what = (record["step"], record["verdict"], record["action"])
        assert what == (5, "diverged", "rolled back")
        assert record["device_ids"] == [target]  # the healthy seven are not blamed
        assert record["detail"] == (
            "restored the checkpoint of step 4; 2 batch(es) since it trained again"
        )
        # moved at step 4, seen by step 5's replica check: back to 4, batches 4 and 5 again
        assert seen["history_step"] == [0, 1, 2, 3, 4, 5, 4, 5]
        assert seen["step"] == 6 and seen["replicas_agree"]
    assert p0["recoveries"] == p1["recoveries"]
    # bit for bit a run whose replica never moved
    assert p0["params"] == p1["params"] == p0["reference"] == p1["reference"]


def test_pre_split_batches_are_quarantined_by_id_on_both_processes(job):
    results, _ = job
    data, _ = _both(results, "data")
    p0, p1 = _both(results, "presplit")
    target = results["transient", 1]["target"]
    example = 5 * PER_DEVICE + 1  # example 1 of chunk 5 (the target's), in process 1's rows
    for seen in (p0, p1):
        (record,) = seen["recoveries"]
        assert (record["step"], record["verdict"], record["action"]) == (AT, "data", "quarantined")
        assert (record["device_ids"], record["examples"]) == ([target], [example])
        assert record["example_ids"] == [1000 * AT + example]  # process 0 learns it too
        assert seen["history_step"] == [0, 1, 2, 2, 3, 4, 5]
        (line,) = seen["quarantine"]  # written once, by process 0
        assert (line["batch"], line["examples"]) == (AT, [example])
        assert line["ids"] == record["example_ids"]
        assert (line["example_id"], line["fit_start"]) == ("id", 0)
    # the same training as the flat batches' run, bit for bit
    assert p0["params"] == p1["params"] == data["params"]


def test_a_run_leaves_no_key_behind_in_the_coordination_service(job):
    """After eight fits, with retries, quarantines (their replays share examples),
    an exclusion, rollbacks (the writer publishes the newest checkpoint), checkpoints
    (each process publishes its data position) and restores (the processes agree):
    only the keys each process sets once and overwrites in place are left."""
    results, _ = job
    p0, p1 = _both(results, "keys")
    fixed = ["jaxstep/alive/0", "jaxstep/alive/1", "jaxstep/host/0", "jaxstep/host/1"]
    assert p0["keys"] == p1["keys"] == fixed
