"""``jaxstep demo`` and ``jaxstep doctor`` end to end, in process (JAX starts once),
and the README's first command once in a subprocess."""

import json
import os
import subprocess
import sys
from collections import Counter

import jax
import numpy as np
import pytest

from jaxstep._src.cli import _doctor as doctor
from jaxstep._src.cli import _main as cli

PER_DEVICE = 16  # the demo's default


def test_demo_trains_on_digits_and_writes_its_metrics(tmp_path, capsys):
    jsonl, png = tmp_path / "run.jsonl", tmp_path / "run.png"
    goodput = tmp_path / "goodput.png"
    code = cli.main(
        [
            "demo",
            "--steps",
            "8",
            "--jsonl",
            str(jsonl),
            "--plot",
            str(png),
            "--goodput",
            str(goodput),
        ]
    )
    out = capsys.readouterr().out
    assert code == cli.EXIT_OK
    assert "finished 8 steps" in out and "test accuracy" in out
    for d in jax.devices():  # the per-device summary table has a row per device
        assert any(line.split("│")[1:2] == [f" {d.id:<6} "] for line in out.splitlines())
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    records, ended = records[:-1], records[-1]  # the run's goodput, when it ended
    assert [r["step"] for r in records] == list(range(8))
    assert 0.0 <= records[-1]["metrics"]["accuracy"] <= 1.0
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the demo ends with where its time went: the table, the plot, the JSONL's line
    assert ended["event"] == "goodput" and ended["steps"]["productive"] == 8
    assert "jaxstep goodput: " in out and "(8 steps kept)" in out
    assert goodput.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("shard", [[], ["--shard-state", "params"]], ids=["replicated", "params"])
def test_demo_names_the_injected_nan_and_its_example(shard, capsys):
    device = jax.devices()[3].id
    code = cli.main(["demo", "--steps", "12", "--inject", f"nan@device={device},step=5", *shard])
    out = capsys.readouterr().out
    if shard:
        assert "shard_state='params': each device holds" in out
    assert code == cli.EXIT_WORKER_FAILED
    assert f"training worker on device {device} failed: non-finite input in ['image']" in out
    assert "at step 5" in out
    assert f"offending examples (global batch index): [{3 * PER_DEVICE + 1}]" in out
    assert f"err.device_id={device}  err.step=5" in out
    assert "err.diagnosis.verdict='data'" in out
    others = [d.id for d in jax.devices() if d.id != device]
    assert not any(f"training worker on device {d} failed" in out for d in others)
    assert "finished" not in out


def test_demo_skips_a_transient_gradient_fault_under_the_skip_policy(capsys):
    """Also the pmap backend: the CLI drives both through the same public API."""
    device = jax.devices()[2].id
    inject = f"grad@device={device},step=3"
    argv = ["demo", "--steps", "8", "--backend", "pmap", "--policy", "skip", "--inject", inject]
    code = cli.main(argv)
    out = capsys.readouterr().out
    assert code == cli.EXIT_OK
    assert "8 of 8 steps, 1 skipped" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 4}
    assert "1 (step 3)" in rows[str(device)]
    assert all(line.rstrip(" │").endswith("0") for d, line in rows.items() if d != str(device))
    assert "finished 8 steps" in out


def test_demo_leaves_the_injected_nan_out_under_the_drop_policy(capsys):
    device = jax.devices()[3].id
    argv = ["demo", "--steps", "8", "--policy", "drop", "--inject", f"nan@device={device},step=5"]
    code = cli.main(argv)
    out = capsys.readouterr().out
    assert code == cli.EXIT_OK
    assert f"step 5 left out device {device}: non-finite input in ['image']" in out
    assert "8 of 8 steps, 0 skipped, 1 left out" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 4}
    assert "1 (step 5: rows" in rows[str(device)]  # the chunk left out, its batch rows
    assert "finished 8 steps" in out


def test_demo_recovers_the_injected_nan_by_quarantining_its_example(capsys):
    device = jax.devices()[3].id
    argv = ["demo", "--steps", "8", "--inject", f"nan@device={device},step=5", "--recover"]
    code = cli.main(argv)
    out = capsys.readouterr().out
    assert code == cli.EXIT_OK
    example = 3 * PER_DEVICE + 1
    record = f"step 5: data -> quarantined (device {device}); examples [{example}] of batch 5"
    assert f"recovered at {record}" in out  # when taken (Progress)
    assert f"jaxstep: 1 recovery action: 1 quarantined\n  {record}" in out  # at the end, once
    assert out.count(record) == 2
    assert f"{{5: ({example},)}} in " in out and "quarantine.jsonl" in out
    assert "8 of 8 steps, 0 skipped, 1 recovered" in out
    assert "(9/8)" not in out and "finished 8 steps" in out
    assert "TrainingWorkerError" not in out


def test_demo_recovers_a_bad_device_by_training_on_without_it(capsys):
    device = jax.devices()[6].id
    argv = ["demo", "--steps", "7", "--inject", f"inf@device={device},step=4", "--recover"]
    code = cli.main(argv)
    out = capsys.readouterr().out
    assert code == cli.EXIT_OK
    assert f"recovered at step 4: device -> excluded (device {device}) of batch 4" in out
    rest = [d.id for d in jax.devices() if d.id != device]
    assert f"the run ended on 7 devices: {rest}" in out
    assert "finished 7 steps" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["demo", "--inject", "nan@device=99,step=1"], "device 99 is not one of the devices"),
        (["demo", "--steps", "5", "--inject", "nan@device=1,step=5"], "step 5 is not in 0..4"),
        (["demo", "--inject", "fire@device=1,step=2"], "unknown kind 'fire'"),
        (["demo", "--inject", "nan@dev=1"], "expected KIND@device=D,step=S"),
        (["demo", "--steps", "15", "--inject", "corrupt@device=1,step=11"], "--steps 21 or more"),
        (["demo", "--devices", "64"], "--devices 64"),
        (["demo", "--backend", "pmap", "--shard-state", "params"], "needs --backend shard_map"),
        (["doctor", "--corrupt", "99"], "--corrupt 99: no such device"),
    ],
)
def test_usage_errors_exit_2_and_say_what_to_change(argv, words, capsys):
    assert cli.main(argv) == cli.EXIT_USAGE
    assert words in capsys.readouterr().err


def test_doctor_passes_on_healthy_devices(capsys):
    code = cli.main(["doctor", "--devices", "8", "--size", "64"])
    out = capsys.readouterr().out
    assert code == cli.EXIT_OK
    for d in jax.devices():
        assert f"device {d.id:>6}" in out
    assert out.count(" agrees") == len(jax.devices())
    assert "result exact" in out and "doctor: all good" in out
    assert "jax 0." in out and "flax " in out and "backend cpu" in out


def test_doctor_names_the_one_device_whose_bits_differ(capsys):
    bad = jax.devices()[5].id
    code = cli.main(["doctor", "--size", "64", "--corrupt", str(bad)])
    out = capsys.readouterr().out
    assert code == cli.EXIT_WORKER_FAILED
    assert f"device(s) [{bad}] computed different bits" in out
    assert "1 element(s) differ, by up to 1 ulp(s)" in out
    assert out.count(" agrees") == len(jax.devices()) - 1
    results = doctor.scan(jax.devices(), size=32, corrupt=bad)
    assert [r.device_id for r in results if not r.agrees] == [bad]
    assert len({r.digest for r in results if r.agrees}) == 1


def test_doctor_finds_no_majority_between_two_devices():
    results = doctor.scan(jax.devices()[:2], size=32, corrupt=jax.devices()[0].id)
    assert [r.agrees for r in results] == [False, False]


def test_readme_command_exits_nonzero_naming_the_device():
    """``jaxstep demo --steps 30 --inject nan@device=3,step=5``, as a user types it."""
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    argv = ["demo", "--steps", "30", "--inject", "nan@device=3,step=5"]
    done = subprocess.run(
        [sys.executable, "-m", "jaxstep", *argv],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert done.returncode == cli.EXIT_WORKER_FAILED, done.stderr[-2000:]
    assert "training worker on device 3 failed" in done.stdout
    assert "on 8 cpu devices" in done.stdout


def test_digits_are_scikit_learns_and_batches_are_the_same_when_resumed():
    from sklearn.datasets import load_digits

    from jaxstep import data

    train, test = data.digits(seed=3)
    raw = load_digits()
    assert (len(train), len(test)) == (1438, 359)
    assert train.image.shape[1:] == (8, 8, 1) and train.image.dtype == np.float32
    # Every example is one of scikit-learn's, with its label, exactly once.
    pixels = {row.tobytes(): int(label) for row, label in zip(raw.data, raw.target, strict=True)}
    both = np.concatenate([train.image, test.image]).reshape(-1, 64) * 16.0
    labels = np.concatenate([train.label, test.label])
    assert [pixels[row.astype(np.float64).tobytes()] for row in both] == labels.tolist()
    assert len({row.tobytes() for row in both}) == len({row.tobytes() for row in raw.data})
    # Batch i is the same whether the stream starts at 0 or resumes at i (across epochs).
    whole = list(data.batches(train, 128, seed=1, stop=30))
    resumed = list(data.batches(train, 128, seed=1, start=17, stop=30))
    for a, b in zip(whole[17:], resumed, strict=True):
        assert np.array_equal(a["image"], b["image"]) and np.array_equal(a["label"], b["label"])
    per_epoch = len(train) // 128
    seen = Counter(x.tobytes() for b in whole[:per_epoch] for x in b["image"])
    have = Counter(x.tobytes() for x in train.image)
    assert all(n <= have[x] for x, n in seen.items())  # each example at most once an epoch
    assert whole[per_epoch]["image"].shape == (128, 8, 8, 1)
    assert not np.array_equal(whole[0]["image"], whole[per_epoch]["image"])  # a new shuffle
