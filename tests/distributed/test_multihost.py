"""Two processes x four fake CPU devices under ``python -m jaxstep.launch``: one verdict
on every process, a lost process named, error reports, checkpoints written by one
process with every process's data position (an emergency save even after a peer is
lost, a resume on two processes), and ``scripts/tpu_vm/train.py``.

Process start-up costs seconds on a small machine, so the four jobs start together
(one module fixture) and each test waits for its own; every job has a hard timeout.
Process 1's devices have ids 2048..2051 on this JAX: ids are read, never assumed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxstep
from jaxstep._src.step import runtime_of
from jaxstep.distributed import reports
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches

ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / "tests" / "multihost_child.py"
TRAIN = ROOT / "scripts" / "tpu_vm" / "train.py"
LOST_TIMEOUT = 6.0  # the children's lost_timeout (CHILD_LOST_TIMEOUT)
JOB_TIMEOUT = 240  # seconds for one job, start-up and compile included
CKPT = ("nan", "kill")  # the jobs that checkpoint
TRAIN_ARGS = ["--steps", "4", "--per-device", "4", "--hidden", "16", "--log-every", "1"]
HSDP_TP = ["--model-parallel", "2", "--shard-state", "params", "--replicas", "2"]
HSDP_TP += ["--shard-min-size", "0"]

pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 60)


#: gloo's own abort when a peer process leaves in the middle of a message
#: (docs/multihost.md, "Not done"): C++ kills the survivor before any Python runs, so
#: nothing of jaxstep's is tested by such a run; the job is run once more
GLOO_ABORT = "gloo::EnforceNotMet"


class Job:
    """One ``python -m jaxstep.launch -n 2`` run, started at once, read when waited for.
    A run that gloo aborted (:data:`GLOO_ABORT`) is started again once, its error
    directory and ``scratch`` (a checkpoint directory) emptied first."""

    def __init__(self, args: list[str], error_dir: Path, scratch: Path | None = None):
        self.args, self.error_dir, self.scratch = args, error_dir, scratch
        self.retried = False
        self._start()

    def _start(self) -> None:
        args, error_dir = self.args, self.error_dir
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "jaxstep.launch", "-n", "2", "--devices-per-process", "4"),
                *("--error-dir", str(error_dir), "--grace", "60", *args),
            ],
            cwd=str(ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "CHILD_LOST_TIMEOUT": str(LOST_TIMEOUT)},
        )
        self.output: str | None = None

    def wait(self) -> Job:
        if self.output is None:
            try:
                self.output, _ = self.proc.communicate(timeout=JOB_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.output, _ = self.proc.communicate()
                pytest.fail(f"job ran past {JOB_TIMEOUT} s:\n{self.output[-4000:]}")
            self.seconds = time.monotonic() - self.started
            if GLOO_ABORT in self.output and not self.retried:
                self.retried = True
                for folder in (self.error_dir, self.scratch):
                    if folder is not None:
                        shutil.rmtree(folder, ignore_errors=True)
                self._start()
                self.output = None
                return self.wait()
        return self

    def left_on_their_own(self) -> bool:
        """No process had to be stopped by the launcher (after its grace period)."""
        return "[launch] stopping" not in (self.output or "")

    def results(self) -> dict[int, dict]:
        """The ``RESULT {json}`` line of each process, by process index."""
        out = {}
        for line in (self.output or "").splitlines():
            head, _, rest = line.partition("] ")
            if rest.startswith("RESULT "):
                out[int(head[2:])] = json.loads(rest[len("RESULT ") :])
        return out

    def tail(self) -> str:
        return (self.output or "")[-6000:]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    base = tmp_path_factory.mktemp("multihost")
    modes = ("nan", "kill", "raise", "stall")
    # nan and kill checkpoint every 2 steps into a directory the two processes share.
    started = {
        mode: Job(
            [str(CHILD), mode, *([str(base / f"ckpt-{mode}")] * (mode in CKPT))],
            base / mode,
            base / f"ckpt-{mode}" if mode in CKPT else None,
        )
        for mode in modes
    }
    started["base"] = base  # type: ignore[assignment]
    started["train"] = Job(
        [
            *(str(TRAIN), *TRAIN_ARGS, "--save-params", str(base / "params.npz")),
            *("--checkpoint-dir", str(base / "ckpt-train"), "--checkpoint-every", "2"),
        ],
        base / "train",
    )
    started["train"].params_path = base / "params.npz"  # type: ignore[attr-defined]
    started["sharded"] = Job(
        [str(CHILD), "sharded", str(base / "ckpt-sharded"), str(base / "sharded.npz")],
        base / "sharded",
    )
    # tensor parallelism inside each process: model groups of 2 chips, a NaN on 2049
    started["model"] = Job(
        [
            *(str(TRAIN), *TRAIN_ARGS, "--model-parallel", "2"),
            *("--fault-step", "2", "--fault-device", str(2048 + 1)),
        ],
        base / "model",
    )
    # a device fault on one chip of a model group, diagnosed among process 1's groups
    started["chip"] = Job([str(CHILD), "chip"], base / "chip")
    # HSDP x TP: a replica group of two model groups on each process, twins across them
    started["hsdp_tp"] = Job(
        [*(str(TRAIN), *TRAIN_ARGS, *HSDP_TP), "--save-params", str(base / "hsdp_tp.npz")],
        base / "hsdp_tp",
    )
    yield started
    for job in started.values():
        if isinstance(job, Job) and job.proc.poll() is None:
            job.proc.kill()
            job.proc.communicate()


def test_nan_on_process_1_raises_the_same_error_on_both_processes(jobs):
    job = jobs["nan"].wait()
    res = job.results()
    assert set(res) == {0, 1}, job.tail()
    target = res[1]["target"]
    assert target == res[1]["held"][1] >= 2048  # process 1's second device, by its real id
    for p in (0, 1):
        assert res[p]["raised"], job.tail()
        assert res[p]["device_id"] == target
        assert res[p]["ids"] == [target]  # the healthy devices are not blamed
        assert res[p]["process_index"] == 1
        assert res[p]["host"] == socket.gethostname()
        assert res[p]["step"] == 3
        assert res[p]["status"] == int(jaxstep.Status.INPUT_NONFINITE)
        untrained = res[p]["untrained"]  # fit(prefetch=3): nothing pulled is lost
        assert untrained == list(range(3, 3 + len(untrained))) and len(untrained) >= 2
    assert res[0]["message"] == res[1]["message"]
    # where the time went, the same on both (process 0's spans): 3 steps kept, 1 failed
    assert res[0]["goodput"] == res[1]["goodput"]
    assert res[0]["goodput"]["steps"]["productive"] == 3
    assert res[0]["goodput"]["steps"]["failed"] == 1
    assert res[0]["message"].startswith(f"training worker on device {target} failed: ")
    assert f"(process 1, host {socket.gethostname()})" in res[0]["message"]
    assert job.proc.returncode == 1 and job.left_on_their_own(), job.tail()
    assert "[launch] process 0 exited with exit code 1" in job.output
    assert "[launch] process 1 exited with exit code 1" in job.output
    rejected = res[0]["rejected"]
    assert "backend='pmap' with devices of several processes" in rejected["pmap"]
    assert "does not divide by the 4 devices of this process" in rejected["rows"]
    assert "process 0 writes the checkpoints" in res[1]["rejected"]["local_checkpoint"]
    assert res[0]["rejected"]["presplit_joins"] and res[1]["rejected"]["presplit_joins"]


def test_error_reports_one_per_process_root_cause_marked(jobs):
    job = jobs["nan"].wait()
    found = reports.read(job.error_dir)
    assert sorted(found) == [0, 1], job.tail()
    target = job.results()[1]["target"]
    for p, report in found.items():
        assert report["process_index"] == p
        assert report["pid"] == job.results()[p]["pid"]
        assert report["host"] == socket.gethostname()
        assert report["device_id"] == target
        assert report["device_process_index"] == 1
        assert report["step"] == 3
        assert report["status"] == "INPUT_NONFINITE"
        assert report["root_cause_process"] == 1
        assert "TrainingWorkerError" in report["traceback"]
        assert report["time"] > 0
    # The failing device is process 1's: its report is the root cause, and only it.
    assert found[1]["root_cause"] is True
    assert found[0]["root_cause"] is False
    assert reports.root_cause(job.error_dir)["process_index"] == 1


def test_sigkilled_process_is_named_by_the_other_within_the_timeout(jobs):
    job = jobs["kill"].wait()
    res = job.results()
    assert set(res) == {0}, job.tail()  # process 1 died without a word
    survivor = res[0]
    assert survivor["raised"], job.tail()
    assert survivor["process_index"] == 1
    assert survivor["ids"] == survivor["held"]  # every device of process 1
    assert min(survivor["held"]) >= 2048
    assert survivor["status"] == int(jaxstep.Status.HUNG)
    assert survivor["step"] == 4  # the step it waited for (step 3 finished before the kill)
    assert "process 1 is lost" in survivor["message"]
    # Named within the documented timeout of the kill (lost_timeout plus one heartbeat
    # interval), with room for a busy machine.
    waited = survivor["at"] - res_kill_time(job)
    assert LOST_TIMEOUT - 1 < waited < LOST_TIMEOUT + 20, waited
    assert job.proc.returncode == 128 + 9  # the first failure: process 1, SIGKILL
    assert job.left_on_their_own(), job.tail()
    found = reports.read(job.error_dir)
    assert sorted(found) == [0, 1]
    assert found[0]["root_cause"] is False and found[0]["root_cause_process"] == 1
    assert found[1]["root_cause"] is True  # written by the launcher for the silent death
    assert "SIGKILL" in found[1]["reason"]


def res_kill_time(job: Job, what: str = "KILLING") -> float:
    for line in (job.output or "").splitlines():
        if line.startswith(f"[p1] {what} "):
            return float(line.split()[-1])
    raise AssertionError(f"process 1 did not print {what}:\n" + job.tail())


def test_python_error_on_one_process_stops_the_other_at_once(jobs):
    # jax#11987: one process raises, the other must not wait in the next collective.
    job = jobs["raise"].wait()
    res = job.results()
    assert set(res) == {0}, job.tail()
    survivor = res[0]
    assert survivor["raised"] and survivor["status"] == int(jaxstep.Status.HUNG)
    assert survivor["ids"] == survivor["held"] and survivor["process_index"] == 1
    assert "its process 1 is lost: it failed: ValueError: bad record" in survivor["message"]
    # Told through the store at the next heartbeat, not after lost_timeout.
    assert survivor["at"] - res_kill_time(job, "RAISING") < LOST_TIMEOUT, job.tail()
    found = reports.read(job.error_dir)
    assert found[1]["exception"] == "ValueError" and found[1]["root_cause"] is True
    assert found[0]["root_cause"] is False and found[0]["root_cause_process"] == 1
    assert job.proc.returncode == 1 and job.left_on_their_own(), job.tail()


def test_stalled_device_on_process_1_is_named_by_both(jobs):
    job = jobs["stall"].wait()
    res = job.results()
    assert set(res) == {0, 1}, job.tail()
    target = res[1]["target"]
    for p in (0, 1):
        assert res[p]["device_id"] == target
        assert res[p]["ids"] == [target]  # the other seven reached the collective
        assert res[p]["process_index"] == 1
        assert res[p]["step"] == 3
        assert res[p]["status"] == int(jaxstep.Status.HUNG)
    assert res[0]["message"] == res[1]["message"]
    assert job.left_on_their_own(), job.tail()
    found = reports.read(job.error_dir)
    assert sorted(found) == [0, 1]
    assert [p for p, r in found.items() if r["root_cause"]] == [1]


def _train_script():
    """scripts/tpu_vm/train.py as a module (its ``train`` runs on this process's 8)."""
    spec = importlib.util.spec_from_file_location("tpu_vm_train", TRAIN)
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    return train


def test_tpu_vm_train_py_on_two_processes_matches_one_process_of_eight(jobs):
    job = jobs["train"].wait()
    assert job.proc.returncode == 0, job.tail()
    assert "[p1] [process 1] finished 4 steps" in job.output
    train = _train_script()
    step, state = train.train(train.parse(TRAIN_ARGS), jax.devices())
    here = runtime_of(step).read_at(step.host_state(state).params, 0)
    saved = np.load(job.params_path)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(here)}
    assert sorted(saved.files) == sorted(flat)
    for name, value in flat.items():
        np.testing.assert_allclose(saved[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    # fit's verified checkpoints, written once with both processes' data positions.
    where = jobs["base"] / "ckpt-train"
    # 4: the run's end; goodput.jsonl: the run's time, written by process 0 alone
    assert sorted(p.name for p in where.iterdir()) == ["0", "2", "4", "goodput.jsonl"]
    record = [json.loads(x) for x in (where / "goodput.jsonl").read_text().splitlines()]
    assert [r["n"] for r in record if "n" in r] == [0, 1, 2, 3]  # each step once
    # every process reports the same figures (process 0's clock), steps counted alike
    said = {
        p: line.split("] goodput ", 1)[1]
        for p in (0, 1)
        for line in job.output.splitlines()
        if line.startswith(f"[p{p}] ") and "] goodput " in line
    }
    assert said[0] == said[1] and "'productive': 4" in said[0], job.tail()
    for number in (2, 4):
        meta = json.loads((where / str(number) / "meta" / "metadata").read_text())
        assert meta["verified"] and sorted(meta["data_by_process"]) == ["0", "1"]
    # Training moved the weights, so agreeing is not agreeing on the initial values.
    _, first = train.build(train.parse(TRAIN_ARGS), jax.devices())
    start = runtime_of(step).read_at(first.params, 0)
    pairs = zip(jax.tree.leaves(start), jax.tree.leaves(here), strict=True)
    assert not all(np.allclose(a, b) for a, b in pairs)


def test_replica_groups_of_model_groups_on_two_processes_match_one_process_of_eight(jobs):
    """model_parallel=2, shard_state='params', replicas=2 on 2 processes of 4: each
    process holds one replica group (two model groups), every block's twin on the other
    process; the parameters equal one process of eight's."""
    job = jobs["hsdp_tp"].wait()
    assert job.proc.returncode == 0, job.tail()
    assert "[p1] [process 1] finished 4 steps" in job.output
    train = _train_script()
    step, state = train.train(train.parse([*TRAIN_ARGS, *HSDP_TP]), jax.devices())
    assert state.params["dense1"]["kernel"].sharding.mesh.axis_names == ("data", "fsdp", "model")
    here = step.host_state(state).params
    saved = np.load(jobs["base"] / "hsdp_tp.npz")
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(here)}
    assert sorted(saved.files) == sorted(flat)
    for name, value in flat.items():
        np.testing.assert_allclose(saved[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_model_group_on_process_1_is_named_alike_by_both_processes(jobs):
    job = jobs["model"].wait()
    assert job.proc.returncode != 0, job.tail()
    first = (
        "training worker on device 2048 failed: non-finite input in ['image'] (with "
        "non-finite loss, non-finite gradient in ['dense1']['kernel']) at step 2 (process 1, "
    )
    for p in (0, 1):
        lines = [x for x in job.output.splitlines() if x.startswith(f"[p{p}] ") and first in x]
        assert lines and lines[0].endswith("model group: devices 2048, 2049)"), job.tail()
    assert "examples per step, model groups of 2" in job.output
    report = json.loads((jobs["base"] / "model" / "error-p0.json").read_text())
    assert report["device_id"] == 2048 and report["step"] == 2
    assert report["failures"][0]["group"] == [2048, 2049]


def test_a_device_fault_on_one_chip_of_a_model_group_is_named_by_both_processes(jobs):
    """Model groups of 2 inside each process: the diagnosis rotates the model positions
    among process 1's two groups (its rows stay on its devices) and both processes name
    the chip the fault follows, at model position 1 and at 0."""
    job = jobs["chip"].wait()
    res = job.results()
    assert set(res) == {0, 1}, job.tail()
    assert res[0]["chips"] == res[1]["chips"]
    at_1, at_0 = (res[0]["chips"][str(d)] for d in (2049, 2050))
    assert at_1["group"] == [2048, 2049] and at_0["group"] == [2050, 2051]
    for seen, chip in ((at_1, 2049), (at_0, 2050)):
        assert seen["verdict"] == "device" and seen["chip"] == chip, seen
        assert any(f"it follows device {chip}" in line for line in seen["evidence"]), seen
    said = " ".join(at_1["evidence"])
    assert "device 2049 moved to the group of device 2050) the failure moved with it" in said
    assert "stayed with device 2050 (model position 0)" in " ".join(at_0["evidence"])


# ------------------------------------------------------------ checkpoints
def _reference(steps: int):
    """This process, 8 devices: the children's step trained on the first ``steps``
    global batches (what both processes together computed)."""
    from tests.models import init_params
    from tests.models import loss_fn
    from tests.models import make_batches

    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), divergence_every=2)
    state = jaxstep.fit(step, step.init(init_params()), make_batches(8)[:steps])
    return step, state


def _assert_params_close(step, a, b):
    pa, pb = (runtime_of(step).read_at(step.host_state(s).params, 0) for s in (a, b))
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_checkpoints_of_two_processes_hold_every_position_and_restore_on_one(jobs):
    from jaxstep._src.checkpoint._emergency import read_emergency
    from tests.models import make_batches

    job = jobs["nan"].wait()
    where = jobs["base"] / "ckpt-nan"
    res = job.results()
    # Verified checkpoints at 0 and 2, each written once (by process 0), complete.
    names = sorted(p.name for p in where.iterdir())
    assert names == ["0", "2", "emergency", "goodput.jsonl"], job.tail()
    record = [json.loads(x) for x in (where / "goodput.jsonl").read_text().splitlines()]
    assert [(r["n"], r["o"]) for r in record if "n" in r][-1] == (3, "failed")
    meta = json.loads((where / "2" / "meta" / "metadata").read_text())
    assert meta["verified"] and meta["process_count"] == 2 and meta["step"] == 2
    assert {p: d["index"] for p, d in meta["data_by_process"].items()} == {"0": 2, "1": 2}
    # Any device count restores it: here one process of 8 devices.
    step, two = _reference(2)
    _assert_params_close(step, jaxstep.restore(step, where), two)
    # The emergency save: one path for both processes (the same message), the state
    # written once, each process's own rows of the failing batch and its report.
    path = res[0]["checkpoint"]
    assert path == res[1]["checkpoint"] == str(where / "emergency" / "step_3")
    half = len(jax.tree.leaves(make_batches(8)[3])[0]) // 2
    for p, rows in ((0, slice(None, half)), (1, slice(half, None))):
        saved = read_emergency(path, process=p)
        assert saved.step == 3
        for got, want in zip(
            jax.tree.leaves(saved.batch), jax.tree.leaves(make_batches(8)[3]), strict=True
        ):
            np.testing.assert_array_equal(got, want[rows])
        assert saved.report["process_index"] == p and saved.report["device_id"] == res[1]["target"]
        assert saved.report["root_cause"] is (p == 1)
    _, three = _reference(3)
    _assert_params_close(step, jaxstep.restore(step, path), three)


def test_lost_process_still_gets_an_emergency_save_and_two_processes_resume(jobs):
    from jaxstep._src.checkpoint._emergency import read_emergency
    from tests.models import make_batches

    job = jobs["kill"].wait()
    where = jobs["base"] / "ckpt-kill"
    survivor = job.results()[0]
    # Process 1 is gone: process 0 alone saves its rows and names the checkpoint.
    assert survivor["checkpoint"] == str(where / "emergency" / "step_4"), job.tail()
    assert f"the latest verified checkpoint is step 2 ({where / '2'})" in survivor["note"]
    saved = read_emergency(survivor["checkpoint"], process=0)
    half = len(jax.tree.leaves(make_batches(8)[4])[0]) // 2
    for got, want in zip(
        jax.tree.leaves(saved.batch), jax.tree.leaves(make_batches(8)[4]), strict=True
    ):
        np.testing.assert_array_equal(got, want[:half])
    with pytest.raises(ValueError, match="holds no state"):
        jaxstep.restore(
            jaxstep.make_train_step(lambda p, b: 0.0, optax.sgd(0.1)), survivor["checkpoint"]
        )
    # Both processes resume from step 2 (each at its own data position) and finish:
    # the same parameters as one uninterrupted run.
    params = jobs["base"] / "resumed.npz"
    resumed = Job([str(CHILD), "resume", str(where), str(params)], jobs["base"] / "resume").wait()
    assert resumed.proc.returncode == 0, resumed.tail()
    assert {p: r["step"] for p, r in resumed.results().items()} == {0: 8, 1: 8}
    step, full = _reference(8)
    saved_params = np.load(params)
    here = runtime_of(step).read_at(step.host_state(full).params, 0)
    for key, value in jax.tree_util.tree_leaves_with_path(here):
        np.testing.assert_allclose(
            saved_params[jax.tree_util.keystr(key)], value, rtol=1e-5, atol=1e-6
        )


def test_a_sharded_state_on_two_processes_of_four_equals_one_process_of_eight(jobs):
    # Both layouts: the error is the same on both processes; each process wrote its own
    # shards of every checkpoint and of the emergency save, which restore whole (on two
    # processes, and here on one of eight); the rest trained from the checkpoint ends
    # where one process of eight ends.
    job = jobs["sharded"].wait()
    assert job.proc.returncode == 0, job.tail()
    res = job.results()
    assert set(res) == {0, 1}, job.tail()
    saved = np.load(jobs["base"] / "sharded.npz")
    # "params-r2": replicas=2, one group on each process (each shard's twin on the other)
    for label in ("optimizer", "params", "params-r2"):
        layout = label.split("-")[0]
        errors = [res[p]["errors"][label] for p in (0, 1)]
        assert errors[0]["message"] == errors[1]["message"]
        assert (errors[0]["device_id"], errors[0]["step"]) == (res[1]["target"], 3)
        assert errors[0]["status"] & int(jaxstep.Status.INPUT_NONFINITE)
        where = jobs["base"] / "ckpt-sharded" / label
        assert sorted(p.name for p in (where / "blocks").iterdir()) == ["0", "2"]
        step = jaxstep.make_train_step(
            loss_fn, optax.adam(1e-2), shard_state=layout, shard_min_size=0
        )
        for name, steps in (("emergency", 3), ("latest", 2), ("resumed", 8)):
            want = jaxstep.fit(step, step.init(init_params()), make_batches(8)[:steps])
            flat = jax.tree_util.tree_leaves_with_path(jax.device_get(want.params))
            for key, value in flat:
                got = saved[f"{label}/{name}{jax.tree_util.keystr(key)}"]
                # the job output (a restore that passed over a checkpoint warns there)
                msg = f"{label}/{name}: {job.tail()[-3000:]}"
                np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-6, err_msg=msg)
        here = jaxstep.restore(step, where)  # two processes' shards, on one of eight
        assert here.opt_state[0].mu["dense1"]["kernel"].sharding.spec == P(None, "devices")


# ------------------------------------------------ in-process pieces (fast, no jobs)
class _Dev:
    def __init__(self, id: int, process_index: int):
        self.id, self.process_index = id, process_index


def test_local_rows_follow_the_device_order_not_the_ids():
    from jaxstep import distributed

    # Interleaved: this process (0) holds positions 1 and 2, in that order.
    devices = [_Dev(2048, 1), _Dev(0, 0), _Dev(1, 0), _Dev(2049, 1)]
    assert distributed.local_positions(devices) == [1, 2]
    np.testing.assert_array_equal(distributed.local_rows(devices, 8), [2, 3, 4, 5])
    with pytest.raises(ValueError, match="does not divide by the 4 devices"):
        distributed.local_rows(devices, 6)
    batch = {"x": np.arange(16).reshape(8, 2)}
    np.testing.assert_array_equal(distributed.local_batch(batch, devices)["x"][:, 0], [4, 6, 8, 10])


def test_failure_with_a_host_pickles_and_the_report_names_it(tmp_path):
    import pickle

    failure = jaxstep.Failure(
        device_id=2049,
        process_index=1,
        step=7,
        status=jaxstep.Status.GRAD_NONFINITE,
        reason="non-finite gradient in ['w']",
        leaf="['w']",
        rows=(20, 24),
        host="worker-1",
    )
    err = pickle.loads(pickle.dumps(jaxstep.TrainingWorkerError([failure])))
    assert err.failures[0].host == "worker-1" and err.device_id == 2049
    report = reports.build(err, process_index=0, root_cause=False, root_cause_process=1)
    reports.write(report, tmp_path)
    back = reports.read(tmp_path)[0]
    assert back["device_host"] == "worker-1"
    assert back["status"] == "GRAD_NONFINITE" and back["step"] == 7 and back["leaf"] == "['w']"
    assert back["failures"][0]["rows"] == [20, 24]


def test_launcher_completes_reports_of_silent_deaths_and_marks_the_blamed_one(tmp_path):
    blame = jaxstep.TrainingWorkerError(
        [jaxstep.Failure(4, 1, 3, jaxstep.Status.HUNG, "its process 1 is lost", None)]
    )
    reports.write(
        reports.build(blame, process_index=0, root_cause=False, root_cause_process=1), tmp_path
    )

    class Proc:
        pid = 4242

    reports.complete(tmp_path, {0: 1, 1: -9}, [Proc(), Proc()])
    found = reports.read(tmp_path)
    assert found[1]["root_cause"] is True and "SIGKILL" in found[1]["reason"]
    assert found[0]["root_cause"] is False
    assert reports.root_cause(tmp_path)["process_index"] == 1


def test_launcher_prefixes_output_stops_the_others_and_returns_the_first_failure(tmp_path):
    import io

    from jaxstep import launch

    script = tmp_path / "child.py"
    script.write_text(
        "import os, sys, time\n"
        "i = int(os.environ['JAXSTEP_PROCESS_ID'])\n"
        "print('hello from', i, os.environ['JAXSTEP_NUM_PROCESSES'],\n"
        "      os.environ['JAX_NUM_CPU_DEVICES'], os.environ['JAXSTEP_COORDINATOR'], flush=True)\n"
        "if i == 1:\n"
        "    sys.exit(3)\n"
        "time.sleep(60)\n"  # process 0 would hang: the launcher must stop it
    )
    out = io.StringIO()
    start = time.monotonic()
    code = launch.launch(
        [sys.executable, str(script)],
        num_processes=2,
        devices_per_process=3,
        error_dir=str(tmp_path / "errors"),
        grace=1.0,
        out=out,
    )
    assert code == 3
    assert time.monotonic() - start < 30  # stopped after the grace, not after 60 s
    text = out.getvalue()
    assert "[p0] hello from 0 2 3 127.0.0.1:" in text
    assert "[p1] hello from 1 2 3 127.0.0.1:" in text
    assert "[launch] process 1 exited with exit code 3" in text
    found = reports.read(tmp_path / "errors")
    assert sorted(found) == [0, 1]  # both failed silently (3, SIGTERM): both reported
    assert [p for p, r in found.items() if r["root_cause"]] == [1]
