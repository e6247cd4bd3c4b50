"""Restarting a job after a hang: ``python -m jaxstep.launch --restarts N`` (and
``scripts/tpu_vm/launch.sh``) start the job again when the first process to fail exited
with ``RESTART_EXIT_CODE`` or was killed by a signal, and never after an ordinary
failure; ``fit(recover=...)`` under the launcher (``$JAXSTEP_RESTART`` set) exits with
that code after a hang's emergency save, and the restarted job resumes from the last
verified checkpoint (without a launcher the hang is raised: tests/loop/test_hang.py).

The launcher's rule is tested with tiny child scripts (no JAX), launch.sh with a fake
``gcloud`` on ``PATH``; one end-to-end run trains in a subprocess that hangs on its
first attempt."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import jaxstep
from jaxstep import launch
from jaxstep.distributed import reports

ROOT = Path(__file__).resolve().parents[2]

# argv[1 + attempt] is this attempt's exit code (the last one repeats); KILL: SIGKILL.
CHILD = """
import os, signal, sys
attempt = int(os.environ["JAXSTEP_RESTART"])
print("attempt", attempt, flush=True)
code = sys.argv[1:][min(attempt, len(sys.argv) - 2)]
if code == "KILL":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(code))
"""


def run_launcher(codes: list[str], restarts: int, **kwargs) -> tuple[int, str]:
    out = io.StringIO()
    code = launch.launch(
        [sys.executable, "-c", CHILD, *codes],
        num_processes=kwargs.pop("num_processes", 1),
        restarts=restarts,
        out=out,
        **kwargs,
    )
    return code, out.getvalue()


def test_the_exit_code_is_ex_tempfail_where_the_process_and_its_launcher_read_it():
    assert jaxstep.RESTART_EXIT_CODE == jaxstep._src.core.RESTART_EXIT_CODE == 75


def test_a_requested_restart_runs_the_job_again_and_its_last_attempt_decides():
    code, out = run_launcher(["75", "0"], restarts=2)
    assert code == 0, out
    assert "[p0] attempt 0" in out and "[p0] attempt 1" in out and "attempt 2" not in out
    assert (
        "[launch] process 0 exited with code 75 (restart requested); restarting the job (1 of 2)"
        in out
    )


def test_an_ordinary_failure_is_not_restarted():
    code, out = run_launcher(["1", "0"], restarts=2)
    assert code == 1, out
    assert "attempt 1" not in out and "restarting" not in out


def test_a_crash_is_restarted_and_when_the_restarts_run_out_the_failing_code_stays():
    code, out = run_launcher(["KILL", "75"], restarts=1)
    assert code == 75, out
    assert "was killed by signal SIGKILL (a crash); restarting the job (1 of 1)" in out
    assert "exited with code 75 (restart requested); no restart left (--restarts 1)" in out
    assert out.count("attempt") == 2


def test_without_restarts_a_requested_restart_is_the_exit_code():
    code, out = run_launcher(["75", "0"], restarts=0)
    assert code == 75 and "attempt 1" not in out, out


def test_the_first_failure_decides_the_others_are_stopped_and_reports_set_aside(tmp_path):
    # Attempt 0: process 1 asks for a restart at once; process 0 would run on (stopped
    # after the grace). Attempt 1: both succeed.
    child = (
        "import os, sys, time\n"
        "attempt, me = int(os.environ['JAXSTEP_RESTART']), int(os.environ['JAXSTEP_PROCESS_ID'])\n"
        "print('attempt', attempt, flush=True)\n"
        "if attempt == 0 and me == 1:\n"
        "    sys.exit(75)\n"
        "if attempt == 0:\n"
        "    time.sleep(60)\n"
    )
    out = io.StringIO()
    errors = tmp_path / "errors"
    code = launch.launch(
        [sys.executable, "-c", child],
        num_processes=2,
        restarts=1,
        grace=0.5,
        error_dir=str(errors),
        out=out,
    )
    text = out.getvalue()
    assert code == 0, text
    assert "[launch] stopping the others 0.5 s after process 1 failed" in text
    assert "process 1 exited with code 75 (restart requested); restarting the job (1 of 1)" in text
    assert text.count("] attempt 1") == 2
    # Attempt 0's reports (written by the launcher: the children wrote none) moved aside.
    assert sorted(reports.read(errors / "attempt-0")) == [0, 1]
    assert reports.read(errors) == {}


def test_restarts_must_be_a_count():
    with pytest.raises(ValueError, match="restarts must be an int >= 0"):
        launch.launch(["true"], num_processes=1, restarts=-1)


# ----------------------------------------------------------------- launch.sh
FAKE_GCLOUD = """#!/usr/bin/env bash
# gcloud compute tpus tpu-vm VERB ...: ssh runs the command as two workers at once.
[[ "$4" == ssh ]] || exit 0
while (($#)); do [[ "$1" == --command ]] && break; shift; done
[[ "$2" == *"pip install"* ]] && exit 0
for w in 0 1; do (cd "$HOME" && WORKER=$w bash -c "$2") & done
status=0
for job in $(jobs -p); do wait "$job" || status=1; done
exit $status
"""

# Plays train.py on worker $WORKER: $PLAN_<attempt>_<worker> is "SECONDS CODE".
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$JAXSTEP_RESTART $WORKER" >> "$HOME/calls"  # attempt, worker
plan="PLAN_${JAXSTEP_RESTART}_${WORKER}"
read -r seconds code <<< "${!plan:-0 0}"
sleep "$seconds"
if [[ "$code" == KILL ]]; then kill -KILL $$; fi
exit "$code"
"""


def run_launch_sh(tmp_path: Path, plan: dict[str, str], restarts: int) -> tuple[int, str, list]:
    home = tmp_path / "home"
    for path, text in (
        (tmp_path / "bin" / "gcloud", FAKE_GCLOUD),
        (home / "jaxstep-venv" / "bin" / "python", FAKE_PYTHON),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    (home / "jaxstep").mkdir()
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "HOME": str(home),
        "TMPDIR": str(tmp_path),
        "TPU_NAME": "fake",
        "ZONE": "nowhere",
        **{f"PLAN_{k}": v for k, v in plan.items()},
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "tpu_vm" / "launch.sh"), "--restarts", str(restarts)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    calls = sorted((home / "calls").read_text().split("\n")[:-1])
    return proc.returncode, proc.stdout + proc.stderr, calls


def test_launch_sh_restarts_when_the_first_worker_to_fail_asks(tmp_path):
    # Worker 1 asks first; worker 0's later ordinary failure (a lost peer) does not count.
    plan = {"0_1": "0 75", "0_0": "0.5 1"}
    code, out, calls = run_launch_sh(tmp_path, plan, restarts=2)
    assert code == 0, out
    assert calls == ["0 0", "0 1", "1 0", "1 1"]
    assert "exited with code 75 (restart requested); restarting the job (1 of 2)" in out


def test_launch_sh_does_not_restart_an_ordinary_failure(tmp_path):
    plan = {"0_1": "0 1", "0_0": "0.5 75"}
    code, out, calls = run_launch_sh(tmp_path, plan, restarts=2)
    assert code == 1, out
    assert calls == ["0 0", "0 1"]


def test_launch_sh_restarts_a_crash_until_the_restarts_run_out(tmp_path):
    plan = {"0_0": "0 KILL", "1_0": "0 75", "1_1": "0 75"}
    code, out, calls = run_launch_sh(tmp_path, plan, restarts=1)
    assert code == 75, out
    assert calls == ["0 0", "0 1", "1 0", "1 1"]
    assert "was killed by signal 9 (a crash); restarting the job (1 of 1)" in out
    assert "no restart left (RESTARTS=1)" in out


# ------------------------------------------------------------- end to end
TRAIN = """
import json, os, sys
import jax, optax
import jaxstep
from jaxstep._src.step import runtime_of
from jaxstep.testing import Fault
from tests.models import init_params, loss_fn, make_batches

attempt = int(os.environ["JAXSTEP_RESTART"])
assert len(jax.devices()) == 8
# The first attempt hangs at step 3 (device 5 sleeps past step_timeout); the second does not.
faults = [Fault("stall", device_id=jax.devices()[5].id, step=3, seconds=20)] if attempt == 0 else []
step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), faults=faults)
history = jaxstep.History()
state = jaxstep.fit(
    step, step.init(init_params()), make_batches(8), history=history,
    recover=jaxstep.Recover(), step_timeout=3.0,
    checkpoint_dir=sys.argv[1], checkpoint_every=2, resume=True,
)
final = int(runtime_of(step).read_first(state.step))
print("RESULT " + json.dumps({"attempt": attempt, "steps": history.step, "final": final}))
"""


@pytest.mark.timeout(200)
def test_a_hang_exits_75_and_the_restarted_job_resumes_from_the_last_verified_checkpoint(
    tmp_path,
):
    script, ckpt = tmp_path / "train.py", tmp_path / "ckpt"
    script.write_text(TRAIN)
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "jaxstep.launch", "-n", "1", "--devices-per-process", "8"),
            *("--restarts", "1", "--grace", "5", str(script), str(ckpt)),
        ],
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    # Attempt 0: the hang, its emergency save, the checkpoint to go on from, the exit.
    assert "training worker on device 5 failed: did not finish its part of the step" in out
    assert "the latest verified checkpoint is step 2" in out
    assert "exiting with code 75 (jaxstep.RESTART_EXIT_CODE)" in out
    assert (ckpt / "emergency" / "step_3").is_dir()
    assert (
        "[launch] process 0 exited with code 75 (restart requested); restarting the job (1 of 1)"
        in out
    )
    # Attempt 1: resumed at step 2 (batch 2), trained to the end of the 8 batches.
    prefix = "[p0] RESULT "
    results = [
        json.loads(line[len(prefix) :]) for line in out.splitlines() if line.startswith(prefix)
    ]
    assert results == [{"attempt": 1, "steps": [2, 3, 4, 5, 6, 7], "final": 8}], out[-6000:]


# Two processes x 4 devices, replicas=2: a group is a process's devices. On the first
# attempt process 1's second device fails every step from step 3: excluding it would take
# process 1's whole group, leaving that process no device.
EMPTIED = """
import os, sys
import jax, optax
import jaxstep
from jaxstep import distributed
from jaxstep._src.step import runtime_of
from jaxstep.testing import Fault
from tests import child
from tests.models import init_params, loss_fn, make_batches


def main(ckpt):
    attempt = int(os.environ["JAXSTEP_RESTART"])
    devices = jax.devices()
    bad = child.target(devices).id
    faults = [Fault("loss", bad, step=t, mode="device") for t in range(3, 8)]
    if attempt > 0:  # the restarted job runs on devices that work
        faults = []
    step = jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), faults=faults, shard_state="params", shard_min_size=0,
        replicas=2,
    )
    history = jaxstep.History()
    state = jaxstep.fit(
        step, step.init(init_params()), child.local_batches(make_batches(8), devices),
        history=history, recover=jaxstep.Recover(), checkpoint_dir=ckpt, checkpoint_every=2,
        resume=True,
    )
    final = int(runtime_of(step).read_first(state.step))
    child.result(attempt=attempt, steps=list(history.step), final=final, bad=bad)


if __name__ == "__main__":
    child.start(distributed.record(main))
"""


@pytest.mark.timeout(360)
def test_an_exclusion_that_would_empty_a_process_exits_75_and_the_job_restarts(tmp_path):
    script, ckpt = tmp_path / "train.py", tmp_path / "ckpt"
    script.write_text(EMPTIED)
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "jaxstep.launch", "-n", "2", "--devices-per-process", "4"),
            *("--restarts", "1", "--grace", "20", str(script), str(ckpt)),
        ],
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT), "CHILD_LOST_TIMEOUT": "6"},
        capture_output=True,
        text=True,
        timeout=330,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    prefix = "] RESULT "
    results = sorted(
        (json.loads(line.split(prefix, 1)[1]) for line in out.splitlines() if prefix in line),
        key=lambda r: r["process"],
    )
    bad = results[0]["bad"]
    # Attempt 0: the exclusion is refused, the emergency save written, and every
    # process exits for the restart (with code 1 the launcher would have stopped).
    assert (
        f"not recovered: excluding devices [{bad}] leaves process(es) [1] with no device "
        "of this step" in out
    )
    assert out.count("exiting with code 75 (jaxstep.RESTART_EXIT_CODE)") == 2, out[-8000:]
    named = f"the latest verified checkpoint is step 2 ({ckpt / '2'}): the restarted job resumes"
    assert out.count(named) == 2, out[-8000:]
    assert (ckpt / "emergency" / "step_3").is_dir()
    assert "exited with code 75 (restart requested); restarting the job (1 of 1)" in out
    # Attempt 1: both processes resume at step 2 and train the 8 batches to the end.
    want = {"attempt": 1, "steps": [2, 3, 4, 5, 6, 7], "final": 8}
    assert [{k: r[k] for k in want} for r in results] == [want, want], out[-8000:]
